"""Context parallelism on the Llama of ``llama_vs_dtensor.py``: ring vs Ulysses vs no CP.

At sequence 4096 (dtorch only: PyTorch's ``context_parallel`` needs CUDA SDPA
backends): the same Llama with 2 layers, batch 1, on ``("ring_cp",)`` 4, ``("ulysses_cp",)``
4 and no CP (``("replicate",)`` 4: a dim name the model does not use, every rank computes the
whole sequence). Per mesh: one forward + ``synchronize()`` (taking turns), the logits checked
against transformers' (1e-4), and each rank process's peak RSS during one forward (Linux
``/proc/self/clear_refs`` = 5 resets ``VmHWM`` after a ``gc.collect`` + ``malloc_trim``, the
peak read after the forward; "added" = peak - RSS at the reset) plus
``rank_stats()["composite_peak_bytes"]`` (the K/V blocks a rank held at once in the ring).

    .venv/bin/python bench/llama_cp.py [--quick]   # --quick: sequence 1024
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, dtorch_cluster, fmt_s, main, median  # noqa: E402
from llama_vs_dtensor import CONFIG, WORLD, dtorch_model, hf_model, token_ids  # noqa: E402

CP_LAYERS, CP_SEQ = 2, 4096
CP_MESHES = {"ring_cp 4": ("ring_cp",), "ulysses_cp 4": ("ulysses_cp",),
             "no CP (replicate 4)": ("replicate",)}
TARGET = 1.0
TAG = "[llama_cp]"


def _reset_peak() -> int:
    """Inside a rank process: free what can be freed, reset VmHWM; returns VmRSS (bytes)."""
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
    """Inside a rank process: VmRSS and VmHWM in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def rank_peaks(forward) -> list[tuple[int, int]]:
    """Per rank (peak RSS during ``forward()``, peak - RSS at the reset), bytes."""
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


def measure_cp(seq: int, repeats: int) -> dict:
    """``{mesh label: {"s": seconds per forward, "peak": [...], "composite": [...]}}``."""
    import torch

    import dtorch
    hf = hf_model(num_hidden_layers=CP_LAYERS)
    ids = token_ids(1, seq)
    with torch.no_grad():
        want = hf(ids).logits
    out = {}
    with dtorch_cluster(WORLD):
        models = {k: dtorch_model((WORLD,), names, hf) for k, names in CP_MESHES.items()}
        for label, model in models.items():
            err = (model(ids).to_torch() - want).abs().max().item()
            assert err < 1e-4, (label, err)
            peaks = rank_peaks(lambda: model(ids))
            out[label] = {"peak": peaks, "err": err, "s": [],
                          "composite": [s["composite_peak_bytes"] for s in dtorch.rank_stats()]}
        for _ in range(repeats):
            for label, model in models.items():
                dtorch.synchronize()
                t0 = time.perf_counter()
                model(ids)
                dtorch.synchronize()
                out[label]["s"].append(time.perf_counter() - t0)
        for label, r in out.items():
            r["s"] = median(r["s"])
            mb = [f"{p / 2**20:.0f} (+{a / 2**20:.0f})" for p, a in r["peak"]]
            print(f"{TAG} CP seq {seq}, {label}: {fmt_s(r['s']).strip()} per forward, peak RSS "
                  f"per rank MB (added by the forward): {', '.join(mb)}; ring K/V peak per "
                  f"rank {[c >> 10 for c in r['composite']]} KB; max |err| {r['err']:.1e}",
                  flush=True)
    return out


def attention_parts(seq: int) -> dict:
    """Where a CP attention's time goes, one layer's kernel on this process (1 thread): the
    no-CP fused causal SDPA over the whole sequence, a Ulysses rank's (a quarter of the heads)
    and the ring's ``ring_step`` blocks on rank 0 (1 block, the rest skipped as future) and on
    the last rank (all WORLD blocks). Seconds, best of 3."""
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
        return {"none": best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
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


def run(quick: bool = False) -> list[Row]:
    rows = []
    seq = 1024 if quick else CP_SEQ
    print(f"{TAG} CP: {CP_LAYERS} layers, batch 1, sequence {seq}, ring vs Ulysses vs none ...",
          flush=True)
    cp = measure_cp(seq, 2 if quick else 5)
    parts = attention_parts(seq)
    print(f"{TAG} one attention kernel, 1 thread, seq {seq}: no CP (fused SDPA) "
          f"{fmt_s(parts['none']).strip()}, a Ulysses rank {fmt_s(parts['ulysses']).strip()}, "
          f"a ring rank: first {fmt_s(parts['ring first']).strip()} (1 block), last "
          f"{fmt_s(parts['ring last']).strip()} ({WORLD} blocks)", flush=True)
    none = cp["no CP (replicate 4)"]
    for label, r in cp.items():
        if r is none:
            continue
        kernel = parts["ring last" if label.startswith("ring") else "ulysses"]
        rows.append(Row(f"Llama CP seq {seq}, {label} vs no CP", r["s"], none["s"], TARGET,
                        f"info, no target; slowest rank's attention kernel "
                        f"{fmt_s(kernel).strip()} vs {fmt_s(parts['none']).strip()} (1 thread); "
                        f"peak RSS/rank {_mb(max(p for p, _ in r['peak']))} (+"
                        f"{_mb(max(a for _, a in r['peak']))} in the forward) vs "
                        f"{_mb(max(p for p, _ in none['peak']))} (+"
                        f"{_mb(max(a for _, a in none['peak']))}); ring K/V peak/rank "
                        f"{max(r['composite']) >> 10} KB"))
    return rows


if __name__ == "__main__":
    main(run, __doc__)
