"""The anchors kvpush is measured against in real vLLM (``benchmarks/vllm_compare.py``),
loaded by vLLM as out-of-tree connectors (``kv_connector_module_path: vllm_anchors``; the
benchmark puts this folder on the servers' ``PYTHONPATH``):

* ``NoopConnector`` -- a connector that does nothing, on a colocated server: what vLLM's
  connector machinery alone costs per step (the floor for a decode server's TPOT).
* ``NixlConnectorNoSpin`` / ``NixlPushConnectorNoSpin`` -- vLLM's own NIXL connectors, as
  shipped except for one setting: NIXL's progress thread sleeps ``KVPUSH_NIXL_PTHR_DELAY_US``
  microseconds (default 1000) between polls instead of 0. ``nixl_agent`` hard-codes the
  delay to 0, which on CPU spins a whole core per agent (``../shared/docs/VLLM_ON_CPU.md``);
  this module makes the agent configuration class NIXL's Python API uses keep a floor on
  that delay, for the process it is imported into (vLLM's worker). Everything else is
  vLLM's code. 1 ms was their best setting on this machine.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector,
    NixlPushConnector,
)

__all__ = ["NixlConnectorNoSpin", "NixlPushConnectorNoSpin", "NoopConnector"]

PTHR_DELAY_US = int(os.environ.get("KVPUSH_NIXL_PTHR_DELAY_US", "1000"))


def _install_progress_delay(delay_us: int) -> None:
    """Every NIXL agent created after this call in this process polls with at least
    ``delay_us`` between progress-thread iterations."""
    import nixl._api as api

    bind = sys.modules[api.nixl_agent.__module__].nixlBind
    base = bind.nixlAgentConfig
    if getattr(base, "_kvpush_delay_floor", None) is not None:
        return
    descriptor = base.pthrDelay

    class _Config(base):  # type: ignore[misc, valid-type]
        _kvpush_delay_floor = delay_us

        @property
        def pthrDelay(self) -> int:
            return int(descriptor.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            descriptor.__set__(self, max(int(value), delay_us))

    bind.nixlAgentConfig = _Config


class NixlConnectorNoSpin(NixlConnector):
    """vLLM's ``NixlConnector`` (pull) with NIXL's progress thread not spinning."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _install_progress_delay(PTHR_DELAY_US)
        super().__init__(*args, **kwargs)


class NixlPushConnectorNoSpin(NixlPushConnector):
    """vLLM's ``NixlPushConnector`` (push) with NIXL's progress thread not spinning."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _install_progress_delay(PTHR_DELAY_US)
        super().__init__(*args, **kwargs)


class NoopConnector(KVConnectorBase_V1):
    """Loaded, called every step, moves nothing."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)

    # worker side
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
