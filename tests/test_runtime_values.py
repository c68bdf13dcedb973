"""DTensors on a real 4-worker cluster: factories, placements and values against plain torch."""

import asyncio
import threading

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, Partial, Replicate, Shard, init_device_mesh

PLACEMENTS_1D = [[Shard(0)], [Shard(1)], [Replicate()], [Partial("sum")], [Partial("avg")],
                 [Partial("max")], [Partial("min")]]
PLACEMENTS_2D = [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Replicate(), Shard(0)],
                 [Shard(0), Replicate()], [Shard(0), Shard(0)], [Partial(), Shard(1)],
                 [Replicate(), Partial("max")], [Replicate(), Replicate()]]


def test_seed_002_blocks_on_2x2_mesh(mesh2d):
    big = torch.arange(16.).reshape(4, 4)
    d = dtorch.distribute_tensor(big, mesh2d, [Shard(0), Shard(1)])
    assert d.to_local(0).flatten().tolist() == [0.0, 1.0, 4.0, 5.0]
    assert d.to_local(1).flatten().tolist() == [2.0, 3.0, 6.0, 7.0]
    assert d.to_local(2).flatten().tolist() == [8.0, 9.0, 12.0, 13.0]
    assert d.to_local(3).flatten().tolist() == [10.0, 11.0, 14.0, 15.0]
    assert tuple(d.shape) == (4, 4)
    assert d.local_shapes() == {r: (2, 2) for r in range(4)}
    assert torch.equal(d.to_torch(), big)


@pytest.mark.parametrize("placements", PLACEMENTS_1D, ids=str)
@pytest.mark.parametrize("shape", [(4, 4), (5, 3), (3, 11)])
def test_tensor_roundtrip_1d(mesh1d, placements, shape):
    value = torch.randn(shape, dtype=torch.float64)
    d = dtorch.tensor(value, device_mesh=mesh1d, placements=placements)
    assert d.placements == tuple(placements)
    assert torch.allclose(d.to_torch(), value)


@pytest.mark.parametrize("placements", PLACEMENTS_2D, ids=str)
def test_tensor_roundtrip_2d(mesh2d, placements):
    value = torch.arange(35, dtype=torch.float32).reshape(5, 7)
    d = dtorch.tensor(value, device_mesh=mesh2d, placements=placements)
    assert torch.equal(d.to_torch(), value)


REDUCE = {"sum": lambda t: t.sum(0), "avg": lambda t: t.mean(0),
          "max": lambda t: t.amax(0), "min": lambda t: t.amin(0)}


@pytest.mark.parametrize("op", sorted(REDUCE))
def test_partial_values_reduce_every_ranks_share(mesh1d, mesh2d, op):
    """to_torch() of a Partial reduces a different random share from every rank (1-D), and
    on a 2-D mesh with the Partial on either dim, the other dim sharded or Partial too."""
    g = torch.Generator().manual_seed(3)
    shares = torch.randn(4, 5, 3, generator=g, dtype=torch.float64)
    d = dtorch.from_local(list(shares), mesh1d, [Partial(op)])
    assert torch.allclose(d.to_torch(), REDUCE[op](shares), rtol=1e-12, atol=1e-12)
    for placements in ([Partial(op), Shard(0)], [Shard(1), Partial(op)],
                       [Partial(op), Partial(op)]):
        per_rank = {}
        for rank in mesh2d.ranks:  # each rank's block of its own random global share
            coord = mesh2d.get_coordinate(rank)
            share = torch.randn(4, 6, generator=g, dtype=torch.float64)
            block = dtorch.layout.shard_of(share, mesh2d, [
                Replicate() if p.is_partial() else p for p in placements], coord)
            per_rank[rank] = (share, block)
        d = dtorch.from_local({r: b for r, (_, b) in per_rank.items()}, mesh2d, placements,
                              shape=(4, 6))
        want = _reduce_2d(per_rank, mesh2d, placements, op)
        assert torch.allclose(d.to_torch(), want, rtol=1e-12, atol=1e-12), placements


