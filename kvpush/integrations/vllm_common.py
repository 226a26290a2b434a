"""The parts of the vLLM adapter that need neither vLLM nor torch: its configuration, the
``kv_transfer_params`` protocol a router speaks with it, the per-step plans the scheduler
side hands the worker side, and transfer statistics.

``kv_transfer_params`` (JSON, in the OpenAI request body and in the prefill's response)::

    router -> prefill   {"do_remote_decode": true, "kvpush_id": ID, "kvpush_mode": "push"|"pull"}
    prefill -> router   {"do_remote_prefill": true, "kvpush_id": ID, "kvpush_mode": ...,
                         "kvpush_producers": [addr per rank], "kvpush_num_tokens": N,
                         "kvpush_prompt": PROMPT,
                         "kvpush_tickets": [base64 PullTicket per rank]}      (pull only)
    router -> decode    push: {"do_remote_prefill": true, "kvpush_id": ID, "kvpush_mode": "push",
                               "kvpush_producers": [addr per rank]}   (sent with the prefill)
                        pull: the prefill's response, as it came

``ID`` is the router's name for the request, shared by both instances (vLLM's own request
ids differ between the two servers); it must be unique per request (a client's
``X-Request-Id`` may repeat: the router adds a nonce). Two requests of one instance naming
the same ``ID`` at once do not share it: a prefill instance refuses the second push export
(a second pull export gets a fresh name, in its response), a decode instance computes the
second one's prompt itself, and neither one's finish touches the other's transfer.

kvpush names the transfer ``ID#PROMPT`` (:func:`wire_id`), ``PROMPT`` being the prompt's
fingerprint (:func:`prompt_fingerprint`: its token count and a hash of its token ids), so the
two legs of a push pair only when they carry the same prompt; one that differs is never
written over (the decode's registration finds no export, times out and the prompt is
computed there). The prefill's response carries ``PROMPT``: a decode instance given it
(pull, or push registered after the prefill answered) checks it against its own prompt and
computes the prompt itself on a mismatch, releasing the prefill's blocks at once.

``do_remote_decode`` / ``do_remote_prefill`` are vLLM's own keys, so vLLM's serving layer
treats kvpush requests as it treats its own connectors'.

vLLM's own NIXL schema works too (the ``kvpush_*`` keys are an extension), so proxies written
for ``NixlConnector`` / ``NixlPushConnector`` drive kvpush unchanged::

    router -> prefill   {"do_remote_decode": true, ...}            (no kvpush_id)
    prefill -> router   {"do_remote_prefill": true, "remote_engine_id", "remote_host",
                         "remote_port", "remote_block_ids", "remote_request_id", "tp_size",
                         "remote_num_tokens", ... plus the kvpush keys above}
    router -> decode    pull: the prefill's response, as it came
                        push: {"do_remote_prefill": true, "remote_engine_id": ...,
                               "remote_host": H, "remote_port": P, "tp_size": T}
                              (sent with the prefill, both under one X-Request-Id)

Without ``kvpush_id`` the transfer is named by the request id vLLM assigned, less the random
``-xxxxxxxx`` suffix vLLM appends to the ``X-Request-Id`` it was given: the same on both
instances when the router gives both the same ``X-Request-Id`` (as vLLM's push proxy does).
``remote_host`` / ``remote_port`` name the prefill instance's kvpush endpoint (its
``host`` / ``port``; rank ``r`` of ``tp_size`` listens at ``remote_port + r``). The mode is
``kvpush_mode``, else ``transfer_mode`` ("push"/"pull", vLLM's name), else the instance's
configured ``mode``.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from ..agent import TransportConfig
from ..consumer import ConsumerConfig
from ..layout import replica_routes, tp_routes
from ..producer import ProducerConfig
from ..request import TransferMode

__all__ = [
    "PARAM_ID",
    "PARAM_LAYERWISE",
    "PARAM_MODE",
    "PARAM_NUM_TOKENS",
    "PARAM_PRODUCERS",
    "PARAM_PROMPT",
    "PARAM_TICKETS",
    "SUPPORTED_VLLM",
    "AdapterConfig",
    "EngineFacts",
    "RankCoords",
    "RecvPlan",
    "RemotePrefill",
    "SendPlan",
    "StepPlan",
    "TransferStats",
    "base_request_id",
    "check_parallelism",
    "check_vllm_version",
    "decode_params",
    "engine_identity",
    "kv_dtype",
    "prefill_params",
    "prompt_fingerprint",
    "transfer_id_of",
    "wire_id",
]

PARAM_ID = "kvpush_id"
PARAM_MODE = "kvpush_mode"
PARAM_PRODUCERS = "kvpush_producers"
PARAM_TICKETS = "kvpush_tickets"
PARAM_NUM_TOKENS = "kvpush_num_tokens"
PARAM_LAYERWISE = "kvpush_layerwise"
PARAM_PROMPT = "kvpush_prompt"


@dataclass(frozen=True)
class AdapterConfig:
    """The adapter's settings, from ``kv_connector_extra_config`` (keys = field names).

    Parameters
    ----------
    host, port
        Where a prefill instance's Producer listens; rank ``r`` of a tensor-parallel engine
        uses ``port + r``. ``port`` 0 picks a free port (fine for pull, where the address
        travels in the ticket; push needs a known address for the router to hand to the
        decode instance).
    mode
        Transfer mode of a request whose ``kv_transfer_params`` name none.
    lease_s
        How long finished prefill blocks wait for their decode instance (registration in
        push, READ in pull) before they are released.
    max_wait_s
        Prefill side: the longest a decode instance's claim (pull: it knows of the request
        but has no free blocks yet) or registration keeps the blocks held past ``lease_s``
        while the decode instance stays alive.
    request_timeout_s
        Decode side: deadline from registration (push) or READ (pull) to all KV landed.
    connect_timeout_s, heartbeat_s, peer_timeout_s, transfer_timeout_s
        kvpush's handshake deadline, heartbeat interval, peer silence limit and WRITE
        deadline (see :class:`~kvpush.ConsumerConfig` / :class:`~kvpush.ProducerConfig`).
    producers
        Decode side: producer addresses to connect to at start-up (optional; others are
        connected on first use).
    ucx_error_mode
        ``"none"`` (default) or ``"peer"``; see :class:`~kvpush.TransportConfig`.
    auth_key_env
        Name of an environment variable holding the shared authentication key (hex); both
        instances must have the same key. Unset: no authentication.
    advertise_host
        The host name or address peers reach this instance's ranks at (default: ``host``,
        or this machine's address as vLLM finds it when ``host`` binds every interface).
    model_id
        The model's name in the compatibility identity (default: vLLM's ``--model``, as
        vLLM's NIXL connector does); set it when the two instances load one checkpoint from
        different paths.
    layerwise
        Layer-wise push. Prefill side: every layer of a request whose last prefill chunk
        runs is handed to ``Producer.layer_done`` as soon as vLLM's forward pass has
        written it (``save_kv_layer``), so layer ``i`` travels while layer ``i + 1``
        computes; the response says so (``kvpush_layerwise``). Decode side: push requests
        are registered layer by layer (``Consumer.expect(..., layerwise=True)``; a request's
        ``kvpush_layerwise`` overrides it). Either side alone is correct with the other
        side whole-request: a layer-wise registration is completed by ``prefill_done``,
        and ``layer_done`` calls are ignored by a whole-request registration.
    idle_yield_s
        In an engine step that runs no forward pass (vLLM steps without pause while a
        request waits for its KV, running only Python), the worker waits, while kvpush has
        requests pending on this side, until a result or release is queued or this long
        has passed: the engine stops spinning a core, and kvpush's loop thread has the GIL
        at once instead of after CPython's switch interval (5 ms) each time it wakes. A
        new request reaching an engine in such a wait is seen at most this late. 0 turns
        it off. The default is short: a longer bound saves more CPU in a spinning engine,
        but in real vLLM servers it moves decode TPOT either way within the noise of a run
        (the figures: ``docs/VLLM.md``, "Why idle_yield_s").
    stage_log
        Log one INFO line per request stage on each rank (``kvpush stage <monotonic time>
        <stage> <transfer id> r<rank> ...``): prefill side ``send_planned`` (its last
        chunk is scheduled), ``prefill_done`` (handed to kvpush), ``released``; decode side
        ``registered`` / ``pull_started``, ``loaded`` (vLLM's worker picks the result up;
        ``elapsed`` from the registration or READ to the result on kvpush's loop),
        ``reported`` (vLLM is told). The scheduler side's lines (``r-``, naming vLLM's
        request id less its random suffix): ``arrived`` (a request with a remote prefill or
        decode reaches the scheduler), ``reuse_planned`` (a kept prefix is loaded or
        computed), ``load_seen`` (vLLM learns a load ended), ``finished`` (prefill side).
        ``time.monotonic`` is one clock for the processes of a host, so
        ``python -m benchmarks.vllm.stages`` lines them up (with the router's
        ``--stage-log``) into where a request's time to first token goes, and
        ``benchmarks.vllm.multiturn --stages`` splits a turn's prefill. Off by default.
    reuse
        Multi-turn reuse (:mod:`kvpush.integrations.vllm_reuse`; both instances
        ``kv_both``). Decode instance: a turn that ends normally keeps its KV (prompt and
        generated tokens, full blocks) for ``lease_s`` and names it in its response
        (``kvpush_reuse``, and vLLM's bidirectional keys). Prefill instance: a request
        that carries ``kvpush_reuse`` loads the kept blocks its prefix cache lacks (its
        ``request_timeout_s`` bounds that load; a failed load is recomputed when vLLM's
        ``kv_load_failure_policy`` is ``recompute``). Off by default.
    reuse_reserve
        Decode instance with ``reuse``: while fewer than this share of vLLM's blocks is
        free, the oldest kept turns are released before their lease ends (their next turns
        recompute).
    reuse_wait_s
        Prefill instance with ``reuse``: in an engine step with no forward pass while a
        request waits for a kept turn's load, the worker waits until a result or release
        is queued, at most this long (instead of ``idle_yield_s``). The kept KV exists,
        so such a load ends within a transfer's time, and vLLM learns it ended in this
        step instead of a later one (it schedules the compute only in the step after). A
        new request reaching an engine in such a wait is seen at most this late. 0: as
        other loads (``idle_yield_s``).
    reuse_load
        Prefill instance with ``reuse``: ``"measured"`` loads the kept tokens its prefix
        cache lacks only when its measured costs say loading them beats computing them
        (:class:`~kvpush.integrations.vllm_reuse.ReuseCosts`); ``"always"`` loads them
        whatever the costs.
    discovery_etcd
        Comma-separated etcd client URLs (``http://host:port``): every rank publishes its
        advertisement under ``discovery_prefix`` (:mod:`kvpush.discovery`) while its kvpush
        side is healthy, decode ranks connect to the serving producers they find there,
        and a drain asked through etcd is followed
        (:mod:`kvpush.integrations.vllm_discovery`). Empty (default): no discovery.
    discovery_prefix
        The cluster's key prefix in etcd.
    discovery_instance
        This instance's name in the records (unique under the prefix); default: from
        ``discovery_http_address`` (``host-port``), else this rank's advertised kvpush
        address; ``-dp<N>`` is added for data-parallel engine ``N`` > 0.
    discovery_http_address
        ``host:port`` of this instance's OpenAI server as routers reach it (the router
        bridge registers it with vllm-router); empty: routers are not told.
    discovery_ttl_s
        The records' lease (whole seconds): a killed or unhealthy rank's record is gone
        within it.
    discovery_drain_grace_s
        A draining rank waits at least this long after marking its record ``draining``
        (routers that still had it chosen send their last requests meanwhile: vllm-router
        keeps an instance 5 s after its last registration) before it may withdraw.
    """

    host: str = "127.0.0.1"
    port: int = 0
    mode: str = "push"
    lease_s: float = 60.0
    max_wait_s: float = 600.0
    request_timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    heartbeat_s: float = 1.0
    peer_timeout_s: float = 20.0
    transfer_timeout_s: float = 30.0
    producers: tuple[str, ...] = ()
    ucx_error_mode: str = "none"
    auth_key_env: str | None = None
    advertise_host: str | None = None
    model_id: str | None = None
    layerwise: bool = False
    idle_yield_s: float = 50e-6
    stage_log: bool = False
    reuse: bool = False
    reuse_reserve: float = 0.1
    reuse_load: str = "measured"
    reuse_wait_s: float = 0.005
    discovery_etcd: str = ""
    discovery_prefix: str = "/kvpush/default"
    discovery_instance: str = ""
    discovery_http_address: str = ""
    discovery_ttl_s: int = 10
    discovery_drain_grace_s: float = 6.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "producers", tuple(self.producers))
        if not 0 <= self.idle_yield_s <= 0.01:
            raise ValueError(f"kvpush: idle_yield_s must be in [0, 0.01] s, got "
                             f"{self.idle_yield_s}")
        if not 0 <= self.reuse_wait_s <= 0.05:
            raise ValueError(f"kvpush: reuse_wait_s must be in [0, 0.05] s, got "
                             f"{self.reuse_wait_s}")
        if not 0 <= self.reuse_reserve < 1:
            raise ValueError(f"kvpush: reuse_reserve must be in [0, 1), got "
                             f"{self.reuse_reserve}")
        if self.reuse_load not in ("measured", "always"):
            raise ValueError(f"kvpush: reuse_load must be 'measured' or 'always', got "
                             f"{self.reuse_load!r}")
        TransferMode(self.mode)  # raises ValueError naming the bad value
        if self.discovery_etcd:
            from .vllm_discovery import check_discovery_config

            check_discovery_config(self)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"kvpush: port must be in [0, 65535], got {self.port}")
        # The kvpush configs check their own ranges; building them here surfaces a bad
        # value at engine start-up, with the field's name.
        self.producer_config(0, None)
        self.consumer_config(None)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> AdapterConfig:
        """Build from ``kv_connector_extra_config``; unknown keys raise ``ValueError``."""
        extra = dict(extra or {})
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - names)
        if unknown:
            raise ValueError(f"kvpush: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(names)}")
        if "producers" in extra and isinstance(extra["producers"], str):
            extra["producers"] = [extra["producers"]]
        return cls(**extra)

    @property
    def default_mode(self) -> TransferMode:
        return TransferMode(self.mode)

    def auth_key(self) -> bytes | None:
        if not self.auth_key_env:
            return None
        value = os.environ.get(self.auth_key_env)
        if not value:
            raise ValueError(f"kvpush: auth_key_env names {self.auth_key_env!r}, "
                             "which is not set")
        return bytes.fromhex(value)

    def rank_port(self, coords: RankCoords) -> int:
        """The control port of one rank: ``port`` + its index over (DP rank, PP stage, TP
        rank), so no two ranks of a deployment on one host collide; 0 stays 0 (any)."""
        if not self.port:
            return 0
        port = self.port + coords.index
        if port > 65535:
            raise ValueError(f"kvpush: rank {coords} needs port {self.port} + {coords.index} "
                             f"= {port} > 65535; lower kv_connector_extra_config's port")
        return port

    def advertised_host(self, fallback: str | None = None) -> str:
        """Where peers reach this instance: ``advertise_host``, else ``host`` unless it binds
        every interface, else ``fallback`` (this machine's address)."""
        if self.advertise_host:
            return self.advertise_host
        if self.host not in _WILDCARD_HOSTS:
            return self.host
        if not fallback:
            raise ValueError(f"kvpush: host {self.host!r} binds every interface; set "
                             "advertise_host to the address peers reach this instance at")
        return fallback

    def producer_config(self, coords: RankCoords | int, name: str | None,
                        auth_key: bytes | None = None) -> ProducerConfig:
        if isinstance(coords, int):
            coords = RankCoords(tp_rank=coords, tp_size=coords + 1)
        return ProducerConfig(
            host=self.host,
            port=self.rank_port(coords),
            name=name,
            lease_s=self.lease_s,
            max_wait_s=self.max_wait_s,
            transfer_timeout_s=self.transfer_timeout_s,
            peer_timeout_s=self.peer_timeout_s,
            auth_key=auth_key,
            transport=TransportConfig(ucx_error_mode=self.ucx_error_mode),
        )

    def consumer_config(self, name: str | None, auth_key: bytes | None = None) -> ConsumerConfig:
        return ConsumerConfig(
            name=name,
            request_timeout_s=self.request_timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            heartbeat_s=self.heartbeat_s,
            peer_timeout_s=self.peer_timeout_s,
            auth_key=auth_key,
            transport=TransportConfig(ucx_error_mode=self.ucx_error_mode),
        )


_WILDCARD_HOSTS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})


