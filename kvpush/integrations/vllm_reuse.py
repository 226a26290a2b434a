"""Multi-turn KV reuse in the vLLM adapter: the conversation's KV goes back from the decode
instance to the next turn's prefill instance, by pull (the prefill instance READs) or by
push (the decode instance WRITEs into blocks the prefill instance registered).

Both instances run ``kv_both`` with ``reuse`` on: each has a Producer and a Consumer. The
reverse move is the forward protocol with the roles swapped, so it inherits its leases,
claims, exactly-once releases and failure handling:

- **Decode instance, a turn ends normally.** Its full blocks (prompt and generated tokens
  that have KV) stay held by vLLM (``request_finished`` returns True) and are exported
  under a fresh transfer name (:func:`keep`). The Producer holds them for ``lease_s``, then
  releases them exactly once; vLLM frees them when the worker reports that release. The
  response's ``kv_transfer_params`` name them in vLLM's ``NixlConnector`` bidirectional
  schema (``do_remote_decode``, ``remote_block_ids``, ``remote_num_tokens``,
  ``remote_blocks_expiry_time``, ...) and in kvpush's own (``kvpush_reuse``: the keys a
  forward transfer's response has, for the kept tokens). A streamed answer keeps nothing:
  vLLM's OpenAI server returns ``kv_transfer_params`` only in a non-streamed answer, so no
  next turn could name the kept blocks, and they would sit out the lease (:func:`streamed`).
- **Prefill instance, the next turn arrives** with those params (a proxy passes the decode
  response's ``kv_transfer_params`` as they came, merged with its own forward keys).
  :func:`offer` checks that the new prompt starts with the kept tokens (their fingerprint)
  and the scheduler claims the tokens past its own prefix-cache hit, loaded asynchronously
  into the newly allocated blocks (the tail of the kept blocks: the source is end-aligned).
  A prefix cache that holds all of them loads nothing and lets the decode instance release
  at once.
- **A turn that cannot load** (lease expired, decode instance gone or restarted) fails its
  load; the blocks it named are reported to vLLM as load errors and vLLM recomputes them
  (``kv_load_failure_policy`` ``recompute`` on the prefill instance). Nothing reads a
  released block: a source that was released is refused by its Producer.
- **Load or recompute**, per request: loading the kept tokens the prefix cache lacks must
  beat computing them, or reuse would be slower than no reuse (a prefix cache that holds
  the previous prompt leaves only the previous answer, often cheaper to compute than to
  fetch). :class:`ReuseCosts` estimates both from what this instance measured: each
  completed load (its bytes, and the time from its plan to the step that schedules its
  request's compute: the link's per-transfer latency and bytes/s, and the engine step a
  load adds) and each engine step (its tokens and duration: the prefill time per token).
  Until a load has been measured it loads, to learn, and so it does for a load over twice
  the largest measured; the first load from each decode
  instance is no sample (it waited for the connection too). ``reuse_load`` ``"always"``
  loads whatever the costs.
- **Forward again**: the prefill's hand-off to the decode side is unchanged; the decode
  instance's prefix cache still holds the kept blocks, so only the tail it lacks moves.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..messages import new_id
from .vllm_common import PARAM_NUM_TOKENS, PARAM_PROMPT, prompt_fingerprint

__all__ = ["PARAM_REUSE", "Kept", "Offer", "ReuseCosts", "keep", "kept_params", "kept_tokens",
           "offer", "streamed"]

#: kvpush's key for a kept conversation in ``kv_transfer_params`` (decode response ->
#: next turn's prefill request): a dict with the keys of a forward response.
PARAM_REUSE = "kvpush_reuse"


@dataclass(frozen=True)
class Kept:
    """A finished turn's KV the decode instance keeps: ``tokens`` tokens in ``blocks``."""

    transfer_id: str       # the router-free name: ``reuse.<16 hex>``
    tokens: int
    blocks: list[int]
    prompt: str            # fingerprint of the kept tokens