def _reduce_2d(per_rank, mesh, placements, op):
    """The global value: each block region is the reduction of the shares of the ranks that
    differ only along Partial mesh dims."""
    out = torch.empty(4, 6, dtype=torch.float64)
    keep = [m for m, p in enumerate(placements) if not p.is_partial()]
    groups: dict = {}
    for rank, (share, _) in per_rank.items():
        coord = mesh.get_coordinate(rank)
        groups.setdefault(tuple(coord[m] for m in keep), []).append(share)
    for key, members in groups.items():
        coord = [0] * mesh.ndim
        for m, c in zip(keep, key):
            coord[m] = c
        region = dtorch.layout.rank_block((4, 6), mesh, [
            Replicate() if p.is_partial() else p for p in placements], tuple(coord))
        reduced = REDUCE[op](torch.stack(members))
        out[region.slices()] = reduced[region.slices()]
    return out


def test_partial_sum_keeps_value_on_first_rank(mesh1d):
    value = torch.ones(2, 2)
    d = dtorch.tensor(value, device_mesh=mesh1d, placements=[Partial()])
    assert torch.equal(d.to_local(0), value)
    assert torch.equal(d.to_local(2), torch.zeros(2, 2))
    avg = dtorch.tensor(value, device_mesh=mesh1d, placements=[Partial("avg")])
    assert torch.equal(avg.to_local(3), value)


@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Replicate()], [Partial()]],
                         ids=str)
@pytest.mark.parametrize("name", ["zeros", "ones", "empty"])
def test_constant_factories(mesh1d, name, placements):
    d = getattr(dtorch, name)(3, 5, device_mesh=mesh1d, placements=placements)
    assert d.shape == torch.Size([3, 5]) and d.dtype == torch.float32
    if name != "empty":
        assert torch.equal(d.to_torch(), getattr(torch, name)(3, 5))


def test_full_arange_and_like_factories(mesh2d):
    f = dtorch.full((3, 4), 7.5, device_mesh=mesh2d, placements=[Shard(0), Shard(1)])
    assert torch.equal(f.to_torch(), torch.full((3, 4), 7.5))
    a = dtorch.arange(10, device_mesh=mesh2d, placements=[Shard(0), Replicate()])
    assert a.dtype == torch.int64 and torch.equal(a.to_torch(), torch.arange(10))
    b = dtorch.arange(1.0, 4.0, 0.5, device_mesh=mesh2d, placements=[Replicate(), Shard(0)])
    assert torch.equal(b.to_torch(), torch.arange(1.0, 4.0, 0.5))
    z = dtorch.zeros_like(f)
    assert z.placements == f.placements and torch.equal(z.to_torch(), torch.zeros(3, 4))
    o = dtorch.ones_like(f, placements=[Replicate(), Replicate()])
    assert torch.equal(o.to_torch(), torch.ones(3, 4))
    assert torch.equal(dtorch.full_like(f, 2).to_torch(), torch.full((3, 4), 2.0))


@pytest.mark.parametrize("placements", [[Shard(0), Shard(1)], [Replicate(), Replicate()],
                                        [Shard(1), Partial()], [Shard(0), Shard(0)]], ids=str)
@pytest.mark.parametrize("name", ["rand", "randn"])
def test_random_values_do_not_depend_on_placements(mesh2d, name, placements):
    dtorch.manual_seed(1234)
    d = getattr(dtorch, name)(5, 7, device_mesh=mesh2d, placements=placements)
    d2 = getattr(dtorch, name)(3, device_mesh=mesh2d)
    torch.manual_seed(1234)
    assert torch.equal(d.to_torch(), getattr(torch, name)(5, 7))
    assert torch.equal(d2.to_torch(), getattr(torch, name)(3))


def test_randint_matches_torch(mesh1d):
    dtorch.manual_seed(7)
    d = dtorch.randint(3, 10, (6, 2), device_mesh=mesh1d, placements=[Shard(0)])
    torch.manual_seed(7)
    assert torch.equal(d.to_torch(), torch.randint(3, 10, (6, 2)))


