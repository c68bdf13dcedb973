"""Pipeline parallelism: 8 micro-batches through 2 stages vs the same work as one batch.

A 2-rank cluster (one torch thread per rank on 2 cores, ``dtorch.runtime.cluster.local_threads``),
a pipeline mesh ``init_device_mesh("cpu", 2, mesh_dim_names=("pp",)).unbind("pp")``: stage 0 is
rank 0, stage 1 is rank 1. The model is ``LAYERS`` compute-bound ``dtorch.nn.Linear`` layers
(``WIDTH x WIDTH``, ReLU between), the first half built on stage 0's mesh and the second half
on stage 1's (``Graph.default_graph().device_mesh_guard``); ``forward`` moves the activations
with ``h.redistribute(device_mesh=stage)`` (one send/recv per micro-batch).

- reference: the whole batch of ``ROWS`` rows as one micro-batch: stage 1 can only start
  when stage 0 has finished, so the stages run one after the other.
- dtorch pipelined: the same rows as ``MICRO`` micro-batches issued back to back. The
  controller never waits, so stage 0 runs micro-batch k+1 while stage 1 runs micro-batch k.

A second pair of rows trains: forward and backward of the mean squared output, one batch's
``.backward()`` against ``dtorch.pipeline_backward`` over the micro-batches in 1F1B order (the
same gradients, checked; each stage's part is its own callable, so each stage gets its own
1F1B order; the ideal speedup is the same, the target 1.5x).

Both are timed on the controller (issue, then ``dtorch.synchronize()``), take turns one repeat
each, and report the median. Ideal speedup with 2 balanced stages: ``2 M / (M + 1)`` = 1.78x
for M = 8. Target: at least 1.6x (a ratio pipelined / one batch of at most 0.625).

What each stage spent waiting is measured, not inferred: the kernel's scheduler statistics of
each rank's interpreter thread over the timed window (``/proc/self/task/<tid>/schedstat``, read
on the rank; with one torch thread the matmuls run on that thread): seconds on a core
(*busy*), seconds runnable but without a core (*waiting for a core*: the other rank, or
anything else on the machine), and the rest of the wall time (*waiting for the other stage*:
blocked in the send/recv, or idle before its first or after its last micro-batch). The two
schedules' outputs are checked against each other (same values).

    .venv/bin/python bench/pipeline.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, main, median, summarize  # noqa: E402

WORLD = 2
MICRO = 8
TARGET_SPEEDUP = 1.6
TRAIN_TARGET_SPEEDUP = 1.5  # issue 20's target for a training step


def sizes(quick: bool) -> tuple[int, int, int, int]:
    """(width, layers, rows, repeats): about 0.1 s (quick) / 0.8 s of compute per forward of
    the whole batch on one core; micro-batches of 64 / 128 rows multiply as fast per row as
    the whole batch does (checked on this VM with one torch thread)."""
    return (1024, 8, 512, 3) if quick else (2048, 8, 1024, 5)


def _rank_thread_times() -> tuple[float, float]:
    """(seconds on a core, seconds runnable but waiting for a core) of this rank's interpreter
    thread (``dtorch-rank-*``), from the kernel's ``/proc/self/task/<tid>/schedstat``: run on
    a rank with ``client.run``. With one torch thread the matmuls run on that thread."""
    import threading
    thread, = [t for t in threading.enumerate() if t.name.startswith("dtorch-rank-")]
    with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
        on_cpu, runqueue = f.read().split()[:2]
    return int(on_cpu) / 1e9, int(runqueue) / 1e9


class Pipeline:
    """The model: LAYERS Linear(+ReLU) layers, half on each stage's 1-rank mesh."""

    def __init__(self, width: int, layers: int):
        import dtorch.nn as nn
        from dtorch import Graph, assign_layers_to_stages, init_device_mesh
        self.stages = init_device_mesh("cpu", WORLD, mesh_dim_names=("pp",)).unbind("pp")
        self.stage_of = assign_layers_to_stages(layers, len(self.stages))
        self.layers = []
        for i in range(layers):
            with Graph.default_graph().device_mesh_guard(self.stages[self.stage_of[i]]):
                self.layers.append(nn.ReplicateParallelLinear(width, width))

    def __call__(self, x):
        h = x
        for s in range(len(self.stages)):
            h = self.stage(s, h)
        return h

    def stage(self, s: int, h):
        """Stage ``s``'s part: its layers, then the activation sent on to the next stage
        (the send is the producer's: it goes out as soon as the activation is made)."""
        import torch
        for i, layer in enumerate(self.layers):
            if self.stage_of[i] == s:
                h = torch.relu(layer(h))
        if s + 1 < len(self.stages):
            h = h.redistribute(device_mesh=self.stages[s + 1])
        return h


