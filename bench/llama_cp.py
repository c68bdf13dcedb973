"""Context parallelism on the Llama of ``llama_vs_dtensor.py``: ring and Ulysses vs two no-CP
baselines, the whole sequence on one process and tp4 on the same 4 ranks.

At sequence 4096 (``--quick``: 1024), the same Llama with 2 layers, batch 1, float32. dtorch
only on the CP side: PyTorch's ``context_parallel`` needs CUDA SDPA backends. dtorch runs
``dtorch.models.LlamaForCausalLM`` on three meshes of its 4 ranks: ``("ring_cp",)`` 4,
``("ulysses_cp",)`` 4 and ``("tp",)`` 4, each timed as one ``model(ids)`` +
``dtorch.synchronize()`` (the logits on the ranks).

Rows (information only, no target; seconds per forward):

- **ring_cp 4 / ulysses_cp 4 vs the whole sequence on one process**. Reference: plain torch,
  no dtorch, in one spawned process using every core (``torch.set_num_threads(os.cpu_count())``,
  otherwise dtorch's rank-process allocator / huge-page settings, checked by
  ``_reference.ReferenceRanks``), running the lean ``torch.nn`` Llama of ``bench/lean_llama.py``
  (``dtorch/models/llama.py`` op for op) on the whole sequence, one forward. What a user
  without CP would run on this machine; dtorch's 4 ranks sit idle during its turn. A
  plain process rather than a 1-rank dtorch mesh, so the baseline carries no framework cost.
- **ring_cp 4 / ulysses_cp 4 vs tp4 on the same 4 ranks**. Reference: dtorch's tp4 (heads,
  intermediate and vocabulary split over the 4 ranks, the sequence whole on each), the other
  way to use the same ranks without CP.
- **tp4 vs the whole sequence on one process**: the same two baselines against each other.

Also per mesh (notes and printed): each rank process's peak RSS during one forward (Linux
``/proc/self/clear_refs`` = 5 resets ``VmHWM`` after a ``gc.collect`` + ``malloc_trim``, the
peak read after the forward; "added" = peak - RSS at the reset; the same in the one process)
and ``rank_stats()["composite_peak_bytes"]`` (the K/V blocks a rank held at once in the ring);
and where a CP attention's time goes: one layer's attention kernel on one thread (fused causal
SDPA over the whole sequence, a Ulysses rank's heads, the ring's first and last ranks' blocks).

The logits of every side (dtorch's three meshes, the one process) are checked against
transformers' (1e-4) before timing. The one process and dtorch take turns, one timed repeat each; medians
and interquartile ranges.

    .venv/bin/python bench/llama_cp.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (Row, dtorch_cluster, dtorch_rank_settings, fmt_s, main, rank_threads,
                     take_turns)  # noqa: E402
from _reference import ReferenceRanks, serve_timings  # noqa: E402
from llama_vs_dtensor import (CONFIG, WORLD, dtorch_model, hf_model, lean_model,  # noqa: E402
                              token_ids)

CP_LAYERS, CP_SEQ, QUICK_SEQ = 2, 4096, 1024
MESHES = {"ring_cp 4": ("ring_cp",), "ulysses_cp 4": ("ulysses_cp",), "tp4": ("tp",)}
CP = ("ring_cp 4", "ulysses_cp 4")
ONE = f"the whole sequence on one process ({rank_threads(1)} threads)"
TAG = "[llama_cp]"


# peak memory, inside a rank process or the one process -------------------------------------------
def _reset_peak() -> int:
    """Free what can be freed, reset VmHWM; returns VmRSS (bytes)."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _vm()["VmRSS"]