def test_random_on_sub_mesh_keeps_generators_in_step(live):
    sub = DeviceMesh("cpu", [2, 3])
    dtorch.manual_seed(5)
    a = dtorch.randn(4, device_mesh=sub, placements=[Shard(0)])
    b = dtorch.randn(4, device_mesh=init_device_mesh("cpu", 4), placements=[Shard(0)])
    torch.manual_seed(5)
    assert torch.equal(a.to_torch(), torch.randn(4))
    assert torch.equal(b.to_torch(), torch.randn(4))


def test_default_mesh_is_the_whole_cluster_or_the_guarded_one(live):
    x = dtorch.ones(2, 3)
    assert x.device_mesh == DeviceMesh("cpu", [0, 1, 2, 3]) == DeviceMesh("cpu")
    assert x.placements == (Replicate(),)
    assert dtorch.zeros(1).device_mesh is x.device_mesh  # one mesh object, built once
    with dtorch.Graph.default_graph().device_mesh_guard(DeviceMesh("cpu", [1, 3])):
        y = dtorch.zeros(4, placements=[Shard(0)])
    assert y.device_mesh.ranks == (1, 3)
    assert y.local_shapes() == {1: (2,), 3: (2,)}
    assert torch.equal(y.to_torch(), torch.zeros(4))


def test_sub_mesh_tensor_on_bigger_cluster(live):
    sub = DeviceMesh("cpu", [[3], [1]], mesh_dim_names=["a", "b"])
    value = torch.arange(6.).reshape(3, 2)
    d = dtorch.tensor(value, device_mesh=sub, placements=[Shard(0), Replicate()])
    assert d.local_shapes() == {3: (2, 2), 1: (1, 2)}
    assert torch.equal(d.to_local(1), value[2:])
    r = d.redistribute(placements=[Replicate(), Replicate()])
    assert torch.equal(r.to_local(1), value)


def test_scalar_values_and_conversions(mesh1d):
    s = dtorch.tensor(3.5, device_mesh=mesh1d)
    assert s.item() == 3.5 and float(s) == 3.5 and bool(s)
    v = dtorch.tensor([1, 2, 3], device_mesh=mesh1d, placements=[Shard(0)])
    assert v.tolist() == [1, 2, 3] and v.numpy().tolist() == [1, 2, 3] and len(v) == 3


def test_repr_shows_metadata_and_values(mesh1d):
    d = dtorch.tensor(torch.arange(4.), device_mesh=mesh1d, placements=[Shard(0)])
    text = repr(d)
    assert "shape=(4,)" in text and "placements=[S(0)]" in text and "tensor([0., 1., 2., 3.])" in text


def test_tensor_future_get_wait_callback_and_await(mesh1d):
    d = dtorch.tensor(torch.arange(8.), device_mesh=mesh1d, placements=[Shard(0)])
    fut = d.to_torch_async()
    assert fut.wait(timeout=30) is fut and fut.is_ready()
    assert torch.equal(fut.get(), torch.arange(8.))
    called = threading.Event()
    seen = []
    fut2 = d.to_torch_async()
    fut2.add_done_callback(lambda f: (seen.append(f.get()), called.set()))
    assert called.wait(30) and torch.equal(seen[0], torch.arange(8.))

    async def main():
        return await d.to_torch_async()

    assert torch.equal(asyncio.run(main()), torch.arange(8.))


def test_dtypes_are_torch_dtypes():
    assert dtorch.float32 is torch.float32 and dtorch.int64 is torch.int64


def test_cluster_info_and_synchronize(live):
    info = dtorch.cluster_info()
    assert info["ranks"] == 4 and info["backend"] == "gloo"
    assert sorted(info["workers"]) == [0, 1, 2, 3]
    assert all(a.startswith("tls://127.0.0.1:") for a in info["workers"].values())
    dtorch.synchronize()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.complex128,
                                   torch.complex64, torch.bool, torch.int8, torch.uint8,
                                   torch.int32, torch.float64])
def test_every_dtype_travels_both_ways(mesh1d, dtype):
    value = (torch.arange(10) % 3).to(dtype).reshape(5, 2)
    d = dtorch.tensor(value, device_mesh=mesh1d, placements=[Shard(0)])
    assert d.dtype == dtype
    assert torch.equal(d.to_torch(), value)
    assert torch.equal(d.redistribute(placements=[Replicate()]).to_local(3), value)