def kept_tokens(num_computed: int, block_size: int) -> int:
    """Tokens of a finished request whose KV sits in full blocks (only those can be found
    by the next turn's prefix cache)."""
    return (max(0, int(num_computed)) // block_size) * block_size


def streamed(request: Any) -> bool:
    """Whether a request's answer is streamed: vLLM's OpenAI server asks for deltas
    (``RequestOutputKind.DELTA``) exactly when it streams, and drops ``kv_transfer_params``
    from a streamed answer."""
    kind = getattr(getattr(request, "sampling_params", None), "output_kind", None)
    return getattr(kind, "name", None) == "DELTA"


def keep(request: Any, block_ids: Sequence[int], block_size: int) -> Kept | None:
    """What a finished decode request keeps, or None (less than one full block, or a
    streamed answer: nobody learns its name)."""
    if streamed(request):
        return None
    tokens = kept_tokens(getattr(request, "num_computed_tokens", 0), block_size)
    ids = getattr(request, "all_token_ids", None)
    if tokens <= 0 or ids is None or len(ids) < tokens:
        return None
    count = tokens // block_size
    if len(block_ids) < count:
        return None
    prompt = prompt_fingerprint(tokens, list(ids[:tokens]))
    return Kept(f"reuse.{new_id():016x}", tokens, [int(b) for b in block_ids[:count]],
                prompt)


def kept_params(response: Mapping[str, Any], lease_s: float) -> dict[str, Any]:
    """The decode response's ``kv_transfer_params`` for a kept turn, from the forward-style
    response of its export (:func:`~.vllm_common.response_params`): vLLM's bidirectional
    keys at the top (no ``kvpush_id`` there: the next turn's own name is the proxy's to
    give) and kvpush's under :data:`PARAM_REUSE`."""
    out = {k: v for k, v in response.items() if not k.startswith("kvpush_")}
    out["do_remote_prefill"], out["do_remote_decode"] = False, True
    # vLLM's is on the decode instance's perf_counter; this one is wall-clock time
    out["remote_blocks_expiry_time"] = time.time() + lease_s
    out[PARAM_REUSE] = {k: v for k, v in response.items() if k.startswith("kvpush_")}
    return out


@dataclass(frozen=True)
class Offer:
    """A prefill request's kept prefix: ``tokens`` tokens at the decode instance,
    ``params`` to parse as a forward response (:class:`~.vllm_common.RemotePrefill`)."""

    tokens: int
    params: Mapping[str, Any]
    prompt: str


def offer(params: Mapping[str, Any] | None, prompt_ids: Sequence[int] | None,
          num_prompt: int, block_size: int) -> Offer | None:
    """The kept prefix a prefill request may load, or None: no ``kvpush_reuse``, a
    malformed one, a prompt that does not start with the kept tokens, or nothing left to
    compute after them (vLLM must compute at least one token)."""
    if not params:
        return None
    inner = params.get(PARAM_REUSE)
    if not isinstance(inner, Mapping):
        return None
    tokens = inner.get(PARAM_NUM_TOKENS)
    prompt = inner.get(PARAM_PROMPT)
    if (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0
            or tokens % block_size or tokens >= num_prompt or not isinstance(prompt, str)
            or prompt_ids is None or len(prompt_ids) < tokens):
        return None
    if prompt_fingerprint(tokens, list(prompt_ids[:tokens])) != prompt:
        return None
    return Offer(tokens, inner, prompt)


def _line(samples: Iterable[tuple[float, float]]) -> tuple[float, float, float, float] | None:
    """Least squares ``y = a + b x`` over ``(x, y)`` samples: (a, b, mean x, mean y), a and
    b clamped to >= 0; None without samples. ``b`` is -1 when the x values are too alike
    (spread under 10 % of their mean) to tell a fixed cost from a per-unit one."""
    pts = list(samples)
    if not pts:
        return None
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if n < 2 or sxx <= (0.1 * mx) ** 2 * n:       # spread under 10 % of the mean
        return 0.0, -1.0, mx, my
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    a = my - b * mx
    if b < 0:
        return my, 0.0, mx, my
    if a < 0:
        return 0.0, my / mx if mx > 0 else 0.0, mx, my
    return a, b, mx, my


class ReuseChoice(NamedTuple):
    """Whether to load the kept tokens a prefix cache lacks, from which estimates (whole
    microseconds; None: unmeasured), and why when the estimates did not decide it."""

    load: bool
    load_us: int | None
    compute_us: int | None
    why: str


class ReuseCosts:
    """The prefill instance's measured costs of loading kept tokens and of computing them.

    ``observe_load(nbytes, seconds)``: a completed load, from its plan to the step that
    schedules its request's compute (what the request waits: vLLM learns a load ended at
    a step's end and computes in the next). ``observe_step(tokens, seconds)``: an engine
    step that ran ``tokens`` tokens. Each is fitted as a line over the last ``window`` samples: the
    link's per-transfer latency and seconds per byte, the engine's fixed step cost and
    seconds per token (computing ``n`` more tokens in a step costs ``n`` times that).

    Where the samples cannot tell the two terms apart (their sizes too alike): a load
    costs at least the measured mean, scaled up with size (a small load is not assumed
    cheaper than the ones measured). A token costs at least its share of the mean step.
    """

    def __init__(self, window: int = 64) -> None:
        self._loads: deque[tuple[float, float]] = deque(maxlen=window)
        self._steps: deque[tuple[float, float]] = deque(maxlen=window)

    def observe_load(self, nbytes: float, seconds: float) -> None:
        if nbytes > 0 and seconds >= 0:
            self._loads.append((float(nbytes), float(seconds)))

    def observe_step(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds >= 0:
            self._steps.append((float(tokens), float(seconds)))

    def load_s(self, nbytes: float) -> float | None:
        """Estimated seconds to load ``nbytes`` (None: no load measured yet)."""
        fit = _line(self._loads)
        if fit is None:
            return None
        a, b, mx, my = fit
        if b < 0:
            return my * max(1.0, nbytes / mx) if mx > 0 else my
        return a + b * nbytes

    def recompute_s(self, tokens: int) -> float | None:
        """Estimated seconds ``tokens`` more tokens add to a step (None: no step measured)."""
        fit = _line(self._steps)
        if fit is None:
            return None
        _, b, mx, my = fit
        # At least the steps' mean share per token: steps slowed by other work on the
        # machine can tilt the fit to a slope several times below it, and computing
        # would then look cheaper than it is.
        return max(b, my / mx if mx > 0 else 0.0) * tokens

    def choose(self, tokens: int, nbytes: float) -> ReuseChoice:
        """Load ``tokens`` kept tokens (``nbytes``) or compute them here. Load when no load
        or no step has been measured yet, or when the load is over twice the largest one
        measured (to learn: the fit says little that far out, and choosing to compute
        would never measure it); else load when the estimated load is cheaper, compared
        in whole microseconds (the figures the choice is logged with)."""
        load, compute = _us(self.load_s(nbytes)), _us(self.recompute_s(tokens))
        if load is None or compute is None:
            return ReuseChoice(True, load, compute, "nothing measured yet")
        if nbytes > 2 * max(b for b, _ in self._loads):
            return ReuseChoice(True, load, compute, "over twice the largest load measured")
        return ReuseChoice(load < compute, load, compute, "")


def _us(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1e6)
