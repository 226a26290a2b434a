"""GPU memory (VRAM) regions: the same API as DRAM. Runs where a CUDA GPU and a CUDA build
of torch exist; skipped with the reason everywhere else (this project's CI has no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import kvpush
from kvpush import RequestState, TransferMode

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip(f"no CUDA GPU here (torch {torch.__version__}, cuda available: False)",
                allow_module_level=True)

pytestmark = pytest.mark.gpu


def vram_cache(num_blocks: int, seed: int | None) -> tuple[list, kvpush.KVLayout]:
    gen = torch.Generator(device="cuda")
    tensors = []
    for _ in range(4):  # 2 layers, K and V
        t = torch.zeros((num_blocks, 4, 2, 64), dtype=torch.float16, device="cuda")
        if seed is not None:
            gen.manual_seed(seed + len(tensors))
            t.normal_(generator=gen)
        tensors.append(t)
    layout = kvpush.KVLayout.from_buffers(tensors, num_layers=2, num_blocks=num_blocks,
                                          tokens_per_block=4, num_kv_heads=2, head_size=64,
                                          dtype="float16", kv_packed=False)
    return tensors, layout


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_vram_push_and_pull(mode: TransferMode) -> None:
    src, src_layout = vram_cache(64, seed=1)
    dst, dst_layout = vram_cache(64, seed=None)
    assert src_layout.kind is kvpush.MemoryKind.VRAM
    src_ids, dst_ids = np.array([3, 4, 5, 60]), np.array([0, 1, 2, 10])
    with kvpush.Producer(src_layout) as p, kvpush.Consumer(dst_layout) as c:
        name = c.connect(p.address, timeout=30)
        if mode is TransferMode.PUSH:
            handle = c.expect("g", dst_ids, name)
            p.prefill_done("g", src_ids)
        else:
            handle = c.pull(p.prefill_done("g", src_ids, mode), dst_ids)
        assert handle.wait(30).state is RequestState.READY
    torch.cuda.synchronize()
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(s[torch.as_tensor(src_ids, device="cuda")],
                           d[torch.as_tensor(dst_ids, device="cuda")])
        untouched = torch.ones(64, dtype=torch.bool, device="cuda")
        untouched[torch.as_tensor(dst_ids, device="cuda")] = False
        assert not d[untouched].any()
