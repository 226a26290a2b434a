"""Hybrid models in the vLLM adapter: several KV cache groups (vLLM's hybrid memory
allocator, HMA), full attention beside sliding-window attention.

What vLLM 0.32 does with several groups (``vllm/v1/core/kv_cache_utils.py``,
``get_kv_cache_config_from_groups``; ``vllm/v1/worker/utils.py``, ``allocate_kv_cache``):
every group's layers are views into **one** backing allocation, and the groups overlay each
other from byte 0 -- layer *i* of group 0 and layer *i* of group 1 address the same bytes.
That is sound because all groups allocate from **one** block pool: a block id belongs to
one group at a time. So a block id names the same bytes in every group, and a kvpush layout
over the distinct views (one region per overlaid layer slot, which
:func:`~kvpush.integrations.vllm_worker.layout_from_kv_caches` already builds: aliased
layers are registered once) moves a group's block correctly whichever group owns it. A
request's transfer is then one flat block list, the union of what each group needs, in an
order both instances compute alike (:func:`transfer_blocks`):

* full-attention groups: every prompt block from the first one the decode side lacks;
* sliding-window groups: only the blocks holding the last ``window`` prompt tokens (the
  decode side recomputes the last prompt token, which attends to the ``window`` tokens
  ending with it); the out-of-window blocks vLLM gives as its null block never move.

The entries are ordered by block position, then group: a decode-side prefix hit of ``h``
blocks needs exactly the entries at positions ``>= h``, a suffix of the prefill's list,
so kvpush's ``source_tail`` alignment (the prefill sends the last ``len(dst)`` entries)
holds unchanged. Both sides' groups (kind, layers, block size, window) are in the layout's
compatibility identity (:func:`group_identity`): two instances that group differently are
refused at the handshake, naming the field.

Mamba / SSM / linear-attention groups (``MambaSpec``) hold one state slot per request (with
vLLM's ``mamba_cache_mode`` ``"none"``, i.e. prefix caching off; other modes are refused at
start-up). The slot is a block of the same pool, overlaid on the attention layers' pages
(vLLM pads the state to the attention page size), so it moves as one more entry of the
flat list, once, at its end. The state must be the one *before* the last prompt token (the
decode side computes that token itself, from the state; recomputing it from the state
after the whole prompt would apply it twice), so the prefill instance computes the prompt
less its last token (:func:`state_backoff`), as vLLM's NixlConnector does.

No vLLM import: vLLM's objects are read through the attributes named here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["FULL", "MAMBA", "SLIDING", "CacheGroup", "cache_groups_of", "group_identity",
           "state_backoff", "transfer_blocks", "window_start"]

FULL = "full_attention"
SLIDING = "sliding_window"
MAMBA = "mamba"

#: vLLM's spec classes -> the kind kvpush moves them as.
_KINDS = {
    "FullAttentionSpec": FULL,
    "MLAAttentionSpec": FULL,
    "SlidingWindowSpec": SLIDING,
    "SlidingWindowMLASpec": SLIDING,
}


@dataclass(frozen=True)
class CacheGroup:
    """One of vLLM's KV cache groups, as kvpush moves it.

    Parameters
    ----------
    kind
        :data:`FULL` or :data:`SLIDING`.
    layers
        vLLM's layer names in the group, in its order.
    block_size
        Tokens per block of the group.
    window
        Sliding window in tokens (:data:`SLIDING` only, else 0).
    """

    kind: str
    layers: tuple[str, ...]
    block_size: int
    window: int = 0


def cache_groups_of(kv_cache_config: Any, block_size: int) -> tuple[CacheGroup, ...]:
    """vLLM's ``kv_cache_config.kv_cache_groups`` as :class:`CacheGroup` s. Raises
    ``NotImplementedError`` naming the group for a kind kvpush cannot move (chunked local
    attention, Mamba state kept per block position or with speculative slots, ...) or an
    attention group whose block size is not ``block_size`` (one kvpush block is one vLLM
    block of every attention group). One group is returned as it is, unclassified."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    out: list[CacheGroup] = []
    for i, group in enumerate(groups):
        spec = getattr(group, "kv_cache_spec", group)
        name = type(spec).__name__
        kind = _KINDS.get(name)
        layers = tuple(str(n) for n in (getattr(group, "layer_names", None) or ()))
        if name == "MambaSpec" and len(groups) > 1:
            out.append(_mamba_group(i, spec, layers))
            continue
        if len(groups) == 1:
            # One group: every block id is the request's, as before hybrid support (what
            # the layout makes of the tensors decides what is served).
            return (CacheGroup(kind or name, layers, block_size),)
        if kind is None:
            all_kinds = ", ".join(type(getattr(g, "kv_cache_spec", g)).__name__
                                  for g in groups)
            raise NotImplementedError(
                f"kvpush: KV cache group {i} is {name} (groups: {all_kinds}); kvpush moves "
                "full-attention and sliding-window groups only")
        size = int(getattr(spec, "block_size", block_size))
        if size != block_size and len(groups) > 1:
            raise NotImplementedError(
                f"kvpush: KV cache group {i} ({name}) has blocks of {size} tokens, the cache "
                f"{block_size}: kvpush moves groups of one block size")
        window = int(getattr(spec, "sliding_window", 0) or 0) if kind == SLIDING else 0
        if kind == SLIDING and window <= 0:
            raise NotImplementedError(f"kvpush: KV cache group {i} ({name}) names no window")
        out.append(CacheGroup(kind, layers, size, window))
    return tuple(out)