@dataclass(frozen=True)
class RankCoords:
    """Where one worker sits in its deployment: data-parallel rank, pipeline stage and
    tensor-parallel rank, with the sizes that make them one index."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0

    def __post_init__(self) -> None:
        for name, size in (("tp", self.tp_size), ("pp", self.pp_size)):
            rank = getattr(self, f"{name}_rank")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"kvpush: {name}_rank {rank} is not in [0, {name}_size "
                                 f"{size})")
        if self.dp_rank < 0:
            raise ValueError(f"kvpush: dp_rank must be >= 0, got {self.dp_rank}")

    @property
    def index(self) -> int:
        """This rank's number among every rank of every DP replica: DP-major, then PP stage,
        then TP rank (the order of vLLM's global ranks)."""
        return (self.dp_rank * self.pp_size + self.pp_rank) * self.tp_size + self.tp_rank


# -- what vLLM says about its cache -----------------------------------------------------------
#: vLLM releases this adapter implements the connector interface of (major, minor).
SUPPORTED_VLLM = ((0, 32), (0, 33))


def check_vllm_version(version: str) -> tuple[int, int]:
    """(major, minor) of a supported vLLM version string; RuntimeError naming the supported
    ones otherwise (the connector interface changes between minor releases)."""
    match = re.match(r"^(\d+)\.(\d+)", version)
    found = (int(match.group(1)), int(match.group(2))) if match else None
    if found not in SUPPORTED_VLLM:
        names = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_VLLM)
        raise RuntimeError(f"kvpush's vLLM connector supports vLLM {names}; this is vLLM "
                           f"{version!r}. Install a supported vLLM or a kvpush that supports "
                           "this one.")
    return found


