"""The anchors kvpush is measured against in real vLLM (:mod:`benchmarks.vllm.compare`),
loaded by vLLM as out-of-tree connectors (``kv_connector_module_path: anchors``; the
benchmark puts this folder on the servers' ``PYTHONPATH``):

* ``NoopConnector`` -- a connector that does nothing, on a colocated server: what vLLM's
  connector machinery alone costs per step.
* ``NoMoveLoadConnector`` -- the decode half of a disaggregated pair that moves nothing:
  every request sent with ``do_remote_prefill`` is declared loaded from outside (all its
  prompt but the last token, asynchronously, as kvpush's and vLLM's connectors declare
  theirs) and reported received in the same step. Its tokens are garbage (the KV blocks
  hold whatever they held); its TPOT is vLLM's disaggregated decode path, behind the same
  router, with no connector work at all: the floor for a disaggregated decode server's TPOT.
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
from dataclasses import dataclass, field
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

__all__ = ["NixlConnectorNoSpin", "NixlPushConnectorNoSpin", "NoMoveLoadConnector",
           "NoopConnector"]

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


@dataclass
class _Loads(KVConnectorMetadata):  # type: ignore[misc]
    req_ids: list[str] = field(default_factory=list)


class NoMoveLoadConnector(NoopConnector):
    """Declares every remote-prefill request's prompt (but its last token) loaded from
    outside, asynchronously, and reports it received in the step it was scheduled for;
    moves nothing."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._scheduled: list[str] = []   # scheduler side: loads for the next metadata
        self._received: set[str] = set()  # worker side: loads to report as done

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        count = int(request.num_prompt_tokens) - 1 - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # once per request, as the real connectors do
        if num_external_tokens > 0:
            self._scheduled.append(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._scheduled = _Loads(self._scheduled), []
        return meta

    # worker side
    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, _Loads):
            self._received.update(connector_metadata.req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        done, self._received = self._received, set()
        return None, done or None
