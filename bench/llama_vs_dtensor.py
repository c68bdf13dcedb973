"""Llama forward on 4 ranks: dtorch vs PyTorch's DTensor (``parallelize_module``, SPMD).

A small random Llama built locally from a ``transformers.LlamaConfig`` (nothing downloaded):
hidden 256, 8 heads, 4 kv heads, intermediate 688, 4 layers, vocab 1000, float32, the same
``torch.manual_seed(0)`` weights everywhere; sequence 128, batch 1 and 4.

**tp4 and pp2 x tp2 vs PyTorch's DTensor** (target: dtorch at most 1.0x end to end):

- dtorch: ``dtorch.models.LlamaForCausalLM(config, device_mesh=...)`` on ``("tp",)`` 4 and
  ``("pp", "tp")`` 2 x 2, ``load_state_dict(hf.state_dict())``; the input ids a torch tensor.
- reference: the same ``transformers.LlamaForCausalLM`` in each of 4 spawned processes (gloo on
  127.0.0.1, the dtorch ranks' allocator / huge-page / thread settings, checked), parallelized
  with ``torch.distributed.tensor.parallel.parallelize_module``: ColwiseParallel for
  q/k/v/gate/up, RowwiseParallel for o/down, the embedding ColwiseParallel (feature dim) with a
  Replicate output and lm_head ColwiseParallel with a Replicate output (logits gathered), as
  dtorch does: 2 all_gathers + 2 all_reduces per layer. pp2 x tp2: two stages of 2 ranks
  (ranks 0, 1: embedding + layers 0-1; ranks 2, 3: layers 2-3, norm, lm_head), each stage the
  model with the other stage's layers removed, tp over the stage's 2 ranks, the hidden states
  sent from rank r to rank r + 2 with ``torch.distributed.send``/``recv`` (not
  ``torch.distributed.pipelining``: one micro-batch, so a schedule adds nothing).
- end to end, one forward: from issuing it to having the logits. dtorch:
  ``model(ids).to_torch()`` on the controller; reference: the forward + ``dist.barrier()``
  inside the ranks, the slowest rank. Information rows: dtorch issuing ``CHAIN`` forwards back
  to back, then one ``synchronize()`` (the controller runs ahead of the ranks), per forward.
- where the time goes (printed and in the notes): dtorch's controller issue time per forward,
  an empty round trip (``synchronize()``), reading finished logits (``to_torch()``), the
  instructions and collectives each rank runs per forward; the reference's per-forward time
  with its collectives (the DTensor hooks) and, on the same ranks, the local math alone (one
  rank's shard of every matmul, attention, norms in plain torch, no collectives).

The logits of both sides are checked against transformers' on one process (allclose, 1e-4)
before timing. Both sides stay up and take turns, one timed repeat each; medians. The
reference runs under ``torch.no_grad()``: under ``torch.inference_mode()`` torch 2.13's DTensor
misses its sharding cache and decomposes by exception on every linear (about 2x slower).

Context parallelism on the same model is ``bench/llama_cp.py``.

    .venv/bin/python bench/llama_vs_dtensor.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (ReferenceRanks, Row, check_same_settings, dtorch_cluster,  # noqa: E402
                     dtorch_rank_settings, fmt_s, gathered_rank_settings, join_reference_group,
                     main, serve_timings, take_turns)

WORLD = 4
CONFIG = dict(vocab_size=1000, hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=688, num_hidden_layers=4, eos_token_id=None,
              bos_token_id=None, pad_token_id=None)
SEQ, BATCHES = 128, (1, 4)
LAYOUTS = {"tp4": ((4,), ("tp",)), "pp2 x tp2": ((2, 2), ("pp", "tp"))}
CHAIN = 8  # dtorch's back-to-back forwards
REF_N = 5  # reference forwards per timed repeat
TARGET = 1.0
TAG = "[llama_vs_dtensor]"


def hf_config(**over):
    import transformers
    return transformers.LlamaConfig(**{**CONFIG, **over})


def hf_model(**over):
    import torch
    import transformers
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(hf_config(**over)).eval()


def token_ids(batch: int, seq: int = SEQ):
    import torch
    return torch.randint(0, CONFIG["vocab_size"], (batch, seq),
                         generator=torch.Generator().manual_seed(batch * 7 + seq))


# reference: transformers' Llama + parallelize_module, SPMD ----------------------------------------
def tp_plan(model, layers: range) -> dict:
    """parallelize_module's plan: dtorch's layout (column q/k/v/gate/up, row o/down, the
    embedding on its feature dim and lm_head on the vocabulary, both gathered)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {}
    for i in layers:
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(),
                     p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(),
                     p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    if not isinstance(model.model.embed_tokens, _Unused):
        plan["model.embed_tokens"] = ColwiseParallel(output_layouts=Replicate())
    if not isinstance(model.lm_head, _Unused):
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