def _mamba_group(i: int, spec: Any, layers: tuple[str, ...]) -> CacheGroup:
    """A Mamba / SSM / linear-attention group: one state slot per request (vLLM's
    ``mamba_cache_mode`` ``"none"``, no speculative slots), else refused."""
    mode = str(getattr(spec, "mamba_cache_mode", "none"))
    where = f"KV cache group {i} (MambaSpec, layers {', '.join(layers) or '?'})"
    if mode != "none":
        raise NotImplementedError(
            f"kvpush: {where} keeps Mamba state per block position (vLLM's mamba_cache_mode "
            f"{mode!r}, set when prefix caching is on); kvpush moves one state per request: "
            "start both instances with --no-enable-prefix-caching")
    if int(getattr(spec, "num_speculative_blocks", 0) or 0):
        raise NotImplementedError(
            f"kvpush: {where} has speculative-decoding state slots; moving them is not "
            "implemented")
    return CacheGroup(MAMBA, layers, int(getattr(spec, "block_size", 0) or 0))


def state_backoff(groups: Sequence[CacheGroup]) -> int:
    """Prompt tokens the prefill side leaves for the decode side to compute: 1 with a Mamba
    group (the decode side computes the last prompt token from the state after the ones
    before it -- recomputing it from the state after the whole prompt would apply it
    twice), else 0 (the decode side recomputes the last token over moved KV)."""
    return 1 if any(g.kind == MAMBA for g in groups) else 0


def group_identity(groups: Sequence[CacheGroup]) -> dict[str, str]:
    """The groups as compatibility-identity entries (``kv_cache_groups``, and per group
    ``kv_cache_group.<i>.kind`` / ``.layers`` / ``.block_size`` / ``.window``), so a
    handshake between instances that group differently is refused naming the field. Empty
    for one group: a single-group deployment's identity (and wire form) is unchanged."""
    if len(groups) <= 1:
        return {}
    out = {"kv_cache_groups": str(len(groups))}
    for i, g in enumerate(groups):
        out[f"kv_cache_group.{i}.kind"] = g.kind
        out[f"kv_cache_group.{i}.layers"] = ",".join(g.layers)
        out[f"kv_cache_group.{i}.block_size"] = str(g.block_size)
        out[f"kv_cache_group.{i}.window"] = str(g.window)
    return out


def window_start(group: CacheGroup, num_tokens: int) -> int:
    """The first block position of a ``num_tokens`` prompt that ``group`` needs on the
    decode side. Full attention: 0. Sliding window: the block of token
    ``num_tokens - window`` -- the decode side recomputes the last prompt token (position
    ``num_tokens - 1``), which attends to the ``window`` tokens ending with it (vLLM's
    ``get_num_skipped_tokens``: the next token ``t`` sees ``[t - window + 1, t]``); later
    tokens see less of the prompt."""
    if group.kind != SLIDING:
        return 0
    return max(0, num_tokens - group.window) // group.block_size


def transfer_blocks(groups: Sequence[CacheGroup], block_ids: Sequence[Sequence[int]],
                    num_tokens: int, first_block: int = 0, null_block: int = 0,
                    sliding_only: bool = False) -> list[int]:
    """The flat block list one request moves: for each block position ``p`` from
    ``first_block`` to the prompt's last block, the block of every group that needs
    position ``p`` (:func:`window_start`), in group order; then each Mamba group's state
    slot (one per request). Both instances compute it from
    their own block tables; a decode-side prefix hit of ``h`` blocks gives the suffix
    starting at position ``h`` of the prefill's list.

    A needed block that is vLLM's ``null_block`` (freed as out of window) raises
    ``ValueError``: its bytes are gone. ``sliding_only`` returns the sliding-window
    groups' entries alone (the blocks the prefill side must keep from vLLM's early frees).
    """
    if len(block_ids) != len(groups):
        raise ValueError(f"kvpush: {len(block_ids)} block lists for {len(groups)} KV cache "
                         "groups")
    attention = [g for g in groups if g.kind != MAMBA]
    if not attention:
        return []
    size = attention[0].block_size
    last = -(-num_tokens // size)
    starts = [window_start(g, num_tokens) for g in groups]
    out: list[int] = []
    for p in range(first_block, last):
        for g, (group, ids) in enumerate(zip(groups, block_ids, strict=True)):
            if (group.kind == MAMBA or p < starts[g]
                    or (sliding_only and group.kind != SLIDING)):
                continue
            if p >= len(ids):
                raise ValueError(f"kvpush: KV cache group {g} ({group.kind}) holds "
                                 f"{len(ids)} blocks, a {num_tokens}-token prompt needs "
                                 f"block {p}")
            block = int(ids[p])
            if block == null_block:
                raise ValueError(f"kvpush: KV cache group {g} ({group.kind}) gives vLLM's "
                                 f"null block at position {p}, inside what the decode side "
                                 "needs")
            out.append(block)
    # Mamba groups: the request's state slot, once, after every block (a decode-side
    # prefix hit shortens the attention part, never this one)
    for g, (group, ids) in enumerate(zip(groups, block_ids, strict=True)):
        if group.kind != MAMBA or sliding_only:
            continue
        slots = [int(b) for b in ids if int(b) != null_block]
        if len(slots) != 1:
            raise ValueError(f"kvpush: KV cache group {g} (mamba) holds {len(slots)} state "
                             f"slots for one request ({list(ids)}), not one")
        out.append(slots[0])
    return out