def _vm() -> dict:
    """VmRSS and VmHWM in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _peak_of(forward) -> tuple[int, int]:
    """(peak RSS during ``forward()``, peak - RSS at the reset), bytes, in this process."""
    base = _reset_peak()
    forward()
    peak = _vm()["VmHWM"]
    return peak, peak - base


def rank_peaks(forward) -> list[tuple[int, int]]:
    """Per dtorch rank (peak RSS during ``forward()``, peak - RSS at the reset), bytes."""
    import dtorch
    from dtorch.runtime import session
    client = session.get_controller().client
    rank_of = {addr: r for r, addr in dtorch.cluster_info()["workers"].items()}
    dtorch.synchronize()
    base = client.run(_reset_peak)
    forward()
    dtorch.synchronize()
    peak = client.run(_vm)
    return [(peak[a]["VmHWM"], peak[a]["VmHWM"] - base[a])
            for a in sorted(peak, key=lambda a: rank_of[a])]


# the one-process baseline: plain torch, the lean Llama, every core --------------------------------
def _one_process_main(rank: int, commands, results) -> None:
    """The one reference process: reads the sequence length (its first command), puts its
    logits and its peak memory of one forward, then times one forward per command."""
    import torch
    seq = commands[rank].get()
    model = lean_model(num_hidden_layers=CP_LAYERS)
    ids = token_ids(1, seq)
    with torch.no_grad():
        results.put(model(ids))
        results.put(_peak_of(lambda: model(ids)))

        def timed(_):
            t0 = time.perf_counter()
            model(ids)
            return time.perf_counter() - t0
        serve_timings(rank, commands, results, timed)


class OneProcess(ReferenceRanks):
    """The one-process baseline: spawned with dtorch's rank settings but every core's threads
    (the check holds it to exactly that); ``logits`` and ``peak`` of its first forwards."""

    def __init__(self, settings: dict, seq: int):
        every_core = {**settings, "(torch) threads per rank": str(rank_threads(1))}
        super().__init__(_one_process_main, 1, every_core, "llama_cp, one process")
        self.commands[0].put(seq)
        self.logits, self.peak = self.get(), self.get()

    def time(self) -> dict:
        return {"one": self.ask("forward")}


# dtorch --------------------------------------------------------------------------------------------
def dtorch_forward(model, ids) -> float:
    """Seconds of one ``model(ids)`` + ``synchronize()`` from a synchronized start."""
    import dtorch
    dtorch.synchronize()
    t0 = time.perf_counter()
    logits = model(ids).logits
    dtorch.synchronize()
    took = time.perf_counter() - t0
    del logits
    return took


def check_logits(got: dict, want) -> dict:
    """``{label: max |err|}`` of each ``got`` logits against ``want``; raises above 1e-4."""
    errs = {}
    for label, value in got.items():
        errs[label] = (value - want).abs().max().item()
        assert errs[label] < 1e-4, (label, errs[label])
    return errs


def measure(seq: int, repeats: int) -> dict:
    """``{label: {"s": Timing, "peak": [(peak, added) per rank], ...}}`` for the three dtorch
    meshes and ``ONE``."""
    import torch

    import dtorch
    hf = hf_model(num_hidden_layers=CP_LAYERS)
    ids = token_ids(1, seq)
    with torch.no_grad():
        want = hf(ids).logits
    # inference everywhere (dtorch's parameters require grad: no graph is recorded here)
    with dtorch_cluster(WORLD), OneProcess(dtorch_rank_settings(), seq) as one, torch.no_grad():
        models = {k: dtorch_model((WORLD,), names, hf) for k, names in MESHES.items()}
        errs = check_logits({**{k: m(ids).logits.to_torch() for k, m in models.items()},
                             ONE: one.logits}, want)
        out = {k: {"peak": rank_peaks(lambda: m(ids)), "err": errs[k],
                   "composite": [s["composite_peak_bytes"] for s in dtorch.rank_stats()]}
               for k, m in models.items()}
        out[ONE] = {"peak": [one.peak], "err": errs[ONE], "composite": [0]}
        timings = take_turns(repeats, one.time,
                             lambda: {k: dtorch_forward(m, ids) for k, m in models.items()})
    out[ONE]["s"] = timings.pop("one")
    for k, t in timings.items():
        out[k]["s"] = t
    for label, r in out.items():
        mb = [f"{p / 2**20:.0f} (+{a / 2**20:.0f})" for p, a in r["peak"]]
        print(f"{TAG} seq {seq}, {label}: {fmt_s(r['s'].median).strip()} per forward, peak RSS "
              f"per process MB (added by the forward): {', '.join(mb)}; ring K/V peak per rank "
              f"{[c >> 10 for c in r['composite']]} KB; max |err| {r['err']:.1e}", flush=True)
    return out


def attention_parts(seq: int) -> dict:
    """Where a CP attention's time goes, one layer's kernel on this process (1 thread): the
    fused causal SDPA over the whole sequence, a Ulysses rank's (a quarter of the heads) and
    the ring's ``ring_step`` blocks on rank 0 (1 block, the rest skipped as future) and on the
    last rank (all WORLD blocks). Seconds, best of 3."""
    import torch
    import torch.nn.functional as F

    from dtorch.ops.cp_attention import ring_finish, ring_init, ring_step
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    heads, kv = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    e, n = CONFIG["hidden_size"] // heads, WORLD
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, seq, e, generator=g) for h in (heads, kv, kv))
    block = seq // n

    def ring(rank):
        qq = q[:, :, rank * block:(rank + 1) * block]
        acc = ring_init(qq, v)
        for j in range(n):
            sl = slice(j * block, (j + 1) * block)
            acc = ring_step(qq, k[:, :, sl], v[:, :, sl], *acc, [(rank * block, block)],
                            [(j * block, block)], None, None, True, e ** -0.5)
        return ring_finish(*acc, q.dtype)

    def best(fn):
        fn()
        return min(_timed(fn) for _ in range(3))
    try:
        return {"whole": best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                     enable_gqa=True)),
                "ulysses": best(lambda: F.scaled_dot_product_attention(
                    q[:, :heads // n], k[:, :kv // n], v[:, :kv // n], is_causal=True,
                    enable_gqa=True)),
                "ring first": best(lambda: ring(0)), "ring last": best(lambda: ring(n - 1))}
    finally:
        torch.set_num_threads(threads)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _mb(x: int) -> str:
    return f"{x / 2**20:.0f} MB"


def _memory(r: dict) -> str:
    """Peak RSS per process and what one forward added, the largest over the processes."""
    return (f"{_mb(max(p for p, _ in r['peak']))} (+{_mb(max(a for _, a in r['peak']))} in the "
            f"forward)")


def rows_of(cp: dict, parts: dict, seq: int) -> list[Row]:
    """Each CP mesh vs both baselines, then tp4 vs the one process (see the module doc)."""
    ms = lambda s: fmt_s(s).strip()  # noqa: E731
    rows = []
    for label in CP:
        r = cp[label]
        kernel = parts["ring last" if label.startswith("ring") else "ulysses"]
        detail = (f"slowest rank's attention kernel {ms(kernel)} vs {ms(parts['whole'])} whole "
                  f"(1 thread); peak RSS/process {_memory(r)}")
        if label.startswith("ring"):
            detail += f"; ring K/V peak/rank {max(r['composite']) >> 10} KB"
        rows.append(Row.timed(f"Llama CP seq {seq}, {label} vs {ONE}", r["s"], cp[ONE]["s"],
                              None, f"info; plain torch lean Llama, 1 process: {_memory(cp[ONE])}"
                                    f"; {detail}"))
        rows.append(Row.timed(f"Llama CP seq {seq}, {label} vs tp4 (dtorch, same 4 ranks)",
                              r["s"], cp["tp4"]["s"], None,
                              f"info; tp4 {_memory(cp['tp4'])}"))
    rows.append(Row.timed(f"Llama seq {seq}, tp4 (dtorch, no CP) vs {ONE}", cp["tp4"]["s"],
                          cp[ONE]["s"], None, "info: the two no-CP baselines"))
    return rows


def run(quick: bool = False) -> list[Row]:
    seq = QUICK_SEQ if quick else CP_SEQ
    print(f"{TAG} CP: {CP_LAYERS} layers, batch 1, sequence {seq}: ring, Ulysses, tp4 on "
          f"{WORLD} ranks and {ONE} ...", flush=True)
    cp = measure(seq, 3 if quick else 5)
    parts = attention_parts(seq)
    print(f"{TAG} one attention kernel, 1 thread, seq {seq}: whole sequence (fused SDPA) "
          f"{fmt_s(parts['whole']).strip()}, a Ulysses rank {fmt_s(parts['ulysses']).strip()}, "
          f"a ring rank: first {fmt_s(parts['ring first']).strip()} (1 block), last "
          f"{fmt_s(parts['ring last']).strip()} ({WORLD} blocks)", flush=True)
    return rows_of(cp, parts, seq)


if __name__ == "__main__":
    main(run, __doc__)
