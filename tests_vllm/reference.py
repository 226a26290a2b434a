"""Colocated reference: one vLLM engine (no connector) generates greedily for each prompt,
one prompt at a time, with the servers' settings. Run as a script:

    python tests_vllm/reference.py MODEL_DIR IN.json OUT.json [DTYPE [PREFIX_CACHING]]

IN.json: {"prompts": [[token ids], ...], "max_tokens": N}; OUT.json: [[token ids], ...].
PREFIX_CACHING: ``on`` (default) or ``off`` (as a server started with
``--no-enable-prefix-caching``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    model, src, dst = sys.argv[1:4]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(src).read_text())
    extra = {"dtype": sys.argv[4]} if len(sys.argv) > 4 else {}
    caching = len(sys.argv) <= 5 or sys.argv[5] != "off"
    llm = LLM(model=model, block_size=32, max_model_len=4096, optimization_level=0,
              seed=0, enable_prefix_caching=caching, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    out = []
    for ids in job["prompts"]:
        result = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        out.append(list(result[0].outputs[0].token_ids))
    Path(dst).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
