"""``benchmarks/vllm/stages.py`` from synthetic stage lines (its inputs come from real vLLM
servers' logs; the joining and arithmetic do not need them): a push through a TP-2 prefill,
a pull, the first token from the prefill, and the errors a user meets."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.vllm import stages as vs

PUSH = """\
(Worker_TP0) INFO [vllm_worker.py:1] kvpush stage 100.000000 registered a1 r0
INFO kvpush stage 100.001000 send_planned a1 r0
INFO kvpush stage 100.001500 send_planned a1 r1
INFO kvpush stage 100.010000 prefill_done a1 r0
INFO kvpush stage 100.012000 prefill_done a1 r1
INFO kvpush stage 100.014000 loaded a1 r0 ready elapsed 0.013000 request cmpl-a1-0-ff
INFO kvpush stage 100.015000 reported cmpl-a1-0-ff r0
INFO kvpush stage 100.016000 released a1 r1 transferred
"""
ROUTER = """\
2026-12-01 router INFO kvpush stage 99.999000 router_in a1 router push
2026-12-01 router INFO kvpush stage 100.012500 prefill_answered a1 router
2026-12-01 router INFO kvpush stage 100.020000 first_chunk a1 router decode
2026-12-01 router INFO kvpush stage 100.500000 router_in b2 router pull
2026-12-01 router INFO kvpush stage 100.520000 prefill_answered b2 router
2026-12-01 router INFO kvpush stage 100.540000 first_chunk b2 router decode
2026-12-01 router INFO kvpush stage 101.000000 router_in c3 router push
2026-12-01 router INFO kvpush stage 101.020000 first_chunk c3 router prefill
"""
PULL = """\
INFO kvpush stage 100.505000 send_planned b2 r0
INFO kvpush stage 100.515000 prefill_done b2 r0
INFO kvpush stage 100.525000 pull_started b2 r0
INFO kvpush stage 100.528000 loaded b2 r0 ready elapsed 0.002000 request cmpl-b2-0-aa
INFO kvpush stage 100.529000 reported cmpl-b2-0-aa r0
"""


def write(tmp_path: Path) -> Path:
    """The lines as the three processes log them, each in its own file."""
    push, pull = PUSH.splitlines(), PULL.splitlines()
    prefill = [push[i] for i in (1, 2, 3, 4, 7)] + pull[:2]
    decode = ["INFO some other line"] + [push[i] for i in (0, 5, 6)] + pull[2:]
    (tmp_path / "prefill.log").write_text("\n".join(prefill) + "\n")
    (tmp_path / "decode.log").write_text("\n".join(decode) + "\n")
    (tmp_path / "router-1.log").write_text(ROUTER)
    return tmp_path


def test_push_steps_use_the_last_prefill_rank_and_the_loops_moment(tmp_path: Path) -> None:
    reqs = vs.parse([str(write(tmp_path))])
    steps = reqs["a1"].steps()
    assert steps["router -> prefill sched"] == pytest.approx(2.0)     # first rank scheduled
    assert steps["prefill forward"] == pytest.approx(11.0)           # to the last rank done
    assert steps["hand-over"] == pytest.approx(1.0)                  # 100.013 - 100.012
    assert steps["engine pickup"] == pytest.approx(1.0)
    assert steps["to first chunk"] == pytest.approx(5.0)
    assert steps["TTFT at router"] == pytest.approx(21.0)
    assert "pull: router -> READ" not in steps


def test_pull_steps_and_first_token_from_prefill(tmp_path: Path) -> None:
    reqs = vs.parse([str(write(tmp_path))])
    pull = reqs["b2"].steps()
    assert pull["pull: router -> READ"] == pytest.approx(10.0)
    assert pull["hand-over"] == pytest.approx(2.0)                   # READ start -> ready
    assert pull["engine pickup"] == pytest.approx(1.0)
    early = reqs["c3"]
    assert early.label == "push, first token from prefill"
    assert "to first chunk" not in early.steps()        # the decode is not on that path
    summary = vs.summarize(reqs)
    assert set(summary) == {"push, first token from decode", "pull, first token from decode",
                            "push, first token from prefill"}
    row = summary["push, first token from decode"]["TTFT at router"]
    assert row == {"n": 1, "p50": 21.0, "p90": 21.0}
    assert "| push, first token from decode (1) |" in vs.table(summary)


def test_cli_says_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert vs.main([str(tmp_path)]) == 2                   # no log files
    (tmp_path / "x.log").write_text("INFO nothing here\n")
    assert vs.main([str(tmp_path)]) == 1
    assert "--stage-log" in capsys.readouterr().err
    write(tmp_path)
    assert vs.main([str(tmp_path), "--json"]) == 0
    assert '"TTFT at router"' in capsys.readouterr().out
