"""kvpush in real vLLM, end to end on one machine: make a tiny model offline, start a prefill
and a decode vLLM server with kvpush (prefill on core 0, decode on core 1) and the example
router, send a few requests in push and in pull mode, compare their tokens with a request the
prefill server runs alone (colocated), and stop everything.

Run (after ``bash .ci/bootstrap-vllm``)::

    .venv-vllm/bin/python -m examples.vllm.demo [--workdir /tmp/kvpush-vllm-demo]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from examples.vllm import launch

HERE = Path(__file__).resolve().parent

PROMPTS = [
    "Kalo mine ruvi sato zupe quador lin mar tek sol bri gan hu je fo wy xi cre",
    "Tekmar solbri ganhu jefo wyxi crekalo " * 40,
    "Quador linmar " * 150,
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kvpush-vllm-demo"))
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    model = args.workdir / "tiny-llama"
    subprocess.run([sys.executable, str(HERE / "make_tiny_model.py"), str(model)], check=True,
                   timeout=300)
    logs = args.workdir / "logs"
    kv_port = launch.free_port()
    fleet = launch.Fleet()
    try:
        prefill = fleet.add(launch.start_vllm(
            model, launch.free_port(), name="prefill", cores="0", log_dir=logs,
            extra_args=["-O0"], kv_transfer_config=launch.kvpush_config("kv_producer", kv_port)))
        decode = fleet.add(launch.start_vllm(
            model, launch.free_port(), name="decode", cores="1", log_dir=logs,
            extra_args=["-O0"], kv_transfer_config=launch.kvpush_config("kv_consumer")))
        router = fleet.add(launch.start_router(
            launch.free_port(), prefill=prefill.url, decode=decode.url, log_dir=logs,
            args=["--producers", f"tcp://127.0.0.1:{kv_port}"]))
        print(f"starting vLLM servers (logs in {logs}) ...", flush=True)
        start = time.monotonic()
        launch.wait_healthy([prefill, decode, router], timeout_s=420)
        print(f"healthy after {time.monotonic() - start:.0f} s", flush=True)
        ok = True
        for prompt in PROMPTS:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": args.max_tokens,
                    "temperature": 0, "return_token_ids": True}
            _, alone = launch.http_json(prefill.url + "/v1/completions", body)
            want = alone["choices"][0]["token_ids"]
            for mode in ("push", "pull"):
                t0 = time.perf_counter()
                status, out = launch.http_json(router.url + "/v1/completions",
                                               {**body, "kvpush_mode": mode})
                ms = 1e3 * (time.perf_counter() - t0)
                got = out["choices"][0]["token_ids"] if status == 200 else None
                if got is None:
                    print(f"{mode}: HTTP {status} {out}", flush=True)
                    ok = False
                    continue
                same = next((i for i, (a, b) in enumerate(zip(got, want, strict=False))
                             if a != b), min(len(got), len(want)))
                # The first token must match; a later near-tie may flip under bf16 (the
                # decode instance recomputes the last prompt token as a one-token step).
                ok &= same > 0
                verdict = "== colocated" if got == want else \
                    f"first {same}/{len(want)} tokens == colocated"
                usage = out.get("usage", {})
                print(f"{mode:4s} {usage.get('prompt_tokens', '?'):>5} prompt tokens, "
                      f"{ms:6.0f} ms, {verdict}: {out['choices'][0]['text'][:40]!r}",
                      flush=True)
        metrics = launch.metrics(decode.url, "vllm:kvpush_")
        print({k: v for k, v in metrics.items() if k.endswith(("_total", "_sum", "_count"))})
        return 0 if ok else 1
    finally:
        fleet.stop()


if __name__ == "__main__":
    sys.exit(main())
