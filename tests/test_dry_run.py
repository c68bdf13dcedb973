"""Dry-run mode and per-rank batches: the real controller, planner and rules with no workers
(``dtorch.init(dry_run=True)``); what each rank would receive, measured on meshes up to 1,024
ranks. A rank outside a sub-mesh receives none of its instructions, and what a rank receives per
op does not grow with the world size."""

import gc

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, Replicate, Shard, init_device_mesh
from dtorch.runtime.dry_run import DryRunError


def chain(mesh, n_ops: int = 100):
    x = dtorch.ones(mesh.size() * 4, 8, device_mesh=mesh, placements=[Shard(0)])
    w = dtorch.ones(8, 8, device_mesh=mesh, placements=[Replicate()])
    for i in range(n_ops // 4):
        x = torch.relu(x @ w * 0.5 + 1.0)
    return x.redistribute(placements=[Replicate()])


def traffic_per_op(world: int, n_ops: int = 100) -> dict:
    """Per op, after a first chain sent the mesh, rank tuple and plans once (definitions)."""
    gc.collect()  # an earlier test's handles held by a caught exception's frames
    dtorch.init(n_workers=world, dry_run=True)
    mesh = init_device_mesh("cpu", world)
    chain(mesh, n_ops)
    dtorch.synchronize()
    before = dtorch.rank_stats()
    out = chain(mesh, n_ops)
    dtorch.synchronize()
    after = dtorch.rank_stats()
    del out
    dtorch.shutdown()
    return {"bytes": max(a["bytes"] - b["bytes"] for a, b in zip(after, before)) / n_ops,
            "instructions": after[-1]["instructions"] - before[-1]["instructions"]}


def test_bytes_a_rank_receives_per_op_do_not_grow_with_the_world(other_cluster):
    small, big = traffic_per_op(4), traffic_per_op(1024)
    assert small["instructions"] == big["instructions"]
    assert big["bytes"] < 1.2 * small["bytes"], (small, big)


def test_a_rank_outside_a_sub_mesh_receives_none_of_its_work(other_cluster):
    other_cluster(n_workers=8, dry_run=True)
    dtorch.synchronize()
    before = dtorch.rank_stats()
    stage = DeviceMesh("cpu", [2, 3])
    x = dtorch.ones(4, 4, device_mesh=stage, placements=[Shard(0)])
    y = (x + 1).redistribute(placements=[Replicate()]).sum()
    dtorch.synchronize()
    after = dtorch.rank_stats()
    got = {a["rank"]: a["instructions"] - b["instructions"] for a, b in zip(after, before)}
    assert got[2] == got[3] > 0
    assert all(got[r] <= 1 for r in (0, 1, 4, 5, 6, 7)), got  # at most the group setup
    with pytest.raises(DryRunError, match="dry-run mode"):
        y.to_torch()


def test_sub_mesh_work_on_the_real_cluster_reaches_only_its_ranks(live):
    """The workers' own instruction counts: ranks 0 and 1 run none of ranks 2-3's ops."""
    stage = DeviceMesh("cpu", [2, 3])
    warm = dtorch.ones(2, device_mesh=stage) + 1
    dtorch.synchronize()
    before = {s["rank"]: s["instructions"] for s in dtorch.rank_stats()}
    x = dtorch.ones(4, device_mesh=stage)
    for _ in range(50):
        x = x * 1.5
    assert torch.equal(x.to_torch(), torch.full((4,), 1.5 ** 50))
    after = {s["rank"]: s["instructions"] for s in dtorch.rank_stats()}
    ran = {r: after[r] - before[r] for r in after}
    assert ran[2] >= 51 and ran[3] >= 51
    assert ran[0] <= 3 and ran[1] <= 3, ran  # frees and the stats' own sync only
    del warm
