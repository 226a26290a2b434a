"""A tiny decoder-only transformer whose KV cache is paged in NIXL-registered memory.

Plain torch, float32, seeded random weights, no downloads: a few layers of pre-norm
attention (grouped-query, rotary positions) and SwiGLU MLPs. The point is not the text it
writes but that its KV cache behaves like a serving engine's:

* :class:`PagedKVCache` holds K and V of every layer in fixed-size blocks, one CPU tensor per
  layer and per K/V (``[num_blocks, block_size, kv_heads, head_dim]``), allocated once and
  written in place -- so the tensors can be registered with NIXL and described by a
  :class:`kvpush.KVLayout` (:meth:`PagedKVCache.layout`; K and V separate, layer-major).
* :meth:`TinyTransformer.forward` computes any run of tokens ``[start, start + n)`` against
  the blocks of a *block table*: prefill of a whole prompt, prefill of a suffix after cached
  prefix blocks, and a decode step are the same call. Attention reads keys and values only
  from the cache, so KV that arrived over NIXL is used exactly like KV computed here.

Exactness. Greedy decoding split across processes must give the very tokens of one process.
Everything is deterministic for a given sequence of calls with given shapes (float32, one
intra-op thread, rotary angles from a table built once, no reduction whose order depends on
the batch). KV moved by kvpush is the same bytes, so the same calls on either side of a
transfer give the same bits. The LM head is scaled so that logits are tens of units apart:
greedy argmax is then never decided by float rounding (which does differ between, e.g., a
token's KV computed in a batch of 500 and in a batch of 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import kvpush

__all__ = ["ModelConfig", "PagedKVCache", "TinyTransformer"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the tiny model.

    Parameters
    ----------
    vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff
        The usual; ``n_heads`` must be a multiple of ``n_kv_heads`` (grouped-query
        attention).
    rope_theta
        Rotary base.
    max_positions
        Longest sequence (the rotary table's length).
    seed
        Weights are ``torch.randn`` from a generator seeded with this.
    logit_scale
        Standard deviation of the logits; large, so greedy argmax is far from float noise.
    attn_chunk
        Queries per attention matmul in a prefill (bounds the score matrix's memory).
    """

    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    d_ff: int = 256
    rope_theta: float = 10000.0
    max_positions: int = 65536
    seed: int = 0
    logit_scale: float = 30.0
    attn_chunk: int = 256

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError("ModelConfig.n_heads must be a multiple of n_kv_heads")
        if self.head_dim % 2:
            raise ValueError("ModelConfig.head_dim must be even (rotary pairs)")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token, all layers."""
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * 4


class PagedKVCache:
    """K and V of every layer in blocks of ``block_size`` tokens, in memory that never moves.

    Parameters
    ----------
    config
        The model whose KV this holds.
    num_blocks
        Blocks per tensor.
    block_size
        Tokens per block.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16) -> None:
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=torch.float32) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, dtype=torch.float32) for _ in range(config.n_layers)]

    def buffers(self) -> list[torch.Tensor]:
        """The tensors in the order the layout names them: K0, V0, K1, V1, ..."""
        out = []
        for k, v in zip(self.k, self.v, strict=True):
            out += [k, v]
        return out

    def layout(self) -> kvpush.KVLayout:
        """The :class:`kvpush.KVLayout` over these tensors (keep the cache alive while a
        Producer or Consumer uses it)."""
        c = self.config
        return kvpush.KVLayout.from_buffers(
            self.buffers(), num_layers=c.n_layers, num_blocks=self.num_blocks,
            tokens_per_block=self.block_size, num_kv_heads=c.n_kv_heads,
            head_size=c.head_dim, dtype="float32", kv_packed=False)

    def slots(self, table: Sequence[int], start: int, stop: int) -> torch.Tensor:
        """Flat slot index (``block * block_size + offset``) of positions ``[start, stop)``."""
        pos = torch.arange(start, stop, dtype=torch.int64)
        blocks = torch.as_tensor(list(table), dtype=torch.int64)
        if stop > len(blocks) * self.block_size:
            raise ValueError(f"block table of {len(blocks)} blocks cannot hold position "
                             f"{stop - 1}")
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def block_bytes(self, block_id: int) -> bytes:
        """Every byte of one block in every tensor (for checks)."""
        return b"".join(t[block_id].numpy().tobytes() for t in self.buffers())


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class TinyTransformer:
    """Seeded random weights; :meth:`forward` over a :class:`PagedKVCache`.

    Parameters
    ----------
    config
        :class:`ModelConfig`.
    """

    def __init__(self, config: ModelConfig | None = None) -> None:
        self.config = c = config or ModelConfig()
        g = torch.Generator().manual_seed(c.seed)

        def randn(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float32) * std

        d, hq, hkv, hd = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
        self.embed = randn(c.vocab_size, d, std=1.0)
        self.layers = []
        for _ in range(c.n_layers):
            self.layers.append({
                "attn_norm": torch.ones(d),
                "wq": randn(hq * hd, d, std=d ** -0.5),
                "wk": randn(hkv * hd, d, std=d ** -0.5),
                "wv": randn(hkv * hd, d, std=d ** -0.5),
                "wo": randn(d, hq * hd, std=(hq * hd) ** -0.5),
                "mlp_norm": torch.ones(d),
                "w1": randn(c.d_ff, d, std=d ** -0.5),
                "w3": randn(c.d_ff, d, std=d ** -0.5),
                "w2": randn(d, c.d_ff, std=c.d_ff ** -0.5),
            })
        self.final_norm = torch.ones(d)
        # Unit-RMS hidden state times N(0, scale^2 / d) rows: logits ~ N(0, scale^2).
        self.lm_head = randn(c.vocab_size, d, std=c.logit_scale * d ** -0.5)
        # Rotary angles computed once in float64: a position's angles never depend on the
        # shape of the call that uses them.
        inv = c.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.arange(c.max_positions, dtype=torch.float64)[:, None] * inv[None, :]
        self._cos = torch.cos(ang).to(torch.float32)
        self._sin = torch.sin(ang).to(torch.float32)
        self._masks: dict[tuple[int, int], torch.Tensor] = {}

    def _causal(self, m: int, group: int) -> torch.Tensor:
        """``[group * m, m]`` additive mask: 0 where query i may see key j (j <= i), -inf
        elsewhere; rows are (group member, query) as the scores are laid out."""
        key = (m, group)
        mask = self._masks.get(key)
        if mask is None:
            tri = torch.full((m, m), float("-inf")).triu(1)
            mask = tri.repeat(group, 1)
            if len(self._masks) > 64:
                self._masks.clear()
            self._masks[key] = mask
        return mask

    def _rope(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate pairs (first half, second half) of the last dim; x is [n, heads, hd]."""
        n = x.shape[0]
        cos = self._cos[start:start + n][:, None, :]
        sin = self._sin[start:start + n][:, None, :]
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], start: int, cache: PagedKVCache,
                table: Sequence[int]) -> torch.Tensor:
        """Run ``tokens`` at positions ``[start, start + len(tokens))``.

        Writes their K and V into ``cache`` through ``table`` (block ids, one per block of
        positions; it must cover the last position) and attends over positions
        ``[0, start + len(tokens))``, read from the cache: positions before ``start`` must
        already be there (computed earlier, or received over kvpush).

        Returns
        -------
        torch.Tensor
            Logits of the last token, ``[vocab_size]``.
        """
        c = self.config
        n = len(tokens)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if start + n > c.max_positions:
            raise ValueError(f"position {start + n - 1} beyond max_positions {c.max_positions}")
        hq, hkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
        group = hq // hkv
        total = start + n
        new_slots = cache.slots(table, start, total)
        all_slots = cache.slots(table, 0, total)
        x = self.embed[torch.as_tensor(list(tokens), dtype=torch.int64)]
        scale = 1.0 / math.sqrt(hd)
        for li, w in enumerate(self.layers):
            h = _rms_norm(x, w["attn_norm"])
            q = self._rope((h @ w["wq"].T).view(n, hq, hd), start)
            k = self._rope((h @ w["wk"].T).view(n, hkv, hd), start)
            v = (h @ w["wv"].T).view(n, hkv, hd)
            kflat = cache.k[li].view(-1, hkv, hd)
            vflat = cache.v[li].view(-1, hkv, hd)
            kflat[new_slots] = k
            vflat[new_slots] = v
            keys = kflat[all_slots].permute(1, 2, 0)      # [hkv, hd, total]
            vals = vflat[all_slots].transpose(0, 1)       # [hkv, total, hd]
            # Queries grouped by KV head: [hkv, group, n, hd].
            qg = q.view(n, hkv, group, hd).permute(1, 2, 0, 3)
            outs = []
            for c0 in range(0, n, c.attn_chunk):
                c1 = min(n, c0 + c.attn_chunk)
                kv_len = start + c1  # keys this chunk's last query may see
                qc = qg[:, :, c0:c1].reshape(hkv, group * (c1 - c0), hd)
                scores = (qc @ keys[:, :, :kv_len]) * scale   # [hkv, group*m, kv_len]
                # Keys before the chunk are visible to all of its queries; only the chunk's
                # own m x m corner is causal.
                scores[:, :, start + c0:] += self._causal(c1 - c0, group)
                probs = torch.softmax(scores, dim=-1)
                o = probs @ vals[:, :kv_len]                      # [hkv, group*m, hd]
                outs.append(o.view(hkv, group, c1 - c0, hd))
            attn = torch.cat(outs, dim=2).permute(2, 0, 1, 3).reshape(n, hq * hd)
            x = x + attn @ w["wo"].T
            h = _rms_norm(x, w["mlp_norm"])
            gate = torch.nn.functional.silu(h @ w["w1"].T)
            x = x + (gate * (h @ w["w3"].T)) @ w["w2"].T
        last = _rms_norm(x[-1:], self.final_norm)
        return (last @ self.lm_head.T)[0]

    def next_token(self, tokens: Sequence[int], start: int, cache: PagedKVCache,
                   table: Sequence[int]) -> int:
        """Greedy: the argmax of :meth:`forward`'s logits."""
        return int(torch.argmax(self.forward(tokens, start, cache, table)).item())
