"""kvpush as a vLLM v1 KV connector: ``KVPushConnector``.

A thin facade, like vLLM's own connectors: the constructor builds the scheduler-side object
(:class:`~kvpush.integrations.vllm_scheduler.KVPushScheduler`, in vLLM's EngineCore) or the
worker-side one (:class:`~kvpush.integrations.vllm_worker.KVPushWorker`, in each worker)
and every method forwards to it; the transfers are kvpush's Producer and Consumer.

Load it with (prefill instance; ``"kv_role": "kv_consumer"`` on the decode instance)::

    --kv-transfer-config '{"kv_connector": "KVPushConnector",
                           "kv_connector_module_path": "kvpush.integrations.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"port": 29600}}'

Push or pull is chosen per request by the router, in ``kv_transfer_params`` (see
:mod:`kvpush.integrations.vllm_common`, and ``docs/VLLM.md``).

This module imports vLLM (importing :mod:`kvpush` never does). mypy checks it without vLLM
installed, where vLLM's types are ``Any``; the ``unused-ignore`` codes keep it clean either way.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..messages import PROTOCOL_VERSION
from .vllm_common import (
    STAT_KEYS,
    AdapterConfig,
    EngineFacts,
    RankCoords,
    StepPlan,
    TransferStats,
    check_parallelism,
    check_vllm_version,
    engine_identity,
)
from .vllm_hybrid import cache_groups_of, group_identity
from .vllm_scheduler import KVPushScheduler, RankInfo
from .vllm_worker import KVPushWorker

__all__ = [
    "KVPushConnector",
    "KVPushConnectorMetadata",
    "KVPushHandshakeMetadata",
    "KVPushPromMetrics",
    "KVPushStats",
    "KVPushWorkerMetadata",
]

log = logging.getLogger("kvpush.vllm")


def _route_logs() -> None:
    """kvpush's log records go out through vLLM's handlers, in vLLM's format."""
    ours, theirs = logging.getLogger("kvpush"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


_route_logs()


@dataclass
class KVPushConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]
    """Scheduler -> worker, once per engine step."""

    plan: StepPlan


@dataclass
class KVPushHandshakeMetadata(KVConnectorHandshakeMetadata):  # type: ignore[misc, unused-ignore]
    """Worker -> scheduler at start-up: where this rank's kvpush endpoint listens (its
    advertised host and port: ranks may sit on different hosts) and which rank it is."""

    role: str
    name: str
    address: str
    host: str = ""
    port: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0


@dataclass
class KVPushWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc, unused-ignore]
    """Worker -> scheduler, per engine step: the transfers of preempted requests' sends
    that no longer read their blocks, counted over the ranks that said so (the scheduler
    side unpins the blocks once every rank has)."""

    ended: dict[str, int]

    def aggregate(self, other: Any) -> KVPushWorkerMetadata:
        for transfer_id, count in getattr(other, "ended", {}).items():
            self.ended[transfer_id] = self.ended.get(transfer_id, 0) + count
        return self


