"""The dtorch demo: seed 004's example, seed 002's walk-through and a seed 003 tensor-parallel
MLP on the embedded cluster.

Run with `make demo` (or `python examples/demo.py`). One Python thread drives 4 worker
processes; no torchrun, no process groups in this file.
"""

import torch

import dtorch
from dtorch import Partial, Replicate, Shard, init_device_mesh


def show_counts(label, mode):
    counts = mode.get_comm_counts()
    text = ", ".join(f"{k} x{v}" for k, v in counts.items()) or "nothing moved"
    print(f"  {label:<24} {text}")


def seed_004_example():
    print("== Seed 004: shard a tensor across two ranks, then print it ==")
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    dtorch.manual_seed(0)
    x = dtorch.rand((4, 3), device_mesh=mesh, placements=[dtorch.Shard(0)])
    print(f"{x=}")
    print("  local shapes:", x.local_shapes())


def seed_002_walkthrough():
    print("\n== Seed 002: mesh, placements, and the collective each change implies ==")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    print("mesh:", mesh)
    print("mesh shape:", mesh.shape, "dim names:", mesh.mesh_dim_names)
    big = torch.arange(16.).reshape(4, 4)
    d = dtorch.distribute_tensor(big, mesh, [Shard(0), Shard(1)])
    for rank in range(4):
        local = d.to_local(rank)
        print(f"rank {rank}: global {tuple(d.shape)} local {tuple(local.shape)} "
              f"{local.flatten().tolist()}")
    print("placements:", d.placements)

    print("\nFour transitions on a 1-D mesh of four:")
    line = init_device_mesh("cpu", 4)
    sharded = dtorch.distribute_tensor(big, line, [Shard(0)])
    with dtorch.CommDebugMode() as m1:
        r = sharded.redistribute(line, [Replicate()])
    show_counts("Shard(0) -> Replicate", m1)
    with dtorch.CommDebugMode() as m2:
        s = r.redistribute(line, [Shard(0)])
    show_counts("Replicate -> Shard(0)", m2)
    with dtorch.CommDebugMode() as m3:
        s1 = s.redistribute(line, [Shard(1)])
    show_counts("Shard(0) -> Shard(1)", m3)
    partial = dtorch.from_local([big / 4] * 4, line, [Partial()])
    with dtorch.CommDebugMode() as m4:
        full = partial.redistribute(line, [Replicate()])
    show_counts("Partial -> Replicate", m4)
    assert torch.equal(s1.to_torch(), big) and torch.equal(full.to_torch(), big)
    print("  Sharding a replicated tensor is free. Replicating a sharded one is an all-gather.")

    print("\nMatmul (seed 002): placements follow from the inputs, reductions are owed")
    xs = dtorch.distribute_tensor(big, line, [Shard(1)])
    ws = dtorch.distribute_tensor(torch.ones(4, 4), line, [Shard(0)])
    with dtorch.CommDebugMode() as m6:
        out = xs @ ws
    show_counts("Shard(1) @ Shard(0)", m6)
    print(f"  {'':<24} -> placements {out.placements}")
    with dtorch.CommDebugMode() as m7:
        full = out.full_tensor()
    show_counts("full_tensor of the matmul", m7)
    print("  result row 0:", full[0].tolist())
    xr = dtorch.distribute_tensor(big, line, [Replicate()])
    wc = dtorch.distribute_tensor(torch.ones(4, 4), line, [Shard(1)])
    with dtorch.CommDebugMode() as m8:
        y = xr @ wc
    show_counts("Replicate @ Shard(1)", m8)
    print(f"  {'':<24} -> placements {y.placements}")
    try:
        torch.softmax(xs, dim=1)
    except dtorch.PlacementError as err:
        print("  softmax over a sharded dim refuses to communicate behind your back:")
        print("    " + str(err).replace("\n", "\n    "))

    print("\nUneven shards (seed 001): [4, 11] with Shard(1) on 4 ranks")
    x = dtorch.randn(4, 11, device_mesh=line, placements=[Shard(1)])
    print("  local shapes:", x.local_shapes())
    with dtorch.CommDebugMode() as m5:
        x_r = x.redistribute(line, [Replicate()])
    show_counts("Shard(1) -> Replicate", m5)
    print("  rank 3 now holds", tuple(x_r.to_local(3).shape))


def seed_003_modules():
    print("\n== Seed 003: a tensor-parallel MLP with dtorch.nn, torch.nn's weights loaded ==")
    import dtorch.nn as nn
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 8))
    mlp = nn.Sequential(nn.ColumnParallelLinear(8, 16, device_mesh=mesh), nn.SiLU(),
                        nn.RowParallelLinearWithReplicateOutput(16, 8, device_mesh=mesh))
    mlp.load_state_dict(ref.state_dict())  # the same keys: 0.weight, 0.bias, 2.weight, 2.bias
    print("  weight placements:", mlp[0].weight.placements, mlp[2].weight.placements)
    x = torch.randn(4, 8)
    with dtorch.CommDebugMode() as m:
        y = mlp(dtorch.distribute_tensor(x, mesh, [Shard(0), Replicate()]))
    show_counts("forward (dp x tp)", m)
    err = (y.to_torch() - ref(x)).abs().max().item()
    print(f"  max difference from torch.nn: {err:.1e}")


def main():
    dtorch.init()
    print("cluster:", {k: v for k, v in dtorch.cluster_info().items()
                       if k in ("ranks", "backend", "workers")})
    seed_004_example()
    seed_002_walkthrough()
    seed_003_modules()
    dtorch.shutdown()


if __name__ == "__main__":
    main()
