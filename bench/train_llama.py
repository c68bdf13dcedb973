"""One training step of the small Llama on dp2 x tp2: dtorch vs PyTorch's own SPMD training
(``parallelize_module`` on the tp dim, ``DistributedDataParallel`` on the dp dim) on the same
ranks, model and data.

The model is ``bench/llama_vs_dtensor.py``'s (hidden 256, 8 heads, 4 kv heads, intermediate
688, 4 layers, vocab 1000, float32, ``torch.manual_seed(0)`` weights): dtorch runs
``dtorch.models.LlamaForCausalLM(config, device_mesh=mesh)`` on ``("dp", "tp")`` 2 x 2 wrapped
in ``dtorch.DistributedDataParallel(model, device_mesh=mesh["dp"])``; the reference runs the
lean ``torch.nn`` Llama of ``bench/lean_llama.py`` (the same model code) in 4 spawned torch
processes, parallelized by ``parallelize_module(model, mesh["tp"], plan)`` (the plan of
``llama_vs_dtensor.tp_plan``) and wrapped in ``torch.nn.parallel.DistributedDataParallel`` on
the dp group after ``_pre_dp_module_transform`` (PyTorch's documented way to compose TP with
DDP). A step: ``zero_grad``, the causal LM loss of 8 sequences (4 per dp rank; seq 128, quick
64), backward, ``AdamW(lr=1e-3, foreach=True)``. The ids are on the ranks already on both
sides. The losses of the warm-up steps are compared between the sides (the same values).

Rows: the step with DDP's default 25 MB buckets (target: at most 1.0x), and, dtorch against
itself (information), the step with 1 MB buckets whose all_reduces are posted as soon as a
bucket is full and waited for at the end of the backward (``StartReduce``/``FinishReduce``),
against the same buckets reduced in the instruction stream (``buckets.OVERLAP = False``):
what overlapping the gradient all_reduces with the rest of the backward gains on this machine.

    .venv/bin/python bench/train_llama.py [--quick]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (Row, dtorch_cluster, dtorch_rank_settings, dtorch_steps_turn, main,
                     take_turns)  # noqa: E402
from _reference import ReferenceRanks, serve_steps  # noqa: E402
from llama_vs_dtensor import CONFIG, hf_model, lean_model, tp_plan  # noqa: E402

WORLD, DP = 4, 2
BATCH = 8  # sequences per step, split over dp
STEPS, WARMUP = 4, 2
LR = 1e-3
TARGET = 1.0


def token_ids(seq: int):
    import torch
    return torch.randint(0, CONFIG["vocab_size"], (BATCH, seq),
                         generator=torch.Generator().manual_seed(seq))


def lm_loss(logits, ids):
    """The causal LM loss transformers' ``labels=ids`` computes: next-token cross entropy."""
    import torch.nn.functional as F
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