@dataclass
class KVPushStats(KVConnectorStats):  # type: ignore[misc, unused-ignore]
    """Transfer observations of one interval (lists, one entry per event; see
    :data:`~kvpush.integrations.vllm_common.STAT_KEYS`)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[float]] = {k: [] for k in STAT_KEYS}

    def aggregate(self, other: Any) -> KVPushStats:
        for key, values in other.data.items():
            self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        return TransferStats(self.data).summary()

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVPushPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc, unused-ignore]
    """Prometheus metrics, named as vLLM names its connectors' (``vllm:kvpush_*``)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def per_engine(metric: Any) -> Any:
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        self.xfer_time = per_engine(self._histogram_cls(
            name="vllm:kvpush_xfer_time_seconds",
            documentation="Time from a request's registration (push) or READ (pull) to all "
                          "of its KV landed, on the decode instance.",
            buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0],
            labelnames=labelnames))
        self.bytes = per_engine(self._histogram_cls(
            name="vllm:kvpush_bytes_transferred",
            documentation="Bytes of KV received per request, on the decode instance.",
            buckets=[2 ** (10 + i) for i in range(1, 25, 2)],
            labelnames=labelnames))
        self.counters = {
            key: per_engine(self._counter_cls(name=f"vllm:kvpush_{key}", documentation=doc,
                                              labelnames=labelnames))
            for key, doc in (
                ("num_push", "Requests whose KV arrived by push (producer WRITE)."),
                ("num_pull", "Requests whose KV arrived by pull (consumer READ)."),
                ("num_failed", "Requests whose KV did not arrive (failed, timed out, "
                               "aborted); vLLM's kv_load_failure_policy applies."),
                ("num_released", "Prefill requests whose blocks were released after their "
                                 "transfer."),
                ("num_lease_expired", "Prefill requests whose blocks were released because "
                                      "no decode instance came for them within the lease."),
                ("num_send_failed", "Prefill requests whose transfer failed or was aborted."),
            )
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for value in transfer_stats_data.get("transfer_s", ()):
            self.xfer_time[engine_idx].observe(value)
        for value in transfer_stats_data.get("bytes", ()):
            self.bytes[engine_idx].observe(value)
        for key, counter in self.counters.items():
            count = len(transfer_stats_data.get(key, ()))
            if count:
                counter[engine_idx].inc(count)


class KVPushConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc, unused-ignore]
    """vLLM v1 KV connector over kvpush: push (producer WRITE) or pull (consumer READ) per
    request. See the module docstring.

    ``SupportsHMA``: vLLM keeps its hybrid memory allocator on for hybrid models (several
    KV cache groups: full and sliding-window attention, Mamba state); each request's
    transfer moves the blocks every group needs (:mod:`kvpush.integrations.vllm_hybrid`):
    only the window's for sliding-window groups, the state slot once for Mamba groups
    (prefix caching off). Other kinds are refused at start-up."""

    # vLLM's prefix-cache metrics count loaded tokens by source: ours come from a peer.
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        # The connector interface changes between vLLM minor releases: refuse the ones this
        # adapter was not written against, before anything starts.
        self._vllm_version = check_vllm_version(vllm.__version__)
        # Pipeline and context parallelism are refused here, in kvpush's words, before
        # vLLM's engine finds out at its handshake.
        parallel = vllm_config.parallel_config
        check_parallelism(
            pipeline=int(getattr(parallel, "pipeline_parallel_size", 1) or 1),
            prefill_context=int(getattr(parallel, "prefill_context_parallel_size", 1) or 1),
            decode_context=int(getattr(parallel, "decode_context_parallel_size", 1) or 1))
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        config = AdapterConfig.from_extra_config(ktc.kv_connector_extra_config)
        self._config = config
        self._scheduler: KVPushScheduler | None = None
        self._worker: KVPushWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KVPushScheduler(vllm_config, kv_cache_config, config)
        elif role == KVConnectorRole.WORKER:
            num_blocks = getattr(kv_cache_config, "num_blocks", None)
            self._worker = KVPushWorker(config, ktc.kv_role, ktc.engine_id,
                                        vllm_config.cache_config.block_size, num_blocks,
                                        getattr(ktc, "kv_buffer_device", None))
        else:
            raise ValueError(f"kvpush: unknown KVConnectorRole {role!r}")

    # -- class-level hooks -----------------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # Both instances must lay out a block's interior alike (kvpush compares shapes, not
        # interior order): ask for vLLM's identity layout, as vLLM's NIXL connector does.
        model_config = getattr(vllm_config, "model_config", None)
        if model_config is None or getattr(model_config, "use_mla", False):
            return None
        return "LBHNC"

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # vLLM 0.33 asks before enabling sleep mode. kvpush's endpoints hold NIXL
        # registrations of the KV memory and peers hold descriptors of it; sleep remaps that
        # memory and unregister_kv_caches / restore_kv_caches are not implemented: say no.
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPushStats:
        return KVPushStats(data=data) if data is not None else KVPushStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVPushPromMetrics:
        return KVPushPromMetrics(vllm_config, metric_types, labelnames,
                                 per_engine_labelvalues)

    # -- worker side -----------------------------------------------------------------------
    def _w(self) -> KVPushWorker:
        if self._worker is None:
            raise RuntimeError("kvpush: worker-side method called on the scheduler side")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._w().register_kv_caches(kv_caches, coords=_rank_coords(self._vllm_config),
                                     facts=_engine_facts(self._vllm_config,
                                                         self._kv_cache_config, self._config,
                                                         self._vllm_version),
                                     host_ip=_host_ip())

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Before the forward pass: registrations (push) and READs (pull) start now, so they
        # overlap this step's compute instead of following it.
        if isinstance(connector_metadata, KVPushConnectorMetadata):
            self._w().bind(connector_metadata.plan)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # Called before the forward pass: the transfers of requests vLLM preempted are
        # aborted (their blocks stay pinned until they have ended; nothing waits here).
        if isinstance(kv_connector_metadata, KVPushConnectorMetadata):
            self._w().handle_preemptions(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass  # loads are asynchronous and started in bind_connector_metadata

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # no layer-wise loading: requests wait in WAITING_FOR_REMOTE_KVS instead

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # Layer-wise push (``layerwise``): the layer's KV is written; it travels now.
        # Otherwise the producer sends whole requests, from wait_for_save.
        if self._config.layerwise:
            self._w().save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._w().after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return self._w().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        # vLLM 0.32/0.33 call this (not get_finished) from the model runner: failed loads
        # are named in failed_recving as well as ended in finished_recving, and their
        # blocks still go to get_block_ids_with_load_errors (as vLLM's NIXL connector does).
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        sending, recving = self._w().get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving,
            failed_recving=self._w().take_failed_recving(recving))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().take_load_errors()

    def get_kv_connector_stats(self) -> KVPushStats | None:
        if self._worker is None:
            return None
        data = self._worker.take_stats()
        return None if data is None else KVPushStats(data=data)

    def build_connector_worker_meta(self) -> KVPushWorkerMetadata | None:
        ended = self._w().take_ended()
        if not ended:
            return None
        counts: dict[str, int] = {}
        for transfer_id in ended:
            counts[transfer_id] = counts.get(transfer_id, 0) + 1
        return KVPushWorkerMetadata(counts)

    def get_handshake_metadata(self) -> KVPushHandshakeMetadata | None:
        info = self._w().handshake()
        return None if info is None else KVPushHandshakeMetadata(**info)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- scheduler side --------------------------------------------------------------------
    def _s(self) -> KVPushScheduler:
        if self._scheduler is None:
            raise RuntimeError("kvpush: scheduler-side method called on the worker side")
        return self._scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._s().bind_kv_cache_manager(kv_cache_manager)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._s().set_handshake({rank: RankInfo(**asdict(m))
                                 for rank, m in metadata.items()
                                 if isinstance(m, KVPushHandshakeMetadata)})

    def on_new_request(self, request: Any) -> None:
        self._s().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVPushConnectorMetadata:
        return KVPushConnectorMetadata(self._s().build_plan(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        self._s().update_connector_output(connector_output)

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM's hybrid allocator (SupportsHMA) calls this instead of request_finished. The
        # blocks a transfer reads were named when the last prefill chunk was scheduled (the
        # sliding-window ones held since: vLLM has freed its out-of-window blocks by now).
        return self._s().request_finished(request, block_ids[0] if block_ids else [])

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def has_pending_block_frees(self) -> bool:
        # True only while preempted sends' pinned blocks are about to come back: vLLM waits
        # for those instead of preempting more (KVPushScheduler.has_pending_block_frees).
        return self._scheduler is not None and self._scheduler.has_pending_block_frees()


# -- what vLLM knows that the tensors do not -----------------------------------------------
def _rank_coords(vllm_config: Any) -> RankCoords:
    """This worker's (DP rank, PP stage, TP rank) and sizes, from vLLM's process groups."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    return RankCoords(tp_rank=tp.rank_in_group, tp_size=tp.world_size,
                      pp_rank=pp.rank_in_group, pp_size=pp.world_size,
                      dp_rank=dp_index(vllm_config.parallel_config))


def dp_index(parallel_config: Any) -> int:
    """This engine's data-parallel rank among every replica of the deployment.

    Not ``data_parallel_rank``: vLLM sets that to 0 in each engine of a dense (non-MoE)
    model, whose replicas it runs as independent engines
    (``ParallelConfig.reconfigure_for_independent_dp_rank``), so every replica would take
    the same ports. ``data_parallel_index`` keeps the original rank (vLLM's NIXL connector
    offsets its side-channel port by it too)."""
    index = getattr(parallel_config, "data_parallel_index", None)
    if index is not None:
        return int(index)
    if int(getattr(parallel_config, "data_parallel_size", 1) or 1) > 1:
        return int(getattr(parallel_config, "data_parallel_rank", 0) or 0)
    return 0


def _host_ip() -> str | None:
    """This machine's address as vLLM finds it (``VLLM_HOST_IP`` first)."""
    try:
        from vllm.utils.network_utils import get_ip
    except ImportError:  # pragma: no cover - moved in another release
        return None
    try:
        return str(get_ip())
    except Exception:  # no route: the configured host must do
        return None


def _engine_facts(vllm_config: Any, kv_cache_config: Any, config: AdapterConfig,
                  vllm_version: tuple[int, int]) -> EngineFacts:
    """The attention backend, resolved KV cache layout and cache dtype of this worker, and
    the compatibility identity both instances must share."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    backends = sorted({b.get_name() for b in get_current_attn_backends(vllm_config)})
    backend = ",".join(backends)
    cache = vllm_config.cache_config
    layout = getattr(cache, "kv_cache_layout", None) or getattr(kv_cache_config,
                                                                "kv_cache_layout", None)
    model = vllm_config.model_config
    groups = cache_groups_of(kv_cache_config, int(cache.block_size))
    identity = engine_identity(
        model=config.model_id or str(model.model), revision=model.revision,
        dtype=str(model.dtype), num_layers=model.get_total_num_hidden_layers(),
        num_kv_heads=model.get_total_num_kv_heads(), head_size=model.get_head_size(),
        cache_dtype=str(cache.cache_dtype), attn_backend=backend, protocol=PROTOCOL_VERSION,
        vllm_version=vllm_version, cache_kind="mla" if model.use_mla else "kv",
        extra=group_identity(groups))
    return EngineFacts(attn_backend=backend, kv_cache_layout=layout,
                       cache_dtype=str(cache.cache_dtype), identity=identity,
                       cache_kind="mla" if model.use_mla else "kv",
                       # MLA: one latent vector per token, whole on every rank
                       total_kv_heads=1 if model.use_mla else int(model.get_total_num_kv_heads()),
                       groups=groups)