def check_parallelism(*, pipeline: int = 1, prefill_context: int = 1,
                      decode_context: int = 1) -> None:
    """NotImplementedError naming what is not served: pipeline parallelism (each stage
    holds other layers, and kvpush pairs one rank's layout with one peer rank's) and
    prefill / decode context parallelism (each rank holds a share of every block's
    tokens, which kvpush's layouts do not describe)."""
    refused = [f"{flag} {size}" for flag, size in (
        ("--pipeline-parallel-size", pipeline),
        ("--prefill-context-parallel-size", prefill_context),
        ("--decode-context-parallel-size", decode_context)) if size > 1]
    if refused:
        raise NotImplementedError(
            f"kvpush's vLLM connector does not support {', '.join(refused)}: it moves KV "
            "between instances of tensor (and data) parallelism only. Run both instances "
            "with these sizes at 1.")


#: vLLM ``--kv-cache-dtype`` -> the element type kvpush names in the layout. vLLM stores
#: fp8 caches as uint8 tensors, so the variant comes from here, never from the tensor.
_CACHE_DTYPES = {
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def kv_dtype(cache_dtype: str, tensor_dtype: str) -> str:
    """The layout's dtype for vLLM's ``cache_dtype`` over tensors of ``tensor_dtype``
    (``auto``: the tensors' own). NotImplementedError for cache dtypes kvpush does not know
    the bytes of (quantised formats with scales inside blocks, MLA-specific ones)."""
    if cache_dtype in ("auto", None, ""):
        return tensor_dtype
    name = _CACHE_DTYPES.get(cache_dtype)
    if name is None:
        raise NotImplementedError(f"kvpush: --kv-cache-dtype {cache_dtype} is not supported "
                                  f"(supported: auto, {', '.join(sorted(_CACHE_DTYPES))})")
    if tensor_dtype not in (name, "uint8", "int8"):
        raise NotImplementedError(f"kvpush: --kv-cache-dtype {cache_dtype} over {tensor_dtype} "
                                  "tensors is not a layout kvpush knows")
    return name


@dataclass(frozen=True)
class EngineFacts:
    """What vLLM's configuration says about a worker's KV cache, beyond the tensors.

    Parameters
    ----------
    attn_backend
        The attention backend's name (``CPU_ATTN``, ``FLASH_ATTN``, ...): it decides how a
        block's content holds K and V.
    kv_cache_layout
        vLLM's resolved physical layout (``LBHNC``, ``LBNHC``, ... or the legacy ``HND`` /
        ``NHD``), or None when vLLM did not say.
    cache_dtype
        vLLM's ``--kv-cache-dtype`` (``auto``, ``fp8_e4m3``, ...).
    identity
        The compatibility identity (see :func:`engine_identity`).
    total_kv_heads
        The model's KV heads over all tensor-parallel ranks (0: unknown, the tensors hold
        them all).
    cache_kind
        ``"mla"`` when the model uses multi-head latent attention (vLLM's ``use_mla``):
        its caches hold one latent vector per token, whatever shape vLLM gives them
        (``[blocks, 1, tokens, latent]`` in vLLM 0.32's unified view); else ``"kv"``.
    groups
        vLLM's KV cache groups (:class:`~kvpush.integrations.vllm_hybrid.CacheGroup`);
        more than one under vLLM's hybrid allocator, whose groups overlay one allocation.
    """

    attn_backend: str = ""
    kv_cache_layout: str | None = None
    cache_dtype: str = "auto"
    identity: tuple[tuple[str, str], ...] = ()
    total_kv_heads: int = 0
    cache_kind: str = "kv"
    groups: tuple[Any, ...] = ()

    @property
    def heads_before_tokens(self) -> bool | None:
        """True for head-major layouts (H before N), False for token-major, None unknown."""
        name = (self.kv_cache_layout or "").upper()
        if name in ("HND", "NHD"):
            return name == "HND"
        if len(name) == 5 and "H" in name and "N" in name:
            return name.index("H") < name.index("N")
        return None


#: Backends whose packed per-token content is known: vLLM's CPU attention reads a head's
#: ``[block_size, 2 * head_size]`` as ``[2 * block_size, head_size]``: all of K, then all of
#: V (``cpu_attn.py``). Others keep it opaque (``C``): equal layouts only.
_PACKED_ORDERS = {"CPU_ATTN": "KND"}


def packed_order(attn_backend: str, heads_first: bool) -> str:
    """``block_order`` of a packed ``[heads, tokens, 2 * head_size]`` block interior."""
    inner = _PACKED_ORDERS.get(attn_backend)
    if inner is None:
        return "HNC" if heads_first else "NHC"
    if not heads_first:
        raise NotImplementedError(f"kvpush: attention backend {attn_backend} with a "
                                  "token-major KV cache layout is not a layout kvpush knows")
    return "H" + inner


def engine_identity(*, model: str, revision: str | None, dtype: str, num_layers: int,
                    num_kv_heads: int, head_size: int, cache_dtype: str, attn_backend: str,
                    protocol: int, vllm_version: tuple[int, int], cache_kind: str = "kv",
                    extra: Mapping[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """The compatibility identity two instances must share to exchange KV: the model
    (name or path, revision, dtype, layers, KV heads, head size), what its cache holds
    (``cache_kind``: ``kv``, or ``mla``'s latent vectors), the cache dtype, the attention
    backend, kvpush's protocol version and vLLM's (major, minor) version. ``extra``: more
    entries (a hybrid model's KV cache groups, :func:`~kvpush.integrations.vllm_hybrid.
    group_identity`; none for one group, whose identity stays as it was)."""
    return tuple(sorted({
        "cache_kind": cache_kind,
        "model": model,
        "revision": revision or "",
        "model_dtype": dtype.removeprefix("torch."),
        "num_layers": str(num_layers),
        "num_kv_heads": str(num_kv_heads),
        "head_size": str(head_size),
        "cache_dtype": cache_dtype,
        "attn_backend": attn_backend,
        "kvpush_protocol": str(protocol),
        "vllm": f"{vllm_version[0]}.{vllm_version[1]}",
        **(extra or {}),
    }.items()))


# -- kv_transfer_params ----------------------------------------------------------------------
#: vLLM appends ``-<8 hex>`` to the request id a client gives (``X-Request-Id``).
_VLLM_SUFFIX = re.compile(r"-[0-9a-fA-F]{8}$")


def base_request_id(request_id: str) -> str:
    """vLLM's request id without the random suffix vLLM appended: the same on both
    instances for one ``X-Request-Id``."""
    return _VLLM_SUFFIX.sub("", request_id)


def transfer_id_of(request_id: str, params: Mapping[str, Any]) -> str:
    """The transfer's name: kvpush's ``kvpush_id`` if the router gave one, else vLLM's
    request id less its random suffix (vLLM's own schema, paired by ``X-Request-Id``)."""
    transfer_id = params.get(PARAM_ID)
    if transfer_id is None:
        return base_request_id(request_id)
    if not isinstance(transfer_id, str) or not transfer_id:
        raise ValueError(f"kv_transfer_params {PARAM_ID!r} must be a non-empty string")
    return transfer_id


def prompt_fingerprint(num_tokens: int, token_ids: Sequence[int] | None) -> str:
    """What a transfer's KV was computed from: the prompt's token count and a 64-bit hash
    of its token ids (``"<count>.<16 hex>"``; ``"<count>"`` when the ids are not known, e.g.
    a prompt given as embeddings)."""
    if token_ids is None:
        return str(int(num_tokens))
    digest = hashlib.blake2b(np.asarray(token_ids, dtype="<i8").tobytes(), digest_size=8)
    return f"{int(num_tokens)}.{digest.hexdigest()}"


def wire_id(name: str, prompt: str) -> str:
    """kvpush's request id for the transfer the router named ``name`` of a prompt of
    fingerprint ``prompt``: both legs derive it, so a registration for another prompt finds
    no export under it (kvpush itself pairs by id only)."""
    return f"{name}#{prompt}" if prompt else name


def mode_of(params: Mapping[str, Any], default: TransferMode) -> TransferMode:
    """``kvpush_mode``, else vLLM's ``transfer_mode``, else ``default``."""
    value = params.get(PARAM_MODE) or params.get("transfer_mode") or default.value
    return TransferMode(value)
def _encode_ticket(ticket: bytes) -> str:
    return base64.b64encode(ticket).decode("ascii")


def _decode_ticket(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def prefill_params(transfer_id: str, mode: TransferMode | str) -> dict[str, Any]:
    """``kv_transfer_params`` a router sends to the prefill instance."""
    return {"do_remote_decode": True, PARAM_ID: transfer_id,
            PARAM_MODE: TransferMode(mode).value}


def decode_params(transfer_id: str, producers: Sequence[str], *,
                  layerwise: bool | None = None) -> dict[str, Any]:
    """``kv_transfer_params`` a router sends to the decode instance in push mode (in pull
    mode it forwards the prefill's response instead). ``layerwise``: register layer by
    layer (None: the decode instance's ``layerwise`` setting)."""
    out = {"do_remote_prefill": True, PARAM_ID: transfer_id,
           PARAM_MODE: TransferMode.PUSH.value, PARAM_PRODUCERS: list(producers)}
    if layerwise is not None:
        out[PARAM_LAYERWISE] = bool(layerwise)
    return out


def response_params(transfer_id: str, mode: TransferMode, producers: Sequence[str],
                    num_tokens: int, tickets: Sequence[bytes] = (), *,
                    request_id: str = "", engine_id: str = "", block_ids: Sequence[int] = (),
                    layerwise: bool = False, prompt: str = "") -> dict[str, Any]:
    """What the prefill instance returns (vLLM puts it in the response's
    ``kv_transfer_params``): kvpush's keys, and vLLM's NIXL keys naming the same things
    (rank 0's host and port, the block ids, the TP size) for routers that read those.
    ``transfer_id`` is the router's name (not the :func:`wire_id`); ``prompt`` the prompt's
    fingerprint."""
    out: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False,
                           PARAM_ID: transfer_id, PARAM_MODE: mode.value,
                           PARAM_PRODUCERS: list(producers), PARAM_NUM_TOKENS: num_tokens,
                           "transfer_mode": mode.value, "remote_engine_id": engine_id,
                           "remote_request_id": request_id or transfer_id,
                           "remote_block_ids": [list(block_ids)],
                           "remote_num_tokens": num_tokens, "tp_size": len(producers)}
    if producers:
        host, port = split_address(producers[0])
        out["remote_host"], out["remote_port"] = host, port
    if tickets:
        out[PARAM_TICKETS] = [_encode_ticket(t) for t in tickets]
    if layerwise:
        out[PARAM_LAYERWISE] = True
    if prompt:
        out[PARAM_PROMPT] = prompt
    return out


def split_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); ValueError otherwise."""
    match = re.match(r"^tcp://(\[[^\]]+\]|[^:/]+):(\d+)$", address)
    if match is None:
        raise ValueError(f"not a kvpush address (tcp://host:port): {address!r}")
    return match.group(1), int(match.group(2))


def join_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


@dataclass(frozen=True)
class RemotePrefill:
    """A decode-side request's view of its ``kv_transfer_params``."""

    #: kvpush's request id (:func:`wire_id` of the router's name and the prompt)
    transfer_id: str
    mode: TransferMode
    producers: tuple[str, ...] = ()
    tickets: tuple[bytes, ...] = ()
    #: register layer by layer (push): the request's ``kvpush_layerwise``, None if absent
    layerwise: bool | None = None
    #: the prefill's prompt fingerprint from its response (``kvpush_prompt``), "" if absent
    remote_prompt: str = ""

    @classmethod
    def parse(cls, params: Mapping[str, Any], default_mode: TransferMode,
              request_id: str = "", prompt: str = "") -> RemotePrefill:
        """Raise ``ValueError`` naming what is missing or malformed. ``request_id`` (this
        instance's vLLM request id) names the transfer when ``kvpush_id`` is absent
        (vLLM's own schema). ``prompt``: this instance's prompt fingerprint, which names
        the transfer unless the prefill's response names its own (``kvpush_prompt``,
        which the caller compares with ``prompt``)."""
        if PARAM_ID not in params and not request_id:
            raise ValueError(f"kv_transfer_params needs a non-empty string {PARAM_ID!r}")
        remote_prompt = params.get(PARAM_PROMPT, "")
        if not isinstance(remote_prompt, str):
            raise ValueError(f"{PARAM_PROMPT!r} must be a string, got {remote_prompt!r}")
        transfer_id = wire_id(transfer_id_of(request_id, params), remote_prompt or prompt)
        mode = mode_of(params, default_mode)
        producers = params.get(PARAM_PRODUCERS) or []
        if isinstance(producers, str):
            producers = [producers]
        if not all(isinstance(p, str) and "://" in p for p in producers):
            raise ValueError(f"{PARAM_PRODUCERS!r} must list addresses like tcp://host:port")
        if not producers and params.get("remote_host") and params.get("remote_port"):
            producers = _vllm_producers(params)
        raw = params.get(PARAM_TICKETS) or []
        try:
            tickets = tuple(_decode_ticket(t) for t in raw)
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{PARAM_TICKETS!r} must be base64 strings: {exc}") from exc
        if mode is TransferMode.PUSH and not producers:
            raise ValueError(f"push needs {PARAM_PRODUCERS!r} or remote_host/remote_port "
                             "(the prefill's kvpush address)")
        if mode is TransferMode.PULL and not tickets:
            raise ValueError(f"pull needs {PARAM_TICKETS!r} (the prefill's response, as it "
                             "came)")
        layerwise = params.get(PARAM_LAYERWISE)
        if layerwise is not None and not isinstance(layerwise, bool):
            raise ValueError(f"{PARAM_LAYERWISE!r} must be true or false, got {layerwise!r}")
        return cls(transfer_id, mode, tuple(producers), tickets, layerwise, remote_prompt)

    @property
    def num_ranks(self) -> int:
        """The prefill instance's TP size: one producer address (push) or ticket (pull)
        per rank."""
        return len(self.tickets if self.mode is TransferMode.PULL else self.producers)

    def route(self, tp_size: int, tp_rank: int, total_kv_heads: int, replicated: bool = False
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(prefill ranks, their sharer counts) that decode rank ``tp_rank`` of ``tp_size``
        takes its KV heads from (:func:`kvpush.layout.tp_routes`; ValueError if the two
        TP sizes cannot share ``total_kv_heads`` heads). ``replicated`` (an MLA cache, whole
        on every rank): one prefill rank per transfer
        (:func:`kvpush.layout.replica_routes`)."""
        if not self.num_ranks:
            raise ValueError("the request names no prefill rank")
        if replicated:
            return replica_routes(self.num_ranks, tp_size,
                                  self.transfer_id).of_consumer(tp_rank)
        return tp_routes(self.num_ranks, tp_size, total_kv_heads).of_consumer(tp_rank)

    def for_rank(self, tp_rank: int) -> RemotePrefill:
        """The part a decode worker of rank ``tp_rank`` deals with (homogeneous TP: the
        producer of the same rank)."""
        count = len(self.tickets if self.mode is TransferMode.PULL else self.producers)
        if tp_rank >= count:
            raise ValueError(f"the request names {count} producer rank(s); decode rank "
                             f"{tp_rank} has none (prefill and decode TP sizes must match)")
        if self.mode is TransferMode.PULL:
            return RemotePrefill(self.transfer_id, self.mode, (), (self.tickets[tp_rank],),
                                 self.layerwise, self.remote_prompt)
        return RemotePrefill(self.transfer_id, self.mode, (self.producers[tp_rank],), (),
                             self.layerwise, self.remote_prompt)


def _vllm_producers(params: Mapping[str, Any]) -> list[str]:
    """Producer addresses from vLLM's keys: rank ``r`` of ``tp_size`` at ``remote_port +
    r`` on ``remote_host`` (vLLM's schema names one host per instance)."""
    host, port, size = params["remote_host"], params["remote_port"], params.get("tp_size", 1)
    try:
        port, size = int(port), int(size or 1)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"remote_port and tp_size must be integers: {exc}") from exc
    if not isinstance(host, str) or not 0 < port <= 65535 or size < 1:
        raise ValueError(f"remote_host/remote_port/tp_size {host!r}/{port}/{size} do not "
                         "name a kvpush endpoint")
    return [join_address(host, port + r) for r in range(size)]


def prompt_blocks(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


# -- scheduler -> worker plans ---------------------------------------------------------------
@dataclass
class RecvPlan:
    """Decode side: move a request's KV into ``dst`` (may be empty: nothing to move, but
    the producer must still be told so it releases its blocks). ``report``: the request
    waits in WAITING_FOR_REMOTE_KVS and must be reported finished (only then)."""

    req_id: str
    remote: RemotePrefill
    dst: list[int]
    report: bool
    #: the source is a kept turn (multi-turn reuse): its KV exists, so the load ends
    #: within a transfer's time (a forward push waits for the prefill's compute too)
    kept: bool = False


@dataclass
class SendPlan:
    """Prefill side: ``src`` holds the request's KV once this step's forward is done.
    ``sid`` names the source use (the scheduler writes it into the pull tickets; every rank
    passes it to ``Producer.prefill_done``)."""

    req_id: str
    transfer_id: str
    mode: TransferMode
    src: list[int]
    sid: int = 0              # the source use id the scheduler put in the pull tickets
    #: the KV is in ``src`` already (a kept turn): handed over at once, not after a forward
    computed: bool = False


@dataclass
class StepPlan:
    """What the worker side does in one engine step."""

    recv: list[RecvPlan] = field(default_factory=list)
    recv_aborts: list[str] = field(default_factory=list)      # vLLM request ids
    send: list[SendPlan] = field(default_factory=list)
    #: (transfer id, the use's sid; 0 when no send was planned: whichever use the id has)
    send_aborts: list[tuple[str, int]] = field(default_factory=list)
    #: decode side: pulls to claim now (the request waits for blocks; dst is empty)
    claims: list[RecvPlan] = field(default_factory=list)
    #: prefill side: (vLLM request id, transfer id) of sends whose request vLLM preempted
    #: (its blocks are freed): the worker ends them before this step's forward
    send_preempted: list[tuple[str, str]] = field(default_factory=list)
    #: vLLM schedules no tokens in this step: it runs no forward pass (see idle_yield_s)
    idle: bool = False

    def __bool__(self) -> bool:
        return bool(self.recv or self.recv_aborts or self.send or self.send_aborts
                    or self.claims or self.send_preempted)


# -- statistics ------------------------------------------------------------------------------
#: Keys of :class:`TransferStats` data: lists of numbers, one entry per event.
STAT_KEYS = (
    "transfer_s",          # decode side: registration/READ -> all KV landed, per request
    "bytes",               # decode side: bytes received, per request
    "num_push",            # decode side: successful push receptions
    "num_pull",            # decode side: successful pulls
    "num_failed",          # decode side: failed, timed out or aborted receptions
    "num_released",        # prefill side: sources released after their transfer
    "num_lease_expired",   # prefill side: sources released because nobody came for them
    "num_send_failed",     # prefill side: sources released after a failure or abort
)


class TransferStats:
    """Per-interval transfer observations, as plain lists (picklable, mergeable)."""

    def __init__(self, data: Mapping[str, list[float]] | None = None) -> None:
        self.data: dict[str, list[float]] = {k: [] for k in STAT_KEYS}
        for key, values in (data or {}).items():
            self.data.setdefault(key, []).extend(values)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def merge(self, other: Mapping[str, list[float]]) -> None:
        for key, values in other.items():
            self.data.setdefault(key, []).extend(values)

    def take(self) -> dict[str, list[float]]:
        out = self.data
        self.data = {k: [] for k in STAT_KEYS}
        return out

    def summary(self) -> dict[str, int | float]:
        """Representative values for vLLM's periodic log line."""
        times = sorted(self.data["transfer_s"])
        n = len(times)
        out: dict[str, int | float] = {
            "Num successful transfers": n,
            "Push": len(self.data["num_push"]),
            "Pull": len(self.data["num_pull"]),
            "Num failed transfers": len(self.data["num_failed"]),
            "Sources released": len(self.data["num_released"]),
            "Lease expired": len(self.data["num_lease_expired"]),
            "Send failed": len(self.data["num_send_failed"]),
        }
        if n:
            total_mb = sum(self.data["bytes"]) / 2**20
            out.update({
                "Avg xfer time (ms)": round(sum(times) / n * 1e3, 3),
                "P90 xfer time (ms)": round(times[min(n - 1, int(0.9 * n))] * 1e3, 3),
                "Avg MB per transfer": round(total_mb / n, 3),
            })
        return out
