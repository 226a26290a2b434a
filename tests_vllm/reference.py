"""Colocated reference: one vLLM engine (no connector) generates greedily for each prompt,
one prompt at a time, with the servers' settings. Run as a script:

    python tests_vllm/reference.py MODEL_DIR IN.json OUT.json [DTYPE [PREFIX_CACHING]]
    python tests_vllm/reference.py --serve FD

IN.json: {"prompts": [[token ids], ...], "max_tokens": N}; OUT.json: [[token ids], ...].
PREFIX_CACHING: ``on`` (default) or ``off`` (as a server started with
``--no-enable-prefix-caching``).

``--serve FD``: vLLM is imported once and jobs come one per line on standard input, as JSON
``{"model", "src", "dst", "dtype" (or null), "prefix_caching"}``; each job's engine is made,
used and dropped in turn, and a line ``{"ok": true}`` or ``{"ok": false, "error": ...}``
answers it on file descriptor FD. Standard input's end ends the process. (The test session
keeps one such process: a fresh one per model spent ~15 s importing vLLM each time.)
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path


def generate(model: str, src: str, dst: str, dtype: str | None = None,
             prefix_caching: bool = True, attention_backend: str | None = None) -> None:
    """Write to ``dst`` the greedy tokens of each prompt of ``src`` (``attention_backend``:
    vLLM's, by name; None: vLLM's choice)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(src).read_text())
    extra: dict[str, str] = {"dtype": dtype} if dtype else {}
    if attention_backend:
        extra["attention_backend"] = attention_backend
    llm = LLM(model=model, block_size=32, max_model_len=4096, optimization_level=0,
              seed=0, enable_prefix_caching=prefix_caching, **extra)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
        out = []
        for ids in job["prompts"]:
            result = llm.generate([TokensPrompt(prompt_token_ids=ids)], params,
                                  use_tqdm=False)
            out.append(list(result[0].outputs[0].token_ids))
        Path(dst).write_text(json.dumps(out))
    finally:
        del llm
        gc.collect()


def serve(fd: int) -> None:
    with os.fdopen(fd, "w", buffering=1) as reply:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                job = json.loads(line)
                generate(job["model"], job["src"], job["dst"], job.get("dtype"),
                         job.get("prefix_caching", True), job.get("attention_backend"))
                answer: dict[str, object] = {"ok": True}
            except Exception as exc:  # answer it; the next job may still run
                traceback.print_exc()
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.flush()
            reply.write(json.dumps(answer) + "\n")


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]))
        return
    model, src, dst = sys.argv[1:4]
    dtype = sys.argv[4] if len(sys.argv) > 4 else None
    generate(model, src, dst, dtype, len(sys.argv) <= 5 or sys.argv[5] != "off")


if __name__ == "__main__":
    main()
