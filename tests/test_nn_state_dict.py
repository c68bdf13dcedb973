"""Loading a state_dict streams: one tensor at a time, each rank sent only its shard, the
controller's extra memory bounded by the largest tensor (real 4-rank cluster, 400 MB)."""

import gc
import threading

import psutil
import pytest
import torch

import dtorch
import dtorch.nn as nn
from dtorch import Replicate, Shard, init_device_mesh

N = 5120  # one 5120 x 5120 float32 weight is 100 MiB; four of them make the 400 MiB state_dict
MiB = 2 ** 20


class PeakRSS:
    """The highest resident set size of this process while the block runs (sampled)."""

    def __enter__(self):
        gc.collect()
        self._proc = psutil.Process()
        self.base = self.peak = self._proc.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(0.002):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def extra(self) -> int:
        return self.peak - self.base


@pytest.mark.timeout(300)
def test_a_400_mib_state_dict_loads_with_bounded_controller_memory(live):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("tp",))
    model = nn.ModuleList([nn.ColumnParallelLinear(N, N, bias=False, device_mesh=mesh),
                           nn.RowParallelLinear(N, N, bias=False, device_mesh=mesh),
                           nn.ColumnParallelLinear(N, N, bias=False, device_mesh=mesh),
                           nn.ReplicateParallelLinear(N, N, bias=False, device_mesh=mesh)])
    gen = torch.Generator().manual_seed(0)
    state = {f"{i}.weight": torch.randn(N, N, generator=gen) for i in range(4)}
    largest = max(t.numel() * t.element_size() for t in state.values())
    assert sum(t.numel() * t.element_size() for t in state.values()) == 400 * MiB
    dtorch.clear_constants()  # earlier tests' cached constants hold rank bytes too
    gc.collect()  # earlier tests' cyclic garbage is freed now, not in the middle of the load
    dtorch.synchronize()
    before = {s["rank"]: s["bytes"] for s in dtorch.rank_stats()}
    with PeakRSS() as rss:
        model.load_state_dict(state)
        dtorch.synchronize()
    gc.collect()
    dtorch.synchronize()
    assert rss.extra < 1.5 * largest + 64 * MiB, f"controller grew {rss.extra / MiB:.0f} MiB"
    shard = N * (N // 4) * 4
    for s in dtorch.rank_stats():  # each rank holds its quarter of three weights, all of one
        assert s["bytes"] == before[s["rank"]], "the replaced shards were not freed"
        assert s["bytes"] == 3 * shard + N * N * 4
    assert model[0].weight.placements == (Shard(0),) and model[3].weight.placements == (
        Replicate(),)
    assert torch.equal(model[1].weight.to_local(2), state["1.weight"][:, 2 * N // 4:3 * N // 4])
    assert torch.equal(model[3].weight.to_local(1), state["3.weight"])
