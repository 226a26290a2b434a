"""Scheduler side of the vLLM adapter: decides, per request and per engine step, what the
worker side moves. Runs in vLLM's EngineCore process; it owns no NIXL state (the worker
side's Producer / Consumer do) and imports neither vLLM nor torch: vLLM objects are used
through the few attributes named here.

Prefill instance (``do_remote_decode``): when a request's *last prefill chunk* is scheduled,
its prompt blocks go into that step's plan; the worker calls ``Producer.prefill_done`` right
after the forward pass, so a push starts as soon as the KV exists (not one step later, when
the scheduler learns the request finished). ``request_finished`` then keeps the blocks
(``True``) until the worker reports the Producer released them -- exactly once, for every
outcome -- and returns the ``kv_transfer_params`` the router relays (pull: the tickets).

Decode instance (``do_remote_prefill``): ``get_num_new_matched_tokens`` claims the prompt
tokens not already in the local prefix cache, loaded asynchronously;
``update_state_after_alloc`` turns the newly allocated blocks into a plan that the worker
starts *before* the step's forward pass (push: ``Consumer.expect``, the registration the
Producer waits for; pull: ``Consumer.pull``). Only blocks missing locally are moved; a
request with nothing to move still completes the protocol with an empty block list, so the
prefill instance releases its blocks at once.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..messages import PullTicket, encode_ids, new_id
from ..request import TransferMode
from .vllm_common import (
    PARAM_MODE,
    PARAM_NUM_TOKENS,
    PARAM_PROMPT,
    AdapterConfig,
    RecvPlan,
    RemotePrefill,
    SendPlan,
    StepPlan,
    base_request_id,
    mode_of,
    prompt_blocks,
    prompt_fingerprint,
    response_params,
    transfer_id_of,
    wire_id,
)
from .vllm_hybrid import cache_groups_of, state_backoff, transfer_blocks
from .vllm_reuse import ReuseChoice, ReuseCosts, keep, kept_params, offer

__all__ = ["KVPushScheduler", "RankInfo"]

log = logging.getLogger("kvpush.vllm")
stage_log = logging.getLogger("kvpush.stages")

#: Past ``transfer_timeout_s``, how long a preempted send's blocks stay pinned for want of
#: every rank's report that its transfer ended.
_ENDING_MARGIN_S = 5.0

#: Kept turns remembered as taken (a conversation's next turns name newer ones).
_USED_KEPT = 4096

#: Request states in which a prefill finished normally (vLLM's ``RequestStatus`` names).
_NORMAL_FINISH = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"})


@dataclass(frozen=True)
class RankInfo:
    """A worker rank's kvpush endpoint, from its handshake metadata."""

    role: str
    name: str
    address: str
    host: str = ""
    port: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0


@dataclass
class _Ending:
    """The pinned source blocks of a preempted request's send, until every worker rank
    reports its transfer ended (``KVPushWorker.take_ended``) or ``deadline`` passes."""

    blocks: list[Any]
    deadline: float           # time.monotonic(): the longest a WRITE can still read them
    reports: int = 0


@dataclass
class _Send:
    req_id: str
    transfer_id: str          # kvpush's request id: wire_id(name, prompt)
    mode: TransferMode
    src: list[int]
    num_tokens: int
    issued_at: float          # wall clock, before prefill_done (a conservative lease start)
    sid: int                  # the source use, in the tickets and in every rank's prefill_done
    name: str = ""            # the router's name for the transfer (in the response)
    prompt: str = ""          # the prompt's fingerprint (in the response)