def test_tensor_accepts_mesh_and_placements_positionally(mesh1d):
    d = dtorch.tensor(torch.arange(4.), mesh1d, [Shard(0)])
    assert d.placements == (Shard(0),) and d.local_shapes()[3] == (1,)


def test_repr_of_a_failed_tensor_shows_the_error_instead_of_raising(mesh1d):
    parts = [torch.ones(2, dtype=torch.complex64)] * 4
    bad = dtorch.from_local(parts, mesh1d, [Partial("max")]).redistribute(placements=[Replicate()])
    text = repr(bad)
    assert "placements=[R]" in text and "values unavailable: RemoteError" in text
    with pytest.raises(dtorch.RemoteError):
        bad.to_torch()
    with pytest.raises(dtorch.RemoteError):
        dtorch.synchronize()


def test_sizes_may_be_numpy_ints(mesh1d):
    import numpy as np
    d = dtorch.zeros(np.int64(3), np.int32(2), device_mesh=mesh1d)
    assert d.shape == torch.Size([3, 2])
    with pytest.raises(ValueError, match="non-negative ints"):
        dtorch.zeros(2.5, device_mesh=mesh1d)


def test_a_read_of_an_idle_cluster_runs_on_the_event_loop_and_never_overtakes(mesh1d):
    """A batch of only reads and frees runs on the worker's event loop when the interpreter is
    idle (no thread hop), but never ahead of a batch the interpreter is still running."""
    import time
    from dtorch.runtime import messages as m
    from dtorch.runtime import session
    c = session.get_controller()
    import gc
    x = dtorch.ones(8, device_mesh=mesh1d, placements=[Shard(0)])
    gc.collect()  # no handle of an earlier test may be freed (a batch of its own) meanwhile
    gc.disable()
    try:
        dtorch.synchronize()
        before = [s["inline_batches"] for s in c.stats()]
        assert torch.equal(x.to_torch(), torch.ones(8))
        after = [s["inline_batches"] for s in c.stats()]
    finally:
        gc.enable()
    assert all(a == b + 1 for a, b in zip(after, before)), (before, after)
    c.issue(m.Call((), time.sleep, (0.5,), {}, mesh1d.ranks))
    x.add_(1)
    c.flush()  # the slow batch is on its way; the read below is a quick batch behind it
    assert torch.equal(x.to_torch(), torch.full((8,), 2.))


def test_rank_processes_run_without_dask_housekeeping_noise(mesh1d):
    """The embedded cluster's workers start with Dask's profiler off and slow monitors (they
    take cores from gloo); a setting the user made is kept."""
    import dask
    from dtorch.runtime import session
    from dtorch.runtime.cluster import _QUIET_WORKERS, _user_set
    got = session.get_controller().client.run(
        lambda: [dask.config.get(k) for k in _QUIET_WORKERS])
    assert all(v == list(_QUIET_WORKERS.values()) for v in got.values()), got
    assert not _user_set("distributed.admin.tick.interval")
    with dask.config.set({"distributed.admin.tick.interval": "50ms"}):
        assert _user_set("distributed.admin.tick.interval")


def test_like_factories_refuse_what_they_cannot_honour(mesh1d):
    x = dtorch.zeros(4, 3, device_mesh=mesh1d, placements=[Shard(0)])
    ok = dtorch.ones_like(x, device="cpu", layout=torch.strided,
                          memory_format=torch.preserve_format)
    assert ok.placements == x.placements and torch.equal(ok.to_torch(), torch.ones(4, 3))
    with pytest.raises(ValueError, match="layout=torch.sparse_coo is not supported"):
        dtorch.zeros_like(x, layout=torch.sparse_coo)
    with pytest.raises(ValueError, match="set by its mesh"):
        dtorch.full_like(x, 2.0, device="cuda")
    with pytest.raises(ValueError, match="memory_format=torch.channels_last"):
        dtorch.empty_like(x, memory_format=torch.channels_last)
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        dtorch.randn_like(x, colour="red")
