"""A plain PyTorch SPMD program (4 processes, gloo, PyTorch's own DTensor on a 2x2 mesh) that
saves or loads a torch.distributed.checkpoint directory: the other side of dtorch's
checkpoint interop tests. ``spec.pt`` holds ``{"tensors": {key: (full, placements)},
"objects": {key: value}}`` with placements as ``("shard", d)`` / ``("replicate",)``.

    python tests/spmd_checkpoint.py save DIR spec.pt   # writes DIR from the full values
    python tests/spmd_checkpoint.py load DIR spec.pt   # loads DIR, exits 1 on any difference
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def _placements(spec):
    from torch.distributed.tensor import Replicate, Shard
    return [Shard(p[1]) if p[0] == "shard" else Replicate() for p in spec]


def _rank(rank: int, port: int, action: str, path: str, spec_path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    spec = torch.load(spec_path, weights_only=False)
    tensors = {k: distribute_tensor(full if action == "save" else torch.zeros_like(full), mesh,
                                    _placements(placements))
               for k, (full, placements) in spec["tensors"].items()}
    state = {"model": tensors, **{k: (v if action == "save" else None)
                                  for k, v in spec["objects"].items()}}
    if action == "save":
        dcp.save(state, checkpoint_id=path)
    else:
        dcp.load(state, checkpoint_id=path)
        for k, (full, _) in spec["tensors"].items():
            got = state["model"][k].full_tensor()
            if not torch.equal(got, full):
                raise SystemExit(f"rank {rank}: {k} differs: {got} vs {full}")
        for k, v in spec["objects"].items():
            if state[k] != v:
                raise SystemExit(f"rank {rank}: {k} is {state[k]!r}, saved {v!r}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    action, path, spec_path = sys.argv[1:4]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(port, action, path, spec_path), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
