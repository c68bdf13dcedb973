"""The poison flag rides inside each collective's payload: a failure on one rank poisons its
peers' results through all_gather, all_to_all, all_reduce, reduce_scatter and send_recv, and a
change of placement is one torch.distributed collective on each rank (the workers' own counts,
``rank_stats()['dist_calls']``), at every size and dtype, on the real 4-rank cluster."""

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import DeviceMesh, Partial, Replicate, Shard
from test_ops_support import make

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


def random_values(shape, dtype, generator) -> torch.Tensor:
    """Small integer values in ``dtype`` (random bools for bool): sums of four of them are
    exact in every dtype tested, so a reduction can be compared exactly."""
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    real = torch.randint(-8, 9, shape, generator=generator)
    if dtype.is_complex:
        return torch.complex(real.float(), torch.randint(-8, 9, shape, generator=generator)
                             .float()).to(dtype)
    return real.to(dtype)


REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def source(shape, dtype, mesh, src, seed: int = 0):
    """``(DTensor laid out as src, its global value)``. A Partial gets random shares on every
    rank, so a reduction that returned one rank's share would be caught."""
    g = torch.Generator().manual_seed(seed)
    if isinstance(src[0], Partial):
        shares = [random_values(shape, dtype, g) for _ in range(mesh.size())]
        value = shares[0]
        for share in shares[1:]:
            value = REDUCE[src[0].reduce_op](value, share)
        return dtorch.from_local(shares, mesh, src), value
    value = random_values(shape, dtype, g)
    return dtorch.tensor(value, device_mesh=mesh, placements=src), value


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


DTYPES = {"f32": torch.float32, "bool": torch.bool, "i8": torch.int8, "i16": torch.int16,
          "c64": torch.complex64, "bf16": torch.bfloat16}  # gloo carries int16 as int32
SHAPES = {"small": (4, SMALL), "large": (4, LARGE), "uneven": (6, 10), "3d-uneven": (3, 5, 7)}
ONE_COLLECTIVE_CASES = [  # complex numbers have no max/min: those moves are not cases
    pytest.param(move, shape, dtype, id=f"{IDS[i]}-{sname}-{dname}")
    for i, move in enumerate(MOVES) for sname, shape in SHAPES.items()
    for dname, dtype in DTYPES.items()
    if not (dtype.is_complex and isinstance(move[0][0], Partial) and
            move[0][0].reduce_op != "sum")]


@pytest.mark.parametrize("move, shape, dtype", ONE_COLLECTIVE_CASES)
def test_a_change_of_placement_is_one_collective_per_rank(mesh1d, move, shape, dtype):
    src, dst, kind = move
    x, value = source(shape, dtype, mesh1d, src)
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
    x = make(value, mesh2d, src)  # a Partial: random shares on every rank
    before = dist_calls()
    y = x.redistribute(placements=dst)
    after = dist_calls()
    assert {r: after[r] - before[r] for r in after} == {r: 1 for r in after}
    assert torch.allclose(y.to_torch(), value, atol=1e-5)


def test_uint8_sums_wrap_as_torch_does_in_one_collective(mesh1d):
    """uint8 sums wrap modulo 256 as torch's do; the flag rides in the same all_reduce."""
    locals_ = [torch.full((4, 3), v, dtype=torch.uint8) for v in (200, 100, 37, 255)]
    x = dtorch.from_local(locals_, mesh1d, [Partial()])
    before = dist_calls()
    y = x.redistribute(placements=[R])
    assert torch.equal(y.to_torch(), torch.full((4, 3), (200 + 100 + 37 + 255) % 256,
                                                dtype=torch.uint8))
    assert {r: n - before[r] for r, n in dist_calls().items()} == {r: 1 for r in range(4)}
