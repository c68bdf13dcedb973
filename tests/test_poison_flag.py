"""The poison flag rides inside each collective's payload: a failure on one rank poisons its
peers' results through all_gather, all_to_all, all_reduce, reduce_scatter and send_recv, and a
change of placement is one torch.distributed collective on each rank (the workers' own counts,
``rank_stats()['dist_calls']``), at every size and dtype, on the real 4-rank cluster."""

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import DeviceMesh, Partial, Replicate, Shard

R = Replicate()
SMALL, LARGE = 8, 1 << 16  # features: 32 bytes a row, or 256 KiB a row (1 MiB in all)
MOVES = [  # (source placements, target placements, collective)
    ([Shard(0)], [R], "all_gather"),
    ([Shard(1)], [R], "all_gather"),
    ([Shard(0)], [Shard(1)], "all_to_all"),
    ([Shard(1)], [Shard(0)], "all_to_all"),
    ([Partial()], [R], "all_reduce"),
    ([Partial()], [Shard(0)], "reduce_scatter"),
    ([Partial("max")], [R], "all_reduce"),
    ([Partial("min")], [Shard(1)], "reduce_scatter"),
]
IDS = [f"{s[0]}->{d[0]}" for s, d, _ in MOVES]


LAYOUTS = {  # name: (embedding indices, one block per mesh coordinate; the failing coordinate)
    "even": ([0, 1, 2, 99], 3),
    "uneven": ([0, 1, 2, 3, 99], 2),  # 5 rows over 4: blocks of 2, 2, 1, 0 rows
}


def failing(mesh, layout: str, src, dtype=torch.float32, features: int = SMALL):
    """A DTensor laid out as ``src`` whose computation fails on one rank only (its embedding
    index is out of range); returns it and that rank."""
    indices, coordinate = LAYOUTS[layout]
    idx = dtorch.tensor(torch.tensor(indices), device_mesh=mesh, placements=[Shard(0)])
    emb = dtorch.tensor(torch.randn(10, features), device_mesh=mesh, placements=[R])
    rows = F.embedding(idx, emb).to(dtype)  # [len(indices), features] Shard(0)
    x = {Shard(0): lambda: rows, Shard(1): lambda: rows.t(),
         Partial("sum"): lambda: rows.sum(0, dtype=dtype), Partial("max"): lambda: rows.amax(0),
         Partial("min"): lambda: rows.amin(0)}[src[0]]()
    assert x.placements == tuple(src) and x.dtype == dtype
    return x, mesh.ranks[coordinate]


def dist_calls() -> dict:
    dtorch.synchronize()
    return {s["rank"]: s["dist_calls"] for s in dtorch.rank_stats()}


def source(value, mesh, src):
    """``value`` laid out as ``src`` (a Partial: rank 0 holds it all, the others zeros, or for
    max/min every rank holds it)."""
    if isinstance(src[0], Partial):
        zeros = torch.zeros_like(value)
        spread = src[0].reduce_op in ("max", "min")
        return dtorch.from_local([value] + [value if spread else zeros] * (mesh.size() - 1),
                                 mesh, src)
    return dtorch.tensor(value, device_mesh=mesh, placements=src)


POISON_MOVES = MOVES[:-1] + [([Partial("min")], [Shard(0)], "reduce_scatter")]


@pytest.mark.parametrize("src, dst, kind", POISON_MOVES, ids=IDS[:-1] + ["P(min)->S(0)"])
@pytest.mark.parametrize("layout, features", [("even", SMALL), ("even", LARGE),
                                              ("uneven", SMALL)],
                         ids=["small", "large", "uneven"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8], ids=["f32", "u8"])