# reference: PyTorch SPMD ------------------------------------------------------------------------
def _torch_setup(seq: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
    mesh = init_device_mesh("cpu", (DP, WORLD // DP), mesh_dim_names=("dp", "tp"))
    model = lean_model().train()
    parallelize_module(model, mesh["tp"], tp_plan(model))
    _pre_dp_module_transform(model)
    dp_group = mesh["dp"].get_group()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=dp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    per = BATCH // DP
    me = mesh.get_coordinate()[0]
    ids = token_ids(seq)[me * per:(me + 1) * per]

    def step():
        opt.zero_grad()
        loss = lm_loss(ddp(ids), ids)
        loss.backward()
        opt.step()
        return loss

    losses = []
    for _ in range(WARMUP):  # the whole batch's loss: the mean over the dp ranks' means
        loss = step().detach()
        dist.all_reduce(loss, group=dp_group)
        losses.append(loss.item() / DP)
    return step, losses


def _rank_main(rank: int, commands, results) -> None:
    serve_steps(rank, commands, results, _torch_setup)


class TorchRanks(ReferenceRanks):
    def __init__(self, settings: dict):
        super().__init__(_rank_main, WORLD, settings, "train_llama")

    def time(self, seq: int, n: int) -> dict:
        return {"ref": self.ask(seq, n)}


# dtorch --------------------------------------------------------------------------------------------
def dtorch_setup(seq: int, mesh, bucket_cap_mb: float | None = None):
    import dtorch
    from dtorch import Replicate, Shard
    from dtorch.models import LlamaForCausalLM
    hf = hf_model()
    llama = LlamaForCausalLM(hf.config, device_mesh=mesh)
    llama.load_state_dict(hf.state_dict())
    model = dtorch.DistributedDataParallel(llama, device_mesh=mesh["dp"],
                                           bucket_cap_mb=bucket_cap_mb)
    opt = dtorch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    ids = dtorch.distribute_tensor(token_ids(seq), mesh, [Shard(0), Replicate()])

    def step():
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    return step


def in_the_stream(step):
    """``step`` with its buckets reduced in the instruction stream (``buckets.OVERLAP``)."""
    from dtorch.autograd import buckets

    def run():
        buckets.OVERLAP = False
        try:
            return step()
        finally:
            buckets.OVERLAP = True
    return run


def measure(seq: int, repeats: int) -> tuple[dict, dict]:
    import dtorch
    from dtorch import init_device_mesh
    with dtorch_cluster(WORLD), TorchRanks(dtorch_rank_settings()) as ref:
        mesh = init_device_mesh("cpu", (DP, WORLD // DP), mesh_dim_names=("dp", "tp"))
        want = ref.check(seq)  # the reference's warm-up losses
        default, small = dtorch_setup(seq, mesh), dtorch_setup(seq, mesh, bucket_cap_mb=1)
        got = [default().item() for _ in range(WARMUP)]
        for _ in range(WARMUP):
            small()
        assert all(abs(a - b) < 1e-4 for a, b in zip(got, want)), (got, want)
        counts = {}
        for name, step in (("dtorch", default), ("1 MB buckets", small)):
            with dtorch.CommDebugMode() as comm:
                step()
            counts[name] = comm.get_comm_counts()
        timings = take_turns(repeats, dtorch_steps_turn("dtorch", default, STEPS),
                             lambda: ref.time(seq, STEPS),
                             dtorch_steps_turn("overlapped", small, STEPS),
                             dtorch_steps_turn("in the stream", in_the_stream(small), STEPS))
    r = {k: v.median * 1e3 for k, v in timings.items()}
    print(f"[train_llama] seq {seq}: dtorch {r['dtorch']:.1f} ms vs torch {r['ref']:.1f} ms "
          f"({counts['dtorch']}); 1 MB buckets overlapped {r['overlapped']:.1f} ms, in the "
          f"stream {r['in the stream']:.1f} ms ({counts['1 MB buckets']}); warm-up losses "
          f"{got} vs {want}", flush=True)
    return timings, counts


def run(quick: bool = False) -> list[Row]:
    seq = 64 if quick else 128
    print(f"[train_llama] forward + backward + AdamW of the small Llama on dp2 x tp2, {BATCH} "
          f"sequences of {seq}: dtorch vs PyTorch SPMD (DDP + parallelize_module) ...",
          flush=True)
    t, counts = measure(seq, 2 if quick else 7)
    note = f"{STEPS} steps per repeat; dtorch's collectives per step {counts['dtorch']}"
    return [Row.timed(f"training step Llama dp2 x tp2 vs DDP + parallelize_module, seq {seq}",
                      t["dtorch"], t["ref"], TARGET, note),
            Row.timed(f"Llama dp2 x tp2 step, 1 MB buckets: overlapped vs in the stream, "
                      f"seq {seq}", t["overlapped"], t["in the stream"], None,
                      f"info, dtorch against itself; {counts['1 MB buckets']} per step")]


if __name__ == "__main__":
    main(run, __doc__)
