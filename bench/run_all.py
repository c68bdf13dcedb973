"""Run every dtorch benchmark side by side and print one table of ratios (information only).

- ``redistribute_vs_dtensor.py``: every transition of the placement table at 1 KB - 64 MB vs
  PyTorch's DTensor ``redistribute`` under SPMD (<= 1.0x from 1 MB), vs raw torch doing the
  whole move on preallocated buffers (<= 1.15x from 16 MB), the bare collective as the floor;
  the reference ranks get dtorch's rank allocator / huge-page / thread settings
- ``to_torch_vs_dask.py``: ``to_torch()`` vs a Dask gather of the same shards (<= 1.2x)
- ``startup.py``: cold start to the first value vs spawning 4 torch processes (<= 2x)
- ``op_overhead.py``: a 500-op chain and a TP MLP forward end to end vs PyTorch's DTensor
  under SPMD (chain <= 0.5x), a rank's CPU per op of the chain (<= 2x the op in plain torch),
  a repeated TP MLP forward replayed vs not, and what dtorch's controller alone spends per op
  (info, beside plain torch in one process)
- ``reads.py``: an empty ``synchronize()``, ``item()``, small and 1 MB ``to_torch()`` beside a
  bare Dask actor round trip and a raw loopback socket round trip (small reads <= 1.5 ms)
- ``tp_mlp_vs_dtensor.py``: a dtorch.nn TP MLP forward (ColumnParallelLinear ->
  RowParallelLinearWithReplicateOutput) at batch 1 and 64 vs PyTorch's DTensor with
  ``parallelize_module`` under SPMD, taking turns (<= 1.0x end to end)
- ``llama_vs_dtensor.py``: dtorch's LlamaForCausalLM forward on 4 ranks (tp4, pp2 x tp2) vs
  the same lean torch.nn Llama (``lean_llama.py``) under PyTorch's DTensor
  ``parallelize_module`` (<= 1.0x); transformers' own model under DTensor as an info row
- ``llama_cp.py``: ring and Ulysses context parallelism at sequence 4096 vs the whole sequence
  in one process on every core and vs tp4 on the same ranks (info; per-rank peak memory)
- ``controller_scaling.py``: controller time and bytes per op for a 500-op chain on 4, 64 and
  1,024 ranks in dry-run mode (flat within 1.5x); the messages and bytes the controller writes
  per flush at 4, 32, 64 and 1,024 ranks (flat within 2x from 32 up: the fan-out)
- ``redistribute_multinode.py``: placement changes on a mesh spanning two hosts (network
  namespaces on a bridge; root and ``ip`` needed, else no rows) vs the same inside one host
- ``optim_step.py``: ``dtorch.optim.AdamW``'s step on a TP MLP's shards vs torch's foreach
  AdamW on the same local shards in 4 plain processes (<= 1.2x)
- ``pipeline.py``: 2 pipeline stages (one rank each), 8 micro-batches vs the same work as one
  batch (speedup >= 1.6x, i.e. a ratio <= 0.625), and what each stage spent waiting; the
  same for a training step through ``dtorch.pipeline_backward`` (1F1B, speedup >= 1.5x)
- ``train_step.py``: one training step (forward, backward, AdamW) of an MLP 512-2048-512
  (and 2048-8192-2048 in full mode): ``DistributedDataParallel`` vs PyTorch's DDP, the TP MLP
  vs its ``parallelize_module``, ``fully_shard`` vs FSDP2's, on 4 plain processes (<= 1.0x),
  and the DDP step with one all_reduce per gradient instead of buckets
- ``train_llama.py``: one training step of the small Llama on dp2 x tp2 (dtorch's Llama in
  ``DistributedDataParallel`` over dp) vs the same lean torch.nn Llama under PyTorch's
  ``parallelize_module`` + DDP (<= 1.0x); 1 MB buckets overlapped vs in the stream (info)
- ``prediction.py``: the cost model's predicted time of seed 002's transitions and Partial ->
  Shard(0) at 1, 16 and 64 MB beside the time the ranks spent in them (within 1.5x either way
  from 16 MB), fitted by ``dtorch.measure_links`` on sizes up to 4 MiB per rank
- ``tls_cost.py``: the embedded cluster with its default mutual TLS vs ``security=False``: the
  500-op chain, an empty ``synchronize()``, ``to_torch()`` and a redistribute of 1 and 16 MB
  (info)

Each runs in its own child process (one process tree; every cluster and process group is torn
down before the next starts, and Dask's worker environment does not leak into the next one).
Nothing is asserted: the targets are printed next to the ratios. How each comparison is set
up: docs/benchmarks.md.

    make bench                                   # = .venv/bin/python bench/run_all.py
    .venv/bin/python bench/run_all.py --quick    # small sizes, a few minutes (run in the tests)
    .venv/bin/python bench/run_all.py --md bench/RESULTS.md   # also write a Markdown report
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import Row, command, machine, markdown, now, table  # noqa: E402

BENCHES = ("redistribute_vs_dtensor.py", "to_torch_vs_dask.py",
           "startup.py", "op_overhead.py", "reads.py", "tp_mlp_vs_dtensor.py", "pipeline.py",
           "llama_vs_dtensor.py", "llama_cp.py", "controller_scaling.py",
           "redistribute_multinode.py", "optim_step.py", "train_step.py", "train_llama.py",
           "prediction.py", "tls_cost.py")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats (~1 min)")
    ap.add_argument("--only", nargs="*", choices=BENCHES, help="run only these scripts")
    ap.add_argument("--md", metavar="PATH", help="write the results as Markdown to PATH")
    ap.add_argument("--json", metavar="PATH", help="write {bench: [rows]} as JSON to PATH")
    args = ap.parse_args()
    started, where, cmd = now(), machine(), command()
    print(f"{cmd}\n{started}\n{where}\n", flush=True)
    rows: list[Row] = []
    by_bench: dict[str, list] = {}
    failed = []
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or BENCHES:
            out = os.path.join(tmp, name + ".json")
            argv = [sys.executable, os.path.join(HERE, name), "--json", out]
            if args.quick:
                argv.append("--quick")
            t0 = time.perf_counter()
            rc = subprocess.call(argv)
            print(f"[{name}] exit {rc} after {time.perf_counter() - t0:.0f} s\n", flush=True)
            if rc != 0 or not os.path.exists(out):
                failed.append(name)
                continue
            with open(out) as f:
                by_bench[name] = json.load(f)
            rows += [Row(**r) for r in by_bench[name]]
    total = time.perf_counter() - t_all
    print(f"== all benchmarks ({'quick' if args.quick else 'full'} mode, {total:.0f} s) ==")
    print(table(rows) if rows else "(no results)")
    if failed:
        print(f"FAILED to run: {', '.join(failed)}")
    if args.md:
        with open(args.md, "w") as f:
            load = "%.2f %.2f %.2f" % os.getloadavg()
            f.write(f"# dtorch benchmark results\n\n- command: `{cmd}`\n- date: {started}\n"
                    f"- machine: {where}; load avg {load} at the end\n"
                    f"- wall time: {total:.0f} s\n\n{markdown(rows)}\n")
            if failed:
                f.write(f"\nFailed to run: {', '.join(failed)}\n")
        print(f"wrote {args.md}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(by_bench, f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