@pytest.mark.parametrize("ranks", [(0, 1, 2, 3), (3, 1, 0, 2)], ids=["mesh", "permuted-mesh"])
def test_a_failure_on_one_rank_poisons_every_rank_through_the_collective(live, src, dst, kind,
                                                                         layout, features, dtype,
                                                                         ranks):
    x, bad_rank = failing(DeviceMesh("cpu", list(ranks)), layout, src, dtype, features)
    with dtorch.CommDebugMode() as mode:
        y = x.redistribute(placements=dst)
    assert mode.get_comm_counts() == {kind: 1}
    for rank in (0, 1, 2, 3):  # every rank's result is poisoned, none silently zero
        with pytest.raises(dtorch.RemoteError):
            y.to_local(rank)
    with pytest.raises(dtorch.RemoteError, match=f"rank {bad_rank}"):
        dtorch.synchronize()


def test_a_failure_reaches_the_other_mesh_through_send_recv(mesh1d):
    x, _ = failing(mesh1d, "even", [Shard(0)])
    moved = x.redistribute(device_mesh=DeviceMesh("cpu", [1, 2, 3, 0]))
    with pytest.raises(dtorch.RemoteError, match="source rank"):
        moved.to_local(0)  # rank 0 is coordinate 3 of the new mesh: it holds rank 3's shard
    with pytest.raises(dtorch.RemoteError):
        dtorch.synchronize()


@pytest.mark.parametrize("src, dst, kind", MOVES, ids=IDS)
@pytest.mark.parametrize("shape", [(4, SMALL), (4, LARGE), (6, 10), (3, 5, 7)],
                         ids=["small", "large", "uneven", "3d-uneven"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.int8, torch.complex64,
                                   torch.bfloat16], ids=["f32", "bool", "i8", "c64", "bf16"])
def test_a_change_of_placement_is_one_collective_per_rank(mesh1d, src, dst, kind, shape,
                                                          dtype):
    if dtype.is_complex and isinstance(src[0], Partial) and src[0].reduce_op != "sum":
        pytest.skip("complex numbers have no max/min")
    value = (torch.randn(shape) * 4).to(dtype) if dtype != torch.bool else \
        torch.rand(shape) > 0.5
    x = source(value, mesh1d, src)
    before = dist_calls()
    y = x.redistribute(placements=dst)
    after = dist_calls()
    assert {r: after[r] - before[r] for r in after} == {r: 1 for r in after}
    assert torch.equal(y.to_torch(), value)


@pytest.mark.parametrize("src, dst", [([R, Shard(0)], [R, R]), ([Shard(1), R], [Shard(0), R]),
                                      ([Partial(), Shard(1)], [R, Shard(1)])],
                         ids=["tp:S(0)->R", "dp:S(1)->S(0)", "dp:P->R"])
def test_a_move_on_one_mesh_dim_is_one_collective_per_rank_of_the_2d_mesh(mesh2d, src, dst):
    value = torch.randn(8, 1 << 14)
    if isinstance(src[0], Partial):
        x = dtorch.tensor(value, device_mesh=mesh2d, placements=[R, Shard(1)])
        x = dtorch.from_local([x.to_local(r) / 2 for r in range(4)], mesh2d, src,
                              shape=value.shape)
    else:
        x = dtorch.tensor(value, device_mesh=mesh2d, placements=src)
    before = dist_calls()
    y = x.redistribute(placements=dst)
    after = dist_calls()
    assert {r: after[r] - before[r] for r in after} == {r: 1 for r in after}
    assert torch.allclose(y.to_torch(), value, atol=1e-5)


def test_uint8_sums_wrap_as_torch_does_in_one_collective(mesh1d):
    """uint8 sums wrap modulo 256 as torch's do; the flag rides in the same all_reduce."""
    locals_ = [torch.full((4, 3), 200, dtype=torch.uint8)] * 4
    x = dtorch.from_local(locals_, mesh1d, [Partial()])
    before = dist_calls()
    y = x.redistribute(placements=[R])
    assert torch.equal(y.to_torch(), sum(locals_[1:], locals_[0]))
    assert {r: n - before[r] for r, n in dist_calls().items()} == {r: 1 for r in range(4)}
