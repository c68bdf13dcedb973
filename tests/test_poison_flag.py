"""The poison flag rides inside each collective's payload: a failure on one rank poisons its
peers' results through all_gather, all_to_all, all_reduce, reduce_scatter and send_recv, and a
change of placement is one torch.distributed collective on each rank (the workers' own counts,
``rank_stats()['dist_calls']``), on the real 4-rank cluster.

Chunks of ``EMBED_MAX`` bytes per rank (64 KiB) or more keep their zero-copy layouts for all_gather and
all_to_all and run the flag as a separate all_reduce beside the collective instead: the rows
below say so."""

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import DeviceMesh, Partial, Replicate, Shard
from dtorch.runtime.collectives import EMBED_MAX

R = Replicate()
SMALL, LARGE = 8, EMBED_MAX // 4 * 5  # features: a few bytes per rank, or 5 x EMBED_MAX
MOVES = [  # (source placements, target placements, collective)
    ([Shard(0)], [R], "all_gather"),
    ([Shard(0)], [Shard(1)], "all_to_all"),
    ([Partial()], [R], "all_reduce"),
    ([Partial()], [Shard(0)], "reduce_scatter"),
]


def failing_on_rank_3(mesh, features: int, partial: bool):
    """A DTensor whose computation fails on rank 3 only (its embedding index is out of
    range): ``[4, features]`` Shard(0), or its ``Partial('sum')`` over the rows ``[features]``."""
    idx = dtorch.tensor(torch.tensor([0, 1, 2, 99]), device_mesh=mesh, placements=[Shard(0)])
    emb = dtorch.tensor(torch.randn(10, features), device_mesh=mesh, placements=[R])
    out = F.embedding(idx, emb)  # one row per rank
    return out.sum(0) if partial else out


def dist_calls() -> dict:
    dtorch.synchronize()
    return {s["rank"]: s["dist_calls"] for s in dtorch.rank_stats()}


@pytest.mark.parametrize("src, dst, kind", MOVES, ids=[m[2] for m in MOVES])
@pytest.mark.parametrize("features", [SMALL, LARGE], ids=["small", "large"])
def test_a_failure_on_one_rank_poisons_every_rank_through_the_collective(mesh1d, src, dst,
                                                                         kind, features):
    x = failing_on_rank_3(mesh1d, features, partial=src == [Partial()])
    assert x.placements == tuple(src)
    with dtorch.CommDebugMode() as mode:
        y = x.redistribute(placements=dst)
    assert mode.get_comm_counts() == {kind: 1}
    for rank in (0, 1, 2, 3):  # every rank's result is poisoned, none silently zero
        with pytest.raises(dtorch.RemoteError):
            y.to_local(rank)
    with pytest.raises(dtorch.RemoteError, match="rank 3"):
        dtorch.synchronize()


def test_a_failure_reaches_the_other_mesh_through_send_recv(mesh1d):
    x = failing_on_rank_3(mesh1d, SMALL, partial=False)
    moved = x.redistribute(device_mesh=DeviceMesh("cpu", [1, 2, 3, 0]))
    with pytest.raises(dtorch.RemoteError, match="source rank"):
        moved.to_local(0)  # rank 0 is coordinate 3 of the new mesh: it holds rank 3's shard
    with pytest.raises(dtorch.RemoteError):
        dtorch.synchronize()


@pytest.mark.parametrize("src, dst, kind", MOVES, ids=[m[2] for m in MOVES])
@pytest.mark.parametrize("features", [SMALL, LARGE], ids=["small", "large"])
def test_a_change_of_placement_is_one_collective_per_rank(mesh1d, src, dst, kind, features):
    value = torch.randn(4, features)
    if src == [Partial()]:
        x = dtorch.from_local([value / 4] * 4, mesh1d, [Partial()])
    else:
        x = dtorch.tensor(value, device_mesh=mesh1d, placements=src)
    before = dist_calls()
    y = x.redistribute(placements=dst)
    after = dist_calls()
    beside = features == LARGE and kind in ("all_gather", "all_to_all")  # the flag runs beside
    assert {r: after[r] - before[r] for r in after} == {r: 2 if beside else 1 for r in after}
    assert torch.allclose(y.to_torch(), value, atol=1e-5)