def measure(quick: bool, train: bool = False) -> dict:
    """Inference (``train=False``: forwards only) or training (forward and backward of the
    mean squared output: one batch's ``.backward()`` vs ``dtorch.pipeline_backward`` over the
    micro-batches in 1F1B order; gradients compared, then cleared each repeat)."""
    import torch

    import dtorch
    from dtorch import Replicate
    from dtorch.runtime import session
    width, layers, rows, repeats = sizes(quick)
    dtorch.init(n_workers=WORLD)
    grad_was = torch.is_grad_enabled()
    torch.set_grad_enabled(train)  # inference: the stages' parameters record no graph
    try:
        c = session.get_controller()
        workers = [cluster_addr for _, cluster_addr in sorted(
            dtorch.cluster_info()["workers"].items())]

        def cpu() -> list[tuple[float, float]]:
            got = c.client.run(_rank_thread_times, workers=workers)
            return [got[w] for w in workers]

        dtorch.manual_seed(0)
        model = Pipeline(width, layers)
        stage0 = model.stages[0]
        torch.manual_seed(0)
        x = torch.randn(rows, width)
        whole = dtorch.distribute_tensor(x, stage0, [Replicate()])
        micro = [dtorch.distribute_tensor(part, stage0, [Replicate()])
                 for part in x.chunk(MICRO)]

        params = [p for layer in model.layers for p in layer.parameters()]

        def one_batch():
            if not train:
                return [model(whole)]
            model(whole).square().mean().backward()
            return [p.grad for p in params]

        def pipelined():
            if not train:
                return [model(m) for m in micro]
            stages = [lambda h, s=s: model.stage(s, h) for s in range(len(model.stages))]
            dtorch.pipeline_backward(stages, micro, lambda out, m: out.square().mean())
            return [p.grad for p in params]

        def cleared(fn):
            def run():
                for p in params:
                    p.grad = None
                return fn()
            return run

        one_batch, pipelined = cleared(one_batch), cleared(pipelined)

        def timed(fn):
            dtorch.synchronize()
            before = cpu()
            t0 = time.perf_counter()
            out = fn()
            dtorch.synchronize()
            wall = time.perf_counter() - t0
            after = cpu()
            del out
            return wall, [(b[0] - a[0], b[1] - a[1]) for a, b in zip(before, after)]

        # warm-up, and the two schedules give the same values
        if train:  # micro-batch losses are means over equal parts: the same gradients
            for ref_g, got_g in zip(one_batch(), pipelined()):
                assert torch.allclose(ref_g.to_torch(), got_g.to_torch(), atol=1e-5)
        else:
            ref_out = one_batch()[0].to_torch()
            got_out = torch.cat([o.to_torch() for o in pipelined()])
            assert torch.allclose(ref_out, got_out, atol=1e-4), (ref_out - got_out).abs().max()
        runs: dict[str, list] = {"one": [], "pipe": []}
        for _ in range(repeats):
            runs["one"].append(timed(one_batch))
            runs["pipe"].append(timed(pipelined))
    finally:
        torch.set_grad_enabled(grad_was)
        dtorch.shutdown()
    out = {}
    for key, rs in runs.items():
        wall = summarize([w for w, _ in rs])
        # each rank's share of the window on a core and waiting for a core, median of repeats
        shares = [(median([t[r][0] / w for w, t in rs]), median([t[r][1] / w for w, t in rs]))
                  for r in range(WORLD)]
        out[key] = (wall, shares)
    out["sizes"] = (width, layers, rows)
    return out


def run(quick: bool = False) -> list[Row]:
    return [one_run(quick, train=False), one_run(quick, train=True)]


def one_run(quick: bool, train: bool) -> Row:
    width, layers, rows, _ = sizes(quick)
    what = "training (forward + backward, 1F1B)" if train else "inference"
    print(f"[pipeline] {what}: 2 stages x 1 rank, {layers} Linear({width}, {width}) layers, "
          f"{rows} rows: one batch vs {MICRO} micro-batches, taking turns ...", flush=True)
    got = measure(quick, train)
    (one_timing, one_t), (pipe_timing, pipe_t) = got["one"], got["pipe"]
    one, pipe = one_timing.median, pipe_timing.median
    speedup = one / pipe
    ideal = 2 * MICRO / (MICRO + 1)
    for name, wall, shares in (("one batch", one, one_t),
                               (f"{MICRO} micro-batches", pipe, pipe_t)):
        parts = "; ".join(
            f"stage {r}: busy {busy * wall * 1e3:.0f} ms, waiting for the other stage "
            f"{(1 - busy - runq) * wall * 1e3:.0f} ms, for a core {runq * wall * 1e3:.0f} ms"
            for r, (busy, runq) in enumerate(shares))
        print(f"[pipeline] {name}: {wall * 1e3:.1f} ms; {parts}", flush=True)
    target = TRAIN_TARGET_SPEEDUP if train else TARGET_SPEEDUP
    print(f"[pipeline] speedup {speedup:.2f}x (ideal {ideal:.2f}x, target >= {target}x)",
          flush=True)
    wait = "; ".join(f"stage {r} waits {1 - b - q:.0%} for the other stage, {q:.0%} for a core "
                     f"(one batch: {1 - b1 - q1:.0%}, {q1:.0%})"
                     for r, ((b, q), (b1, q1)) in enumerate(zip(pipe_t, one_t)))
    name = "training step" if train else "forward"
    return Row.timed(f"pipeline {name}: {MICRO} micro-batches vs one batch (2 stages)",
                     pipe_timing, one_timing, 1 / target,
                     f"speedup {speedup:.2f}x, target >= {target}x, ideal {ideal:.2f}x; {wait}")


if __name__ == "__main__":
    main(run, __doc__)
