"""kvpush: move LLM KV-cache blocks between a prefill engine and a decode engine over NIXL.

Push (the producer WRITEs into blocks the consumer registered early) and pull (the consumer
READs), per request. What each side does with a request: ``docs/PROTOCOL.md``; the layers
around it: ``docs/ARCHITECTURE.md``; which call any thread may make: ``docs/API.md``.
"""

from __future__ import annotations

try:
    from . import _core as _core
except ImportError as _exc:  # pragma: no cover - depends on the build state
    raise ImportError(
        "kvpush's compiled core (kvpush._core) is not built. From the repository root run:\n"
        "    python -m pip install --no-build-isolation -e .\n"
        "(or: python setup.py build_ext --inplace). Cause: " + str(_exc)
    ) from _exc

from .agent import TransportConfig
from .consumer import Consumer, ConsumerConfig
from .dataplane import shared_array, shared_tensor
from .errors import (
    AuthenticationError,
    ClosedError,
    InvalidBlockIds,
    InvalidRequest,
    KvpushError,
    LayoutMismatch,
    OutOfBlocks,
    PeerUnavailable,
    ProtocolError,
    RequestAborted,
    TransferFailed,
    TransferTimeout,
)
from .layout import KVLayout, MemoryKind, Region, check_compatible
from .messages import PullTicket
from .prefix import BlockPool, PrefixIndex, block_hashes, reusable_blocks
from .producer import Producer, ProducerConfig
from .progress import ProgressPolicy
from .request import (
    ConnectHandle,
    ConnectResult,
    OwnerStatus,
    Release,
    ReleaseReason,
    RequestState,
    RequestStatus,
    TransferHandle,
    TransferMode,
    TransferResult,
)

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "BlockPool",
    "ClosedError",
    "ConnectHandle",
    "ConnectResult",
    "Consumer",
    "ConsumerConfig",
    "InvalidBlockIds",
    "InvalidRequest",
    "KVLayout",
    "KvpushError",
    "LayoutMismatch",
    "MemoryKind",
    "OutOfBlocks",
    "OwnerStatus",
    "PeerUnavailable",
    "PrefixIndex",
    "Producer",
    "ProducerConfig",
    "ProgressPolicy",
    "ProtocolError",
    "PullTicket",
    "Region",
    "Release",
    "ReleaseReason",
    "RequestAborted",
    "RequestState",
    "RequestStatus",
    "TransferFailed",
    "TransferHandle",
    "TransferMode",
    "TransferResult",
    "TransferTimeout",
    "TransportConfig",
    "block_hashes",
    "check_compatible",
    "reusable_blocks",
    "shared_array",
    "shared_tensor",
]
