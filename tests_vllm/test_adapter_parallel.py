"""vLLM's parallelism as the adapter sees it, with vLLM's own ``ParallelConfig``: data-parallel
replicas of a dense model take ports of their own, and pipeline / context parallelism are
refused at the connector's construction in kvpush's words."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm.config import ParallelConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvpush.integrations import vllm as adapter
from kvpush.integrations.vllm_common import AdapterConfig


def engine_config(parallel: ParallelConfig) -> Any:
    ktc = SimpleNamespace(kv_connector_extra_config={"port": 29600}, kv_role="kv_producer",
                          engine_id="e1", is_kv_producer=True, is_kv_consumer=False)
    return SimpleNamespace(parallel_config=parallel, kv_transfer_config=ktc)


def test_dp_replicas_of_a_dense_model_take_their_own_ports(monkeypatch: Any) -> None:
    import vllm.distributed.parallel_state as state

    one = SimpleNamespace(rank_in_group=0, world_size=1)
    monkeypatch.setattr(state, "get_tp_group", lambda: one)
    monkeypatch.setattr(state, "get_pp_group", lambda: one)
    ports = []
    for rank in range(3):
        parallel = ParallelConfig(data_parallel_size=3, data_parallel_rank=rank)
        # What vLLM's engine process does to each replica of a dense model before the
        # workers (and the connector) start: data_parallel_rank becomes 0 in every one.
        parallel.reconfigure_for_independent_dp_rank()
        assert parallel.data_parallel_rank == 0
        coords = adapter._rank_coords(engine_config(parallel))
        assert coords.dp_rank == rank
        ports.append(AdapterConfig(port=29600).rank_port(coords))
    assert ports == [29600, 29601, 29602]


@pytest.mark.parametrize(("sizes", "named"), [
    ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size 2"),
    ({"prefill_context_parallel_size": 2}, "--prefill-context-parallel-size 2"),
    ({"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
     "--decode-context-parallel-size 2"),
])
@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_pipeline_and_context_parallelism_are_refused_in_kvpushs_words(
        sizes: dict[str, int], named: str, role: Any) -> None:
    parallel = ParallelConfig(**sizes)
    with pytest.raises(NotImplementedError,
                       match=f"kvpush's vLLM connector does not support {named}"):
        adapter.KVPushConnector(engine_config(parallel), role)