class _Unused:
    """Marks a module a pipeline stage does not hold (replaced by nn.Identity)."""


def _identity():
    import torch

    class Identity(torch.nn.Identity, _Unused):
        pass
    return Identity()


def stage_model(stage: int | None):
    """The whole model (stage None) or pipeline stage 0 / 1 of 2 (the other's layers removed;
    stage 0 returns hidden states in ``.logits``, stage 1 takes ``inputs_embeds``)."""
    import torch
    model = hf_model()
    half = CONFIG["num_hidden_layers"] // 2
    if stage == 0:
        model.model.layers = torch.nn.ModuleList(model.model.layers[:half])
        model.model.norm, model.lm_head = _identity(), _identity()
    elif stage == 1:
        model.model.layers = torch.nn.ModuleList(model.model.layers[half:])
        model.model.embed_tokens = _identity()
    return model


def _reference_forwards(rank: int):
    """``{layout: forward(ids) -> logits or None}`` on this rank, each finished on return."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    tp = stage_model(None)
    parallelize_module(tp, init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
                       tp_plan(tp, range(CONFIG["num_hidden_layers"])))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage = rank // 2
    pp = stage_model(stage)
    parallelize_module(pp, mesh["tp"], tp_plan(pp, range(len(pp.model.layers))))

    def forward_tp(ids):
        return tp(ids, use_cache=False).logits

    def forward_pp(ids):
        if stage == 0:
            h = pp(ids, use_cache=False).logits
            dist.send(h.contiguous(), rank + 2)
            return None
        h = torch.empty(*ids.shape, CONFIG["hidden_size"])
        dist.recv(h, rank - 2)
        return pp(inputs_embeds=h, use_cache=False).logits
    return {"tp4": forward_tp, "pp2 x tp2": forward_pp}


def _local_math(layout: str, rank: int):
    """One rank's share of the forward in plain torch, no collectives: the model with every
    projection cut to this rank's shard (heads / intermediate / vocab / embedding features
    divided by tp), run on the stage's layers. Returns ``fn(ids)``."""
    import torch
    tp = 4 if layout == "tp4" else 2
    over = dict(num_attention_heads=CONFIG["num_attention_heads"] // tp,
                num_key_value_heads=CONFIG["num_key_value_heads"] // tp,
                intermediate_size=CONFIG["intermediate_size"] // tp,
                vocab_size=CONFIG["vocab_size"] // tp,
                head_dim=CONFIG["hidden_size"] // CONFIG["num_attention_heads"])
    if layout != "tp4":
        over["num_hidden_layers"] = CONFIG["num_hidden_layers"] // 2
    torch.manual_seed(rank)
    import transformers
    small = transformers.LlamaForCausalLM(hf_config(**over)).eval()
    embed = torch.nn.Embedding(CONFIG["vocab_size"], CONFIG["hidden_size"] // tp)

    def fn(ids):  # o/down/lm_head see a hidden-sized input: the row shard's output size
        h = embed(ids)
        h = torch.cat([h] * tp, dim=-1)  # the all_gather's copy, no collective
        return small(inputs_embeds=h, use_cache=False).logits
    return fn


def _rank_main(rank: int, port: int, commands, results) -> None:
    """One reference rank: reports settings and first logits, then times commands."""
    import torch
    import torch.distributed as dist
    join_reference_group(rank, port, WORLD)
    every = gathered_rank_settings(WORLD)
    if rank == 0:
        results.put(("settings", every))
    forwards = _reference_forwards(rank)
    ids = {b: token_ids(b) for b in BATCHES}
    local = {name: _local_math(name, rank) for name in LAYOUTS}
    with torch.no_grad():  # not inference_mode: DTensor then takes its slow path every op
        for name, fwd in forwards.items():
            for b in BATCHES:
                out = fwd(ids[b])  # warm-up, and the logits for the check
                local[name](ids[b])
                if rank == {"tp4": 0, "pp2 x tp2": 2}[name]:
                    results.put(("logits", (name, b, out.clone())))
        dist.barrier()
        if rank == 0:
            results.put(("ready", None))

        def timed(cmd):
            name, b, n = cmd
            return [_per_forward(lambda: forwards[name](ids[b]), n),
                    _per_forward(lambda: local[name](ids[b]), n, barrier=False)]
        serve_timings(rank, commands, results, timed)


def _per_forward(fn, n: int, barrier: bool = True) -> float:
    """Seconds per ``fn() + barrier`` (the end of a forward on every rank), n of them."""
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
        if barrier:
            dist.barrier()
    if not barrier:
        dist.barrier()
    return (time.perf_counter() - t0) / n


class LlamaRanks(ReferenceRanks):
    """4 torch processes with the parallelized transformers Llama, timing on command."""

    def __init__(self, settings: dict):
        super().__init__(_rank_main, WORLD, settings)
        self.logits, ready = {}, False
        while not ready or len(self.logits) < len(LAYOUTS) * len(BATCHES):
            kind, value = self.get()  # rank 2's logits may come after rank 0's "ready"
            if kind == "settings":
                self.settings = value
            elif kind == "logits":
                self.logits[value[:2]] = value[2]
            ready = ready or kind == "ready"

    def time(self, name: str, batch: int, n: int) -> dict:
        """Seconds per forward, slowest rank: ``ref`` (DTensor forward + barrier) and
        ``ref_local`` (local math alone). Every tagged start-up message came before."""
        return dict(zip(("ref", "ref_local"), self.ask(name, batch, n)))


# dtorch -------------------------------------------------------------------------------------------
def dtorch_model(shape, names, hf):
    from dtorch import init_device_mesh
    from dtorch.models import LlamaForCausalLM
    model = LlamaForCausalLM(hf.config, device_mesh=init_device_mesh("cpu", shape,
                                                                     mesh_dim_names=names))
    model.load_state_dict(hf.state_dict())
    return model


def time_dtorch(model, ids) -> dict:
    """One forward to the logits, its parts, and a chain of CHAIN forwards (seconds)."""
    import dtorch
    from dtorch.runtime import session
    c = session.get_controller()
    dtorch.synchronize()
    t0 = time.perf_counter()
    logits = model(ids)
    c.flush()
    t1 = time.perf_counter()
    logits.to_torch()
    t2 = time.perf_counter()
    logits.to_torch()  # reading finished logits again: the round trip + transfer alone
    t3 = time.perf_counter()
    dtorch.synchronize()
    t4 = time.perf_counter()
    dtorch.synchronize()  # an empty round trip
    t5 = time.perf_counter()
    for _ in range(CHAIN):
        del logits
        logits = model(ids)
    dtorch.synchronize()
    t6 = time.perf_counter()
    return {"one": t2 - t0, "issue": t1 - t0, "read": t3 - t2, "sync": t5 - t4,
            "chain": (t6 - t5) / CHAIN}


def per_forward_counts(model, ids) -> tuple[float, dict]:
    """(instructions each rank runs per forward, collective counts per forward)."""
    import dtorch
    dtorch.synchronize()
    before = sum(s["instructions"] for s in dtorch.rank_stats())
    with dtorch.CommDebugMode() as mode:
        model(ids)
        dtorch.synchronize()
    after = sum(s["instructions"] for s in dtorch.rank_stats())
    return (after - before) / WORLD, mode.get_comm_counts()


def _check_settings(ours: dict, theirs: list[dict]) -> None:
    check_same_settings(ours, theirs)
    print(f"{TAG} rank settings (dtorch's ranks and the reference ranks alike): "
          + ", ".join(f"{k}={v}" for k, v in ours.items()), flush=True)


def measure_vs_dtensor(repeats: int) -> dict:
    """``{(layout, batch): {name: seconds or value}}``."""
    import torch
    hf = hf_model()
    out = {}
    with dtorch_cluster(WORLD):
        settings = dtorch_rank_settings()
        with LlamaRanks(settings) as ref:
            _check_settings(settings, ref.settings)
            models = {name: dtorch_model(*LAYOUTS[name], hf) for name in LAYOUTS}
            for b in BATCHES:
                ids = token_ids(b)
                with torch.no_grad():
                    want = hf(ids).logits
                for name, model in models.items():
                    got = model(ids).to_torch()
                    for who, value in (("dtorch", got), ("DTensor", ref.logits[(name, b)])):
                        err = (value - want).abs().max().item()
                        assert torch.allclose(value, want, atol=1e-4), (name, b, who, err)
                    instr, counts = per_forward_counts(model, ids)
                    r = out[(name, b)] = take_turns(repeats, lambda: ref.time(name, b, REF_N),
                                                    lambda: time_dtorch(model, ids))
                    r.update(instr=instr, counts=counts)
                    print(f"{TAG} {name} batch {b}: dtorch {fmt_s(r['one']).strip()} "
                          f"(chain {fmt_s(r['chain']).strip()}/forward, controller issue "
                          f"{fmt_s(r['issue']).strip()}, read {fmt_s(r['read']).strip()}, round "
                          f"trip {fmt_s(r['sync']).strip()}), DTensor {fmt_s(r['ref']).strip()} "
                          f"(local math alone {fmt_s(r['ref_local']).strip()}); ratio "
                          f"{r['one'] / r['ref']:.2f}; {instr:.0f} instructions/rank, {counts}",
                          flush=True)
    return out


def run(quick: bool = False) -> list[Row]:
    print(f"{TAG} Llama {CONFIG['num_hidden_layers']} layers hidden {CONFIG['hidden_size']} seq "
          f"{SEQ}, dtorch vs PyTorch DTensor parallelize_module (SPMD) on {WORLD} ranks, "
          f"taking turns ...", flush=True)
    got = measure_vs_dtensor(3 if quick else 9)
    rows = []
    for (name, b), r in got.items():
        rows.append(Row(f"Llama {name} batch {b} forward, end to end", r["one"], r["ref"], TARGET,
                        f"model(ids).to_torch() vs forward + barrier; dtorch: controller issue "
                        f"{fmt_s(r['issue']).strip()}, read {fmt_s(r['read']).strip()}, round "
                        f"trip {fmt_s(r['sync']).strip()}, {r['instr']:.0f} instructions/rank; "
                        f"reference local math alone {fmt_s(r['ref_local']).strip()}"))
        rows.append(Row(f"Llama {name} batch {b}, {CHAIN} forwards back to back", r["chain"],
                        r["ref"], TARGET, "info: per forward, the controller runs ahead"))
    return rows


if __name__ == "__main__":
    main(run, __doc__)
