"""The parts of the vLLM adapter that need neither vLLM nor torch: its configuration, the
``kv_transfer_params`` protocol a router speaks with it, the per-step plans the scheduler
side hands the worker side, and transfer statistics.

``kv_transfer_params`` (JSON, in the OpenAI request body and in the prefill's response)::

    router -> prefill   {"do_remote_decode": true, "kvpush_id": ID, "kvpush_mode": "push"|"pull"}
    prefill -> router   {"do_remote_prefill": true, "kvpush_id": ID, "kvpush_mode": ...,
                         "kvpush_producers": [addr per rank], "kvpush_num_tokens": N,
                         "kvpush_tickets": [base64 PullTicket per rank]}      (pull only)
    router -> decode    push: {"do_remote_prefill": true, "kvpush_id": ID, "kvpush_mode": "push",
                               "kvpush_producers": [addr per rank]}   (sent with the prefill)
                        pull: the prefill's response, as it came

``ID`` is the router's name for the request, shared by both instances (vLLM's own request
ids differ between the two servers). ``do_remote_decode`` / ``do_remote_prefill`` are vLLM's
own keys, so vLLM's serving layer treats kvpush requests as it treats its own connectors'.
"""

from __future__ import annotations

import base64
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from ..agent import TransportConfig
from ..consumer import ConsumerConfig
from ..producer import ProducerConfig
from ..request import TransferMode

__all__ = [
    "PARAM_ID",
    "PARAM_MODE",
    "PARAM_NUM_TOKENS",
    "PARAM_PRODUCERS",
    "PARAM_TICKETS",
    "AdapterConfig",
    "RecvPlan",
    "RemotePrefill",
    "SendPlan",
    "StepPlan",
    "TransferStats",
    "decode_params",
    "prefill_params",
]

PARAM_ID = "kvpush_id"
PARAM_MODE = "kvpush_mode"
PARAM_PRODUCERS = "kvpush_producers"
PARAM_TICKETS = "kvpush_tickets"
PARAM_NUM_TOKENS = "kvpush_num_tokens"


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
    """

    host: str = "127.0.0.1"
    port: int = 0
    mode: str = "push"
    lease_s: float = 60.0
    request_timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    heartbeat_s: float = 1.0
    peer_timeout_s: float = 20.0
    transfer_timeout_s: float = 30.0
    producers: tuple[str, ...] = ()
    ucx_error_mode: str = "none"
    auth_key_env: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "producers", tuple(self.producers))
        TransferMode(self.mode)  # raises ValueError naming the bad value
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

    def producer_config(self, tp_rank: int, name: str | None,
                        auth_key: bytes | None = None) -> ProducerConfig:
        return ProducerConfig(
            host=self.host,
            port=self.port + tp_rank if self.port else 0,
            name=name,
            lease_s=self.lease_s,
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


# -- kv_transfer_params ----------------------------------------------------------------------
def _encode_ticket(ticket: bytes) -> str:
    return base64.b64encode(ticket).decode("ascii")


def _decode_ticket(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def prefill_params(transfer_id: str, mode: TransferMode | str) -> dict[str, Any]:
    """``kv_transfer_params`` a router sends to the prefill instance."""
    return {"do_remote_decode": True, PARAM_ID: transfer_id,
            PARAM_MODE: TransferMode(mode).value}


def decode_params(transfer_id: str, producers: Sequence[str]) -> dict[str, Any]:
    """``kv_transfer_params`` a router sends to the decode instance in push mode (in pull
    mode it forwards the prefill's response instead)."""
    return {"do_remote_prefill": True, PARAM_ID: transfer_id,
            PARAM_MODE: TransferMode.PUSH.value, PARAM_PRODUCERS: list(producers)}


def response_params(transfer_id: str, mode: TransferMode, producers: Sequence[str],
                    num_tokens: int, tickets: Sequence[bytes] = ()) -> dict[str, Any]:
    """What the prefill instance returns (vLLM puts it in the response's
    ``kv_transfer_params``)."""
    out: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False,
                           PARAM_ID: transfer_id, PARAM_MODE: mode.value,
                           PARAM_PRODUCERS: list(producers), PARAM_NUM_TOKENS: num_tokens}
    if tickets:
        out[PARAM_TICKETS] = [_encode_ticket(t) for t in tickets]
    return out


@dataclass(frozen=True)
class RemotePrefill:
    """A decode-side request's view of its ``kv_transfer_params``."""

    transfer_id: str
    mode: TransferMode
    producers: tuple[str, ...] = ()
    tickets: tuple[bytes, ...] = ()

    @classmethod
    def parse(cls, params: Mapping[str, Any], default_mode: TransferMode) -> RemotePrefill:
        """Raise ``ValueError`` naming what is missing or malformed."""
        transfer_id = params.get(PARAM_ID)
        if not isinstance(transfer_id, str) or not transfer_id:
            raise ValueError(f"kv_transfer_params needs a non-empty string {PARAM_ID!r}")
        mode = TransferMode(params.get(PARAM_MODE, default_mode.value))
        producers = params.get(PARAM_PRODUCERS) or []
        if isinstance(producers, str):
            producers = [producers]
        if not all(isinstance(p, str) and "://" in p for p in producers):
            raise ValueError(f"{PARAM_PRODUCERS!r} must list addresses like tcp://host:port")
        raw = params.get(PARAM_TICKETS) or []
        try:
            tickets = tuple(_decode_ticket(t) for t in raw)
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{PARAM_TICKETS!r} must be base64 strings: {exc}") from exc
        if mode is TransferMode.PUSH and not producers:
            raise ValueError(f"push needs {PARAM_PRODUCERS!r} (the prefill's kvpush address)")
        if mode is TransferMode.PULL and not tickets:
            raise ValueError(f"pull needs {PARAM_TICKETS!r} (from the prefill's response)")
        return cls(transfer_id, mode, tuple(producers), tickets)

    def for_rank(self, tp_rank: int) -> RemotePrefill:
        """The part a decode worker of rank ``tp_rank`` deals with (homogeneous TP: the
        producer of the same rank)."""
        count = len(self.tickets if self.mode is TransferMode.PULL else self.producers)
        if tp_rank >= count:
            raise ValueError(f"the request names {count} producer rank(s); decode rank "
                             f"{tp_rank} has none (prefill and decode TP sizes must match)")
        if self.mode is TransferMode.PULL:
            return RemotePrefill(self.transfer_id, self.mode, (), (self.tickets[tp_rank],))
        return RemotePrefill(self.transfer_id, self.mode, (self.producers[tp_rank],), ())


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


@dataclass
class SendPlan:
    """Prefill side: ``src`` holds the request's KV once this step's forward is done."""

    req_id: str
    transfer_id: str
    mode: TransferMode
    src: list[int]


@dataclass
class StepPlan:
    """What the worker side does in one engine step."""

    recv: list[RecvPlan] = field(default_factory=list)
    recv_aborts: list[str] = field(default_factory=list)      # vLLM request ids
    send: list[SendPlan] = field(default_factory=list)
    send_aborts: list[str] = field(default_factory=list)      # vLLM request ids

    def __bool__(self) -> bool:
        return bool(self.recv or self.recv_aborts or self.send or self.send_aborts)


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
