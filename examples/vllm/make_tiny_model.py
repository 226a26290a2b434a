"""Make a tiny Llama model for vLLM, offline: seeded random weights and a tokenizer trained
here with ``tokenizers`` on seeded synthetic text. Nothing is downloaded.

The model is small enough for two vLLM CPU servers on a 2-core machine (4 layers, 2 KV heads
of 64, 4 query heads, hidden 256), and its LM head is scaled up so that greedy decoding is
decided by clear margins rather than by floating-point noise: a disaggregated run and a
colocated run must then produce exactly the same tokens.

Usage: ``python examples/vllm/make_tiny_model.py OUT_DIR [--layers 4] [--seed 0]``
(idempotent: an existing model with the same settings is kept).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


def synthetic_corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Pseudo-words from syllables, in sentences: a corpus with a stable vocabulary."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "zu", "pe", "qua", "dor",
                 "lin", "mar", "tek", "sol", "bri", "gan", "hu", "je", "fo", "wy", "xi", "cre"]
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
                    for _ in range(1500)})
    lines = []
    for _ in range(n_lines):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(5, 20)))
        lines.append(sentence.capitalize() + rng.choice([".", "!", "?", ","]))
    return lines


def make_tokenizer(out: Path, seed: int, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_model(out: Path, seed: int, layers: int, vocab_size: int, lm_head_scale: float,
               kv_heads: int = 2) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
        # Never pick a special token greedily: the answers stay of the asked length.
        model.lm_head.weight[: len(SPECIAL)] = 0.0
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=4, choices=[2, 3, 4, 8, 16])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--lm-head-scale", type=float, default=24.0)
    parser.add_argument("--kv-heads", type=int, default=2, choices=[1, 2, 4],
                        help="KV heads (1: MQA, whose head every TP rank replicates)")
    args = parser.parse_args(argv)
    settings = {"layers": args.layers, "seed": args.seed, "vocab_size": args.vocab_size,
                "lm_head_scale": args.lm_head_scale, "format": 1}
    if args.kv_heads != 2:
        settings["kv_heads"] = args.kv_heads
    stamp = args.out / "kvpush-tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()) == settings:
        print(f"{args.out}: up to date", file=sys.stderr)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(args.out, args.seed, args.vocab_size)
    make_model(args.out, args.seed, args.layers, args.vocab_size, args.lm_head_scale,
               args.kv_heads)
    stamp.write_text(json.dumps(settings))
    print(f"{args.out}: tiny Llama ({args.layers} layers) written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