class KVPushScheduler:
    """The scheduler-side half of ``KVPushConnector`` (see the module docstring)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: AdapterConfig) -> None:
        ktc = vllm_config.kv_transfer_config
        self.config = config
        self.engine_id: str = ktc.engine_id
        self.block_size: int = vllm_config.cache_config.block_size
        self.is_producer: bool = bool(ktc.is_kv_producer)
        self.is_consumer: bool = bool(ktc.is_kv_consumer)
        # worker ranks that each report a preempted send's end (with or without their
        # handshake metadata)
        parallel = getattr(vllm_config, "parallel_config", None)
        self.num_workers = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        # Several groups (vLLM's hybrid allocator): full-attention, sliding-window and Mamba
        # state groups are moved as one flat block list per request
        # (kvpush.integrations.vllm_hybrid); other kinds are refused here, naming the group.
        self.groups = cache_groups_of(kv_cache_config, self.block_size)
        self.hybrid = len(self.groups) > 1
        # Mamba state: the prefill stops one token short, the decode computes that token
        self.backoff = state_backoff(self.groups)
        self._full_tokens: dict[str, int] = {}   # prefill req id -> prompt before backoff
        # prefill side: the blocks each planned send's transfer reads, held by kvpush (one
        # reference in vLLM's block pool) until the source is handed back (see _maybe_send)
        self._pins: dict[str, list[Any]] = {}
        self._kv_manager: Any = None
        self._ranks: dict[int, RankInfo] = {}
        self._prompts: dict[str, str] = {}       # req id -> prompt fingerprint (both sides)
        # prefill side
        self._candidates: dict[str, Any] = {}    # req id -> Request, until its prefill is done
        self._sends: dict[str, _Send] = {}       # issued, not yet reported finished_sending
        self._send_aborts: list[tuple[str, int]] = []   # (transfer id, sid)
        # requests whose send is planned and that vLLM still runs (their Request objects,
        # to export again if vLLM preempts them)
        self._sent_requests: dict[str, Any] = {}
        # sends of preempted requests whose transfer is ending: their blocks stay pinned
        # until every worker rank reports that no transfer reads them (see _Ending)
        self._ending: dict[str, _Ending] = {}     # transfer id -> its pins
        # kvpush request id of each live do_remote_decode request: another request's finish
        # never aborts a transfer one of these holds
        self._exports: dict[str, str] = {}
        # decode side
        self._claims_new: list[RecvPlan] = []    # pulls to claim (the request waits)
        self._recv_new: list[RecvPlan] = []
        self._recv_aborts: list[str] = []        # vLLM request ids
        self._recving: dict[str, str] = {}       # req id -> transfer id, reported loads
        # a transfer id belongs to the first live request here that names it; any other
        # computes its prompt here (two loads into one transfer would break each other)
        self._owners: dict[str, str] = {}        # transfer id -> req id
        self._owned: dict[str, str] = {}         # req id -> transfer id
        # multi-turn reuse (kvpush.integrations.vllm_reuse): kept turns to export in the
        # next step (decode instance), kept prefixes to load (prefill instance)
        self.reuse = config.reuse and self.is_producer and self.is_consumer \
            and not self.hybrid
        self._kept_new: list[SendPlan] = []
        self._kept: dict[str, str] = {}          # req id -> transfer id, oldest first
        self._giving: dict[str, int] = {}        # given back early: req id -> its blocks
        # load or recompute, from measured costs (vllm_reuse.ReuseCosts): loads being
        # timed (req id -> plan time, bytes, blocks), the step running now (start, tokens)
        self.costs = ReuseCosts()
        self._bytes_per_block = _bytes_per_block(kv_cache_config)
        self._timed: dict[str, tuple[float, float, list[int]]] = {}
        # loads that arrived, timed until their request's compute is scheduled (req id ->
        # plan time, bytes): the request waits for that step, not only for the bytes
        self._arrived: dict[str, tuple[float, float]] = {}
        # decode instances (their producers) loaded from here: the first load from each
        # one carries the connection to it, and is no sample of the link's cost
        self._loaded_from: set[tuple[str, ...]] = set()
        self._first_loads: set[str] = set()      # req ids of such first loads
        # req id -> (kept tokens lacking, the choice): logged once vLLM allocates the request
        self._decided: dict[str, tuple[int, ReuseChoice]] = {}
        # req id -> the kept prefix its params offer, checked and parsed (None: none): vLLM
        # asks when it counts the request's external tokens and again once it allocates
        # it, and the check fingerprints the kept tokens (~60 us per 2k tokens here)
        self._offers: dict[str, tuple[int, RemotePrefill] | None] = {}
        # kept turns a request here has loaded or let go (transfer ids, the latest
        # _USED_KEPT): another request naming one computes instead of waiting on a source
        # that is gone (two turns of one conversation sent at once, a client's retry)
        self._used_kept: OrderedDict[str, None] = OrderedDict()
        self._step: tuple[float, int] | None = None

    # -- set-up ----------------------------------------------------------------------------
    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_manager = manager

    def set_handshake(self, metadata: Mapping[int, RankInfo]) -> None:
        """Each worker rank's endpoint (tensor-parallel rank -> :class:`RankInfo`)."""
        self._ranks.update(metadata)
        for rank, info in sorted(self._ranks.items()):
            log.info("kvpush %s rank %d: %s at %s", info.role, rank, info.name, info.address)

    def producer_addresses(self) -> list[str]:
        return [self._ranks[r].address for r in sorted(self._ranks)
                if self._ranks[r].role in ("producer", "both")]

    # -- both sides ------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if self.config.stage_log and params and (params.get("do_remote_decode")
                                                 or params.get("do_remote_prefill")):
            self._stage("arrived", request.request_id)
        if self.is_producer and params and params.get("do_remote_decode"):
            self._candidates[request.request_id] = request
            prompt = self._prompt_of(request)  # the whole prompt: before any backoff
            try:
                self._exports[request.request_id] = wire_id(
                    transfer_id_of(request.request_id, params), prompt)
            except ValueError:
                pass  # refused when its send is planned
            if self.backoff:
                self._truncate(request)
        # Decode side: claim the prefill's blocks now. The request may wait for free blocks
        # here longer than the prefill's lease; a claim keeps the source held while this
        # instance is alive (bounded by the prefill's max_wait_s) until the READ (pull) or
        # the registration (push) starts.
        remote = self._remote_prefill(request)
        if remote is not None and self._usable(request):
            self._claims_new.append(RecvPlan(request.request_id, remote, [], report=False))

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        remote = self._remote_prefill(request)
        if remote is None or not self._usable(request):
            return self._reuse_tokens(request, num_computed_tokens)
        count = int(request.num_prompt_tokens) - self.backoff - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        remote = self._remote_prefill(request)
        if remote is None:
            self._reuse_alloc(request, blocks, num_external_tokens)
            return
        # One transfer per request: a request preempted after its load recomputes locally.
        request.kv_transfer_params["do_remote_prefill"] = False
        req_id = request.request_id
        if num_external_tokens <= 0 or not self._usable(request):
            # Everything needed is local: move nothing, but let the producer release.
            self._recv_new.append(RecvPlan(req_id, remote, [], report=False))
            return
        num_prompt = int(request.num_prompt_tokens)
        if self.hybrid:
            # vLLM allocates every group a block per prompt position here (the null blocks
            # of a sliding window come later, once the load is in): a ValueError is a bug.
            loaded = num_prompt - self.backoff
            dst = transfer_blocks(self.groups, blocks.get_block_ids(), loaded,
                                  (loaded - num_external_tokens) // self.block_size,
                                  self._null_block())
        else:
            local_blocks = (num_prompt - num_external_tokens) // self.block_size
            (block_ids,) = blocks.get_block_ids()
            dst = [int(b) for b in
                   block_ids[local_blocks:prompt_blocks(num_prompt, self.block_size)]]
        self._recving[req_id] = remote.transfer_id
        self._recv_new.append(RecvPlan(req_id, remote, dst, report=True))

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        params = request.kv_transfer_params or {}
        if self.config.stage_log and params.get("do_remote_decode"):
            self._stage("finished", req_id)
        if self.reuse:
            self._step_ended()
            self._arrived.pop(req_id, None)
            self._timed.pop(req_id, None)
            self._first_loads.discard(req_id)
            self._decided.pop(req_id, None)
            self._offers.pop(req_id, None)
        self._candidates.pop(req_id, None)
        self._full_tokens.pop(req_id, None)
        owned = self._owned.pop(req_id, None)
        if owned is not None:
            del self._owners[owned]
        # Decode side: a load may still be writing into the blocks.
        if req_id in self._recving:
            self._prompts.pop(req_id, None)
            self._recv_aborts.append(req_id)
            return True, None
        if params.get("do_remote_prefill") and self.is_consumer:
            # Finished before it was scheduled: still tell the producer to let go (only
            # the transfer's owner here speaks for it).
            remote = self._parse_remote(request)
            if remote is not None and self._owners.get(remote.transfer_id, req_id) != req_id:
                remote = None
            self._prompts.pop(req_id, None)
            params["do_remote_prefill"] = False
            if remote is not None:
                self._recv_new.append(RecvPlan(req_id, remote, [], report=False))
            return False, None
        kept = self._keep(request, block_ids)
        if kept is not None:
            self._prompts.pop(req_id, None)
            return True, kept
        # Prefill side.
        self._prompts.pop(req_id, None)
        self._sent_requests.pop(req_id, None)
        transfer_id = self._exports.pop(req_id, None)
        send = self._sends.get(req_id)
        normal = getattr(request.status, "name", str(request.status)) in _NORMAL_FINISH
        if send is None:
            if transfer_id is not None and not self._exported_elsewhere(transfer_id, req_id):
                # Its prefill never finished: a waiting registration should fail now. (Not
                # when another request here holds that id: the abort would end its use.)
                # No send was planned, so no sid names the use.
                self._send_aborts.append((transfer_id, 0))
            return False, None
        if not normal:
            # named: an abort that reaches the Producer after this use ended (a retry of
            # the request under the same transfer id begun meanwhile) leaves the next be
            self._send_aborts.append((send.transfer_id, send.sid))
            return True, None
        return True, self._response(send)

    def _response(self, send: _Send) -> dict[str, Any]:
        producers = self.producer_addresses()
        tickets: list[bytes] = []
        if send.mode is TransferMode.PULL:
            ranks = [self._ranks[r] for r in sorted(self._ranks)]
            if not ranks:
                log.error("kvpush: no producer endpoint known (handshake metadata missing); "
                          "the decode instance cannot pull %r", send.transfer_id)
            ids = encode_ids(_as_ids(send.src))
            # One per rank, in rank order (a rank that replicates heads another rank sends
            # gets one too, unused: see kvpush.layout.tp_routes). With a key, the router
            # can neither read nor alter them.
            key = self.config.auth_key()
            plain = [PullTicket(producer=r.name, address=r.address,
                                request_id=send.transfer_id, block_ids=ids,
                                lease_s=self.config.lease_s, issued_at=send.issued_at,
                                sid=send.sid) for r in ranks]
            tickets = [(t if key is None else t.seal(key)).to_bytes() for t in plain]
        return response_params(send.name or send.transfer_id, send.mode, producers,
                               send.num_tokens, tickets, request_id=send.req_id,
                               engine_id=self.engine_id, block_ids=send.src,
                               layerwise=self.config.layerwise and send.mode is TransferMode.PUSH,
                               prompt=send.prompt)

    # -- per step --------------------------------------------------------------------------
    def build_plan(self, scheduler_output: Any) -> StepPlan:
        if self.reuse:
            self._step_ended()
            tokens = _scheduled_tokens(scheduler_output)
            now = time.monotonic()
            self._step = (now, tokens) if tokens else None
            if self._arrived:
                self._loads_waited(scheduler_output, now)
        # A claim is only worth its message when the READ does not start in this step.
        starting = {r.req_id for r in self._recv_new}
        claims = [c for c in self._claims_new if c.req_id not in starting]
        plan = StepPlan(recv=self._recv_new, recv_aborts=self._recv_aborts,
                        send_aborts=self._send_aborts, claims=claims,
                        idle=_scheduled_tokens(scheduler_output) == 0)
        self._recv_new, self._recv_aborts, self._send_aborts = [], [], []
        self._claims_new = []
        plan.send, self._kept_new = self._kept_new, []
        if self._kept:
            plan.send_aborts += self._give_back_kept()
        if self.is_producer:
            self._expire_endings()
            for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
                send = self._sends.pop(req_id, None)
                if send is None:
                    continue
                # vLLM dropped the request's hold on its blocks; kvpush's pin keeps them out
                # of vLLM's free queue while the transfer may read them. The worker aborts
                # it (without waiting) and each rank reports when nothing reads them any
                # more; the request is recomputed and may send again after that.
                log.warning("kvpush: %s preempted after its prefill; ending transfer %r (its "
                            "blocks stay held until it has ended)", req_id, send.transfer_id)
                self._ending[send.transfer_id] = _Ending(
                    self._pins.pop(req_id, []),
                    time.monotonic() + self.config.transfer_timeout_s + _ENDING_MARGIN_S)
                plan.send_preempted.append((req_id, send.transfer_id))
                request = self._sent_requests.pop(req_id, None)
                if request is not None:
                    self._candidates[req_id] = request
            if self._candidates:
                for req_id, count in scheduler_output.num_scheduled_tokens.items():
                    send_plan = self._maybe_send(req_id, count)
                    if send_plan is not None:
                        plan.send.append(send_plan)
        return plan

    def _maybe_send(self, req_id: str, num_scheduled: int) -> SendPlan | None:
        request = self._candidates.get(req_id)
        if request is None:
            return None
        num_prompt = int(request.num_prompt_tokens)
        if request.num_computed_tokens + num_scheduled < num_prompt:
            return None  # more prefill chunks to come
        del self._candidates[req_id]
        params = request.kv_transfer_params
        try:
            name = transfer_id_of(req_id, params)
        except ValueError as exc:
            log.warning("kvpush: request %s: %s; its KV stays here", req_id, exc)
            return None
        try:
            mode = mode_of(params, self.config.default_mode)
        except ValueError:
            log.warning("kvpush: request %s names an unknown mode %r; using %s", req_id,
                        params.get(PARAM_MODE) or params.get("transfer_mode"),
                        self.config.mode)
            mode = self.config.default_mode
        prompt = self._prompt_of(request)
        transfer_id = wire_id(name, prompt)
        if transfer_id in self._ending:
            # preempted earlier, its old transfer still ending: its blocks are recomputed
            # here, and its decode instance was told the transfer failed
            log.warning("kvpush: request %s is not exported again while its earlier "
                        "transfer %r is ending", req_id, transfer_id)
            self._exports.pop(req_id, None)
            return None
        if any(s.transfer_id == transfer_id for s in self._sends.values()):
            if mode is TransferMode.PUSH:
                # The decode instance registers under this id: it pairs with the export
                # already here, so this request's KV has nobody to go to.
                log.error("kvpush: transfer %r is already exported here by another request; "
                          "request %s (push) is not exported (the router must name each "
                          "request uniquely)", transfer_id, req_id)
                self._exports.pop(req_id, None)
                return None
            # Pull: the decode instance learns the name from this request's response.
            taken, name = transfer_id, f"{name}.{new_id():016x}"
            transfer_id = wire_id(name, prompt)
            log.warning("kvpush: transfer %r is already exported here by another request; "
                        "request %s is exported as %r", taken, req_id, transfer_id)
        self._exports[req_id] = transfer_id
        if self.hybrid:
            per_group = self._kv_manager.get_block_ids(req_id)
            try:
                src = transfer_blocks(self.groups, per_group, num_prompt, 0,
                                      self._null_block())
            except ValueError as exc:
                log.error("kvpush: request %s: %s; its KV stays here", req_id, exc)
                return None
        else:
            (block_ids,) = self._kv_manager.get_block_ids(req_id)
            src = [int(b) for b in block_ids[:prompt_blocks(num_prompt, self.block_size)]]
        # Every block the transfer reads is pinned (one more reference in vLLM's block pool)
        # until kvpush hands the source back: neither a preemption nor vLLM freeing
        # sliding-window blocks as they leave the window (at the request's finish already,
        # before request_finished_all_groups) lets vLLM reuse them while a WRITE or READ
        # may read them, and the worker never has to wait for one to end.
        null = self._null_block() if self.hybrid else -1
        self._pin(req_id, [b for b in src if b != null])
        sid = new_id()
        # the decode instance checks the prompt's length: the whole one, before any backoff
        self._sends[req_id] = _Send(req_id, transfer_id, mode, src,
                                    self._full_tokens.pop(req_id, num_prompt), time.time(),
                                    sid, name, prompt)
        self._sent_requests[req_id] = request
        return SendPlan(req_id, transfer_id, mode, src, sid)

    def update_connector_output(self, output: Any) -> None:
        if self.reuse:
            self._loads_ended(output)
        for req_id in getattr(output, "finished_sending", None) or ():
            self._sends.pop(req_id, None)
            self._kept.pop(req_id, None)
            self._giving.pop(req_id, None)
            self._unpin(req_id)
        # preempted sends whose transfer ended, counted over the worker ranks
        meta = getattr(output, "kv_connector_worker_meta", None)
        for transfer_id, count in (getattr(meta, "ended", None) or {}).items():
            ending = self._ending.get(transfer_id)
            if ending is None:
                continue
            ending.reports += count
            if ending.reports >= max(self.num_workers, len(self._ranks)):
                del self._ending[transfer_id]
                self._free(ending.blocks)
        for req_id in getattr(output, "finished_recving", None) or ():
            self._recving.pop(req_id, None)

    def has_pending_work(self) -> bool:
        """Plans not yet handed to the worker: the engine must step once more."""
        return bool(self._recv_new or self._recv_aborts or self._send_aborts
                    or self._claims_new or self._ending or self._kept_new)

    def has_pending_block_frees(self) -> bool:
        """vLLM's scheduler asks this before it preempts a running request for blocks: True
        makes it wait instead. True only while blocks come back soon without a preemption:
        those of preempted sends whose aborted transfer is ending (bounded by
        ``transfer_timeout_s``). Sources held for a decode instance (a lease, a claim, a
        transfer) do not make it wait -- their end is the decode instance's to choose -- so
        this instance preempts as vLLM would without kvpush; a preempted request's
        transfer still reads only pinned blocks."""
        return bool(self._ending)

    def _expire_endings(self) -> None:
        """Unpin preempted sends whose ranks did not all report within the bound a WRITE
        can last (a rank that died, a report lost)."""
        now = time.monotonic()
        for transfer_id, ending in list(self._ending.items()):
            if ending.deadline <= now:
                del self._ending[transfer_id]
                log.error("kvpush: transfer %r of a preempted request was not reported ended "
                          "within %.0f s; its blocks go back to vLLM", transfer_id,
                          self.config.transfer_timeout_s + _ENDING_MARGIN_S)
                self._free(ending.blocks)

    # -- multi-turn reuse (kvpush.integrations.vllm_reuse) ----------------------------------
    def _keep(self, request: Any, block_ids: list[int]) -> dict[str, Any] | None:
        """Decode instance: keep a turn that ended normally and export it; its response's
        ``kv_transfer_params`` (None: nothing kept, the blocks go back to vLLM)."""
        params = request.kv_transfer_params
        if not self.reuse or not params or params.get("do_remote_decode") \
                or getattr(request.status, "name", str(request.status)) not in _NORMAL_FINISH:
            return None
        kept = keep(request, block_ids, self.block_size)
        if kept is None:
            return None
        try:
            mode = mode_of(params, self.config.default_mode)
        except ValueError:
            mode = self.config.default_mode
        req_id = request.request_id
        self._supersede(kept.blocks)
        transfer_id = wire_id(kept.transfer_id, kept.prompt)
        send = _Send(req_id, transfer_id, mode, kept.blocks, kept.tokens, time.time(),
                     new_id(), kept.transfer_id, kept.prompt)
        # vLLM holds the blocks (request_finished returns True) until the worker reports
        # the Producer released them: after the next turn's load, or lease_s
        self._sends[req_id] = send
        self._kept[req_id] = transfer_id
        self._kept_new.append(SendPlan(req_id, transfer_id, mode, kept.blocks, send.sid,
                                       computed=True))
        return kept_params(self._response(send), self.config.lease_s)

    def _supersede(self, blocks: list[int]) -> None:
        """Decode instance, keeping a turn in ``blocks``: an earlier kept turn whose blocks
        begin these (the same conversation's previous turn, found in the prefix cache by
        this one) is released now, not at its lease. The next turn of the conversation
        names the newer one; a request still loading the earlier one keeps it until its
        transfer ends (the Producer releases a source no sooner); one that comes later
        finds it gone and recomputes. Nothing is freed by it (the newer turn holds the
        shared blocks), so memory pressure does not count it as blocks on their way back."""
        for req_id, transfer_id in list(self._kept.items()):
            send = self._sends.get(req_id)
            # the first block rules out most kept turns before a slice is made
            if send is None or not send.src or blocks[0] != send.src[0] \
                    or blocks[:len(send.src)] != send.src:
                continue
            del self._kept[req_id]
            self._send_aborts.append((transfer_id, send.sid))
            log.debug("kvpush: the kept turn %r is superseded by a later turn of its "
                      "conversation", transfer_id)

    def _give_back_kept(self) -> list[tuple[str, int]]:
        """Under memory pressure (fewer free blocks than ``reuse_reserve`` of the pool), the
        oldest kept turns are released early (their transfer ids, to abort): vLLM gets
        their blocks back once the Producer has released them (a transfer that reads them
        ends first); their next turns recompute."""
        pool = getattr(self._kv_manager, "block_pool", None)
        if pool is None:
            return []
        # blocks given back but not released yet count as free: they are on their way
        free = int(pool.get_num_free_blocks()) + sum(self._giving.values())
        want = self.config.reuse_reserve * int(pool.num_gpu_blocks)
        ended = []
        while self._kept and free < want:
            req_id, transfer_id = next(iter(self._kept.items()))
            del self._kept[req_id]
            send = self._sends.get(req_id)
            self._giving[req_id] = len(send.src) if send is not None else 0
            free += self._giving[req_id]
            log.info("kvpush: %d free blocks; the kept turn %r is given back early", free,
                     transfer_id)
            ended.append((transfer_id, send.sid if send is not None else 0))
        return ended

    def _reuse_offer(self, request: Any) -> tuple[int, RemotePrefill] | None:
        """Prefill instance: the kept prefix this request may load (tokens, source)."""
        params = request.kv_transfer_params
        if not self.reuse or not params or not params.get("do_remote_decode") \
                or params.get("_kvpush_reused"):
            return None
        req_id = request.request_id
        if req_id in self._offers:
            found = self._offers[req_id]
        else:
            found = self._offers[req_id] = self._parse_offer(request)
        if found is not None and found[1].transfer_id in self._used_kept:
            log.info("kvpush: request %s: the kept turn %r is taken by another request "
                     "here; computing it", req_id, found[1].transfer_id)
            return None
        return found

    def _parse_offer(self, request: Any) -> tuple[int, RemotePrefill] | None:
        ids = getattr(request, "prompt_token_ids", None)
        found = offer(request.kv_transfer_params, ids, int(request.num_prompt_tokens),
                      self.block_size)
        if found is None:
            return None
        try:
            remote = RemotePrefill.parse(found.params, self.config.default_mode, "",
                                         found.prompt)
        except ValueError as exc:
            log.warning("kvpush: request %s: kept KV not usable (%s); computing it here",
                        request.request_id, exc)
            return None
        return found.tokens, remote

    def _reuse_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        found = self._reuse_offer(request)
        if found is None:
            return 0, False
        count = found[0] - num_computed_tokens
        if count <= 0:
            return 0, False
        # whole blocks past the prefix-cache hit (a partial one is loaded whole)
        blocks = found[0] // self.block_size - num_computed_tokens // self.block_size
        nbytes = blocks * self._bytes_per_block
        choice = self.costs.choose(count, nbytes)
        if self.config.reuse_load == "always" and not choice.load:
            choice = choice._replace(load=True, why="reuse_load is always")
        self._decided[request.request_id] = (count, choice)
        return (count, True) if choice.load else (0, False)

    def _reuse_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        found = self._reuse_offer(request)
        self._offers.pop(request.request_id, None)   # decided now, one way or the other
        if found is None:
            return
        tokens, remote = found
        decided = self._decided.pop(request.request_id, None)
        if decided is not None:
            lacking, choice = decided
            log.info("kvpush: request %s: %s the %d kept tokens its prefix cache lacks "
                     "(estimated load %s, compute %s%s)", request.request_id,
                     "loads" if choice.load and num_external_tokens > 0 else "computes",
                     lacking, _ms(choice.load_us), _ms(choice.compute_us),
                     f"; {choice.why}" if choice.why else "")
        if self.config.stage_log:
            self._stage("reuse_planned", request.request_id,
                        f"{'load' if num_external_tokens > 0 else 'compute'} "
                        f"{max(0, num_external_tokens)}")
        # One load per request: a request preempted after it recomputes.
        request.kv_transfer_params["_kvpush_reused"] = True
        self._used_kept[remote.transfer_id] = None
        while len(self._used_kept) > _USED_KEPT:
            self._used_kept.popitem(last=False)
        req_id = request.request_id
        if num_external_tokens <= 0:
            # Computed here (or held by the prefix cache): move nothing and send nothing.
            # Telling the decode instance to let the kept turn go would cost this turn
            # 0.6-1 ms on one instance or the other, whenever sent; it releases the kept
            # turn itself when it keeps this conversation's next one (_supersede), else at
            # its lease.
            return
        (block_ids,) = blocks.get_block_ids()
        local_blocks = (tokens - num_external_tokens) // self.block_size
        dst = [int(b) for b in block_ids[local_blocks:tokens // self.block_size]]
        self._recving[req_id] = remote.transfer_id
        self._recv_new.append(RecvPlan(req_id, remote, dst, report=True, kept=True))
        self._timed[req_id] = (time.monotonic(), len(dst) * self._bytes_per_block, dst)
        if remote.producers not in self._loaded_from:
            self._loaded_from.add(remote.producers)
            self._first_loads.add(req_id)

    def _step_ended(self) -> None:
        """The step built last has run (vLLM hands its output back, finishes requests in
        it, or schedules the next): its duration is a sample of the engine's cost."""
        if self._step is not None:
            start, tokens = self._step
            self._step = None
            self.costs.observe_step(tokens, time.monotonic() - start)

    def _loads_waited(self, scheduler_output: Any, now: float) -> None:
        """Loads whose request's compute is scheduled in this step: each is a sample of
        what loading cost the request, from its plan to now (the transfer, vLLM learning
        at a step's end that it ended, and the step that schedules the compute)."""
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        for req_id in [r for r in self._arrived if r in scheduled]:
            start, nbytes = self._arrived.pop(req_id)
            self.costs.observe_load(nbytes, now - start)

    def _loads_ended(self, output: Any) -> None:
        """Loads of kept tokens vLLM learns ended: each one that arrived is timed until
        its request's compute is scheduled (:meth:`_loads_waited`), but the first from
        each decode instance (it also waited for the connection to that instance)."""
        self._step_ended()
        failed = set(getattr(output, "failed_recving", None) or ())
        invalid = set(getattr(output, "invalid_block_ids", None) or ())
        for req_id in getattr(output, "finished_recving", None) or ():
            if self.config.stage_log:
                self._stage("load_seen", req_id)
            timed = self._timed.pop(req_id, None)
            first = req_id in self._first_loads
            self._first_loads.discard(req_id)
            if timed is not None and not first and req_id not in failed \
                    and invalid.isdisjoint(timed[2]):
                self._arrived[req_id] = (timed[0], timed[1])

    # -- helpers ---------------------------------------------------------------------------
    def _stage(self, stage: str, req_id: str, detail: str = "") -> None:
        """One ``stage_log`` line from the scheduler (``r-``: no rank), naming the request
        by vLLM's id less its random suffix, as the worker's lines name its transfer."""
        stage_log.info("kvpush stage %.6f %s %s r- %s", time.monotonic(), stage,
                       base_request_id(req_id), detail)

    def _truncate(self, request: Any) -> None:
        """Prefill side with Mamba state: compute the prompt less its last token (vLLM's
        request fields, as its NixlConnector trims them), so the state handed over is the
        one the decode side continues from."""
        params = request.kv_transfer_params
        n = int(request.num_prompt_tokens)
        if n <= self.backoff or params.get("_kvpush_backoff"):
            return
        ids = getattr(request, "prompt_token_ids", None)
        if not isinstance(ids, list):
            log.warning("kvpush: request %s has no prompt token list to stop short of; its "
                        "state is not exported", request.request_id)
            self._candidates.pop(request.request_id, None)
            return
        del ids[-self.backoff:]
        del request._all_token_ids[-self.backoff:]
        request.num_prompt_tokens = n - self.backoff
        params["_kvpush_backoff"] = True
        self._full_tokens[request.request_id] = n

    def _null_block(self) -> int:
        """vLLM's null block id (the placeholder of freed out-of-window blocks)."""
        pool = getattr(self._kv_manager, "block_pool", None)
        null = getattr(pool, "null_block", None)
        return int(getattr(null, "block_id", 0))

    def _pin(self, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        pool = self._kv_manager.block_pool
        blocks = [pool.blocks[b] for b in block_ids]
        pool.touch(blocks)
        self._pins[req_id] = blocks

    def _unpin(self, req_id: str) -> None:
        self._free(self._pins.pop(req_id, []))

    def _free(self, blocks: list[Any]) -> None:
        if blocks:
            self._kv_manager.block_pool.free_blocks(blocks)

    def _prompt_of(self, request: Any) -> str:
        """The request's prompt fingerprint (computed once: the prefill side's is taken
        before any backoff shortens the prompt)."""
        req_id = request.request_id
        prompt = self._prompts.get(req_id)
        if prompt is None:
            ids = getattr(request, "prompt_token_ids", None)
            prompt = prompt_fingerprint(int(request.num_prompt_tokens),
                                        None if ids is None else list(ids))
            self._prompts[req_id] = prompt
        return prompt

    def _exported_elsewhere(self, transfer_id: str, req_id: str) -> bool:
        """Whether a request here other than ``req_id`` holds kvpush id ``transfer_id``."""
        return (any(t == transfer_id for r, t in self._exports.items() if r != req_id)
                or any(s.transfer_id == transfer_id for s in self._sends.values()
                       if s.req_id != req_id))

    def _parse_remote(self, request: Any) -> RemotePrefill | None:
        params = request.kv_transfer_params
        if not self.is_consumer or not params or not params.get("do_remote_prefill"):
            return None
        try:
            remote = RemotePrefill.parse(params, self.config.default_mode,
                                         request.request_id, self._prompt_of(request))
        except ValueError as exc:
            log.warning("kvpush: request %s: %s; computing its prompt here", request.request_id,
                        exc)
            return None
        return remote

    def _remote_prefill(self, request: Any) -> RemotePrefill | None:
        """The request's remote prefill, if it names one and owns its transfer id here."""
        remote = self._parse_remote(request)
        if remote is None:
            return None
        req_id = request.request_id
        owner = self._owners.setdefault(remote.transfer_id, req_id)
        if owner != req_id:
            log.warning("kvpush: request %s names transfer %r, which request %s here is "
                        "loading; computing its prompt here (the router must name each request "
                        "uniquely)", req_id, remote.transfer_id, owner)
            return None
        self._owned[req_id] = remote.transfer_id
        return remote

    def _usable(self, request: Any) -> bool:
        """False when the prefill instance saw a different prompt (its KV is no use here)."""
        params = request.kv_transfer_params
        num_tokens = params.get(PARAM_NUM_TOKENS, params.get("remote_num_tokens"))
        if isinstance(num_tokens, int) and num_tokens != int(request.num_prompt_tokens):
            log.warning("kvpush: request %s has %d prompt tokens here but %d on the prefill "
                        "instance (different tokenization?); computing its prompt here",
                        request.request_id, request.num_prompt_tokens, num_tokens)
            return False
        remote_prompt = params.get(PARAM_PROMPT)
        if remote_prompt and remote_prompt != self._prompt_of(request):
            log.warning("kvpush: request %s's prompt differs from the one the prefill "
                        "instance computed (fingerprint %s here, %s there); computing its "
                        "prompt here", request.request_id, self._prompt_of(request),
                        remote_prompt)
            return False
        return True


def _as_ids(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64)


def _ms(us: int | None) -> str:
    """Whole microseconds as exact milliseconds (the figures a choice compared)."""
    return "unmeasured" if us is None else f"{us // 1000}.{us % 1000:03d} ms"


def _bytes_per_block(kv_cache_config: Any) -> float:
    """Bytes of one block over all layers of this rank (1.0 when vLLM's config does not
    say: costs are then per block)."""
    tensors = getattr(kv_cache_config, "kv_cache_tensors", None)
    num_blocks = getattr(kv_cache_config, "num_blocks", None)
    try:
        total = sum(int(t.size) for t in tensors or ())
        return total / int(num_blocks) if total > 0 and num_blocks else 1.0
    except (TypeError, ValueError, AttributeError):
        return 1.0


def _scheduled_tokens(scheduler_output: Any) -> int | None:
    """Tokens vLLM runs in this step (None: not said)."""
    total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    if total is not None:
        return int(total)
    per_request = getattr(scheduler_output, "num_scheduled_tokens", None)
    return sum(per_request.values()) if isinstance(per_request, Mapping) else None
