"""Llama forward on 4 ranks: dtorch vs PyTorch's DTensor (``parallelize_module``, SPMD).

A small random Llama built locally from a ``transformers.LlamaConfig`` (nothing downloaded):
hidden 256, 8 heads, 4 kv heads, intermediate 688, 4 layers, vocab 1000, float32, the same
``torch.manual_seed(0)`` weights everywhere; sequence 128, batch 1 and 4 (``--quick``: batch 1,
shorter chains, 3 repeats). Two layouts on 4 CPU ranks: tp4 and pp2 x tp2.

dtorch runs ``dtorch.models.LlamaForCausalLM(config, device_mesh=...)`` on ``("tp",)`` 4 or
``("pp", "tp")`` 2 x 2, ``load_state_dict(hf.state_dict())``; the input ids are a torch tensor
on the controller (shipped to the ranks by each forward). Its references run in 4 spawned
torch processes (gloo on 127.0.0.1) with dtorch's rank-process settings (allocator, huge
pages, torch threads; ``_reference.ReferenceRanks`` checks them and stops the run if they
differ), each holding the ids already. Every model there is parallelized with
``torch.distributed.tensor.parallel.parallelize_module`` as dtorch lays its model out:
ColwiseParallel q/k/v/gate/up, RowwiseParallel o/down, the embedding ColwiseParallel (feature
dim) with a Replicate output and lm_head ColwiseParallel with a Replicate output (logits
gathered): 2 all_gathers + 2 all_reduces per layer. pp2 x tp2: two stages of 2 ranks (ranks
0, 1: embedding + layers 0-1; ranks 2, 3: layers 2-3, norm, lm_head), tp over the stage's 2
ranks, the hidden states sent from rank r to rank r + 2 with ``torch.distributed.send``/``recv``
(not ``torch.distributed.pipelining``: one micro-batch, so a schedule adds nothing). The
references run under ``torch.no_grad()``: under ``torch.inference_mode()`` torch 2.13's DTensor
misses its sharding cache and decomposes by exception on every linear (about 2x slower).

Rows, per layout and batch (times per forward; the reference's are its slowest rank's):

- **one forward, same model code: lean Llama** (target: dtorch at most 1.0x). Reference: the
  lean plain ``torch.nn`` Llama of ``bench/lean_llama.py`` (``dtorch/models/llama.py`` op for
  op, checked against transformers' logits) under ``parallelize_module``, each forward
  followed by ``dist.barrier()``; dtorch: ``model(ids)`` then ``dtorch.synchronize()``. Both
  end with the logits on the ranks, every rank finished.
- **CHAIN forwards back to back, same model code: lean Llama** (target: at most 1.0x). The
  same reference model running CHAIN forwards one after another and one ``dist.barrier()`` at
  the end; dtorch issuing CHAIN forwards and one ``synchronize()`` at the end (its controller
  runs ahead of the ranks). Divided by CHAIN.
- **one forward to the logits on the controller** (information: not the same work). dtorch:
  ``model(ids).to_torch()``, the logits read back to the controller; the reference: the lean
  model's one forward + barrier as above, whose logits stay on its ranks (SPMD has no
  controller to bring them to).
- **CHAIN forwards back to back, transformers' model** (information). Reference: transformers'
  own ``LlamaForCausalLM`` (``use_cache=False``) under ``parallelize_module``, the same chain
  and barrier; dtorch: its chain as above. dtorch runs its own Llama until it can run
  transformers' unmodified, so this row mixes the model code's overhead (mask building, output
  objects) with the framework's.

Where the time goes (printed and in the notes): dtorch's controller issue time per forward,
an empty round trip (``synchronize()``), reading finished logits (``to_torch()``), the
instructions and collectives each rank runs per forward; on the reference ranks the local
math alone (the lean model cut to one rank's shard of every projection, the stage's layers,
plain torch, no collectives).

The logits of dtorch, of the lean model on one process and of both DTensor references are
checked against transformers' on one process (allclose, 1e-4) before timing. dtorch and the
references stay up and take turns, one timed repeat each; medians and interquartile ranges.

Context parallelism on the same model is ``bench/llama_cp.py``.

    .venv/bin/python bench/llama_vs_dtensor.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, dtorch_cluster, dtorch_rank_settings, fmt_s, main, take_turns  # noqa: E402
from _reference import ReferenceRanks, serve_timings  # noqa: E402

WORLD = 4
CONFIG = dict(vocab_size=1000, hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=688, num_hidden_layers=4, eos_token_id=None,
              bos_token_id=None, pad_token_id=None)
SEQ, BATCHES = 128, (1, 4)
LAYOUTS = {"tp4": ((4,), ("tp",)), "pp2 x tp2": ((2, 2), ("pp", "tp"))}
LOGITS_RANK = {"tp4": 0, "pp2 x tp2": 2}  # a rank holding the whole logits
TARGET = 1.0
TAG = "[llama_vs_dtensor]"


class Sizes:
    """Batches, forwards per timed repeat and repeats, full or ``--quick``."""

    def __init__(self, quick: bool):
        self.batches = BATCHES[:1] if quick else BATCHES
        self.one = 2 if quick else 4  # single forwards (each synchronized) per repeat
        self.chain = 4 if quick else 8  # back-to-back forwards per repeat
        self.repeats = 3 if quick else 9


def hf_config(**over):
    import transformers
    return transformers.LlamaConfig(**{**CONFIG, **over})


def hf_model(**over):
    import torch
    import transformers
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(hf_config(**over)).eval()


def lean_model(hf=None, **over):
    """The lean Llama (``bench/lean_llama.py``) with ``hf``'s weights (default ``hf_model``)."""
    from lean_llama import LeanLlamaForCausalLM
    hf = hf if hf is not None else hf_model(**over)
    model = LeanLlamaForCausalLM(hf.config).eval()
    model.load_state_dict(hf.state_dict())
    return model


def token_ids(batch: int, seq: int = SEQ):
    import torch
    return torch.randint(0, CONFIG["vocab_size"], (batch, seq),
                         generator=torch.Generator().manual_seed(batch * 7 + seq))


# reference: the lean Llama and transformers' under parallelize_module, SPMD ----------------------
def tp_plan(model) -> dict:
    """parallelize_module's plan for ``model`` (lean or transformers', whole or a stage): dtorch's
    layout (column q/k/v/gate/up, row o/down, the embedding on its feature dim and lm_head on
    the vocabulary, both gathered). Both models use Hugging Face's module names."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(),
                     p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(),
                     p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    if _holds(model.model.embed_tokens):
        plan["model.embed_tokens"] = ColwiseParallel(output_layouts=Replicate())
    if _holds(model.lm_head):
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


class _Unused:
    """Marks a module a transformers pipeline stage does not hold (replaced by nn.Identity)."""


def _holds(module) -> bool:
    return module is not None and not isinstance(module, _Unused)


def _identity():
    import torch

    class Identity(torch.nn.Identity, _Unused):
        pass
    return Identity()


def hf_stage(stage: int | None):
    """transformers' whole model (stage None) or pipeline stage 0 / 1 of 2 (the other's layers
    removed; stage 0 returns hidden states in ``.logits``, stage 1 takes ``inputs_embeds``)."""
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


def lean_stage(stage: int | None):
    """The lean model whole (stage None) or pipeline stage 0 / 1 of 2."""
    model = lean_model()
    half = CONFIG["num_hidden_layers"] // 2
    if stage is None:
        return model
    return model.stage(slice(None, half) if stage == 0 else slice(half, None), stage == 0,
                       stage == 1)


def _pipelined(rank: int, stage0, stage1):
    """``forward(ids)`` of pp2 x tp2 on this rank: stage 0 (ranks 0, 1) runs ``stage0(ids)`` and
    sends the hidden states to rank + 2; stage 1 receives them and returns ``stage1(h)``."""
    import torch
    import torch.distributed as dist

    def forward(ids):
        if rank < 2:
            dist.send(stage0(ids).contiguous(), rank + 2)
            return None
        h = torch.empty(*ids.shape, CONFIG["hidden_size"])
        dist.recv(h, rank - 2)
        return stage1(h)
    return forward


def _reference_forwards(rank: int) -> dict:
    """``{(model, layout): forward(ids) -> logits or None}`` on this rank, model "lean" or "hf",
    each finished on return."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    tp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    stage_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))["tp"]
    stage = rank // 2

    def parallel(model, mesh):
        return parallelize_module(model, mesh, tp_plan(model))
    lean_tp, lean_pp = parallel(lean_stage(None), tp_mesh), parallel(lean_stage(stage), stage_mesh)
    hf_tp, hf_pp = parallel(hf_stage(None), tp_mesh), parallel(hf_stage(stage), stage_mesh)
    return {("lean", "tp4"): lean_tp,
            ("lean", "pp2 x tp2"): _pipelined(rank, lean_pp, lean_pp),
            ("hf", "tp4"): lambda ids: hf_tp(ids, use_cache=False).logits,
            ("hf", "pp2 x tp2"): _pipelined(
                rank, lambda ids: hf_pp(ids, use_cache=False).logits,
                lambda h: hf_pp(inputs_embeds=h, use_cache=False).logits)}


def _local_math(layout: str, rank: int):
    """One rank's share of the forward in plain torch, no collectives: the lean model with every
    projection cut to this rank's shard (heads / intermediate / vocab / embedding features
    divided by tp), run on the stage's layers. Returns ``fn(ids)``."""
    import torch

    from lean_llama import LeanLlamaForCausalLM
    tp = 4 if layout == "tp4" else 2
    over = dict(num_attention_heads=CONFIG["num_attention_heads"] // tp,
                num_key_value_heads=CONFIG["num_key_value_heads"] // tp,
                intermediate_size=CONFIG["intermediate_size"] // tp,
                vocab_size=CONFIG["vocab_size"] // tp,
                head_dim=CONFIG["hidden_size"] // CONFIG["num_attention_heads"])
    if layout != "tp4":
        over["num_hidden_layers"] = CONFIG["num_hidden_layers"] // 2
    torch.manual_seed(rank)
    small = LeanLlamaForCausalLM({**CONFIG, **over}).eval()
    embed = torch.nn.Embedding(CONFIG["vocab_size"], CONFIG["hidden_size"] // tp)
    small.model.embed_tokens = None  # takes the gathered embedding below

    def fn(ids):  # o/down/lm_head see a hidden-sized input: the row shard's output size
        h = embed(ids)
        return small(torch.cat([h] * tp, dim=-1))  # the all_gather's copy, no collective
    return fn


def per_forward(fn, n: int, barrier_each: bool) -> float:
    """Seconds per ``fn()`` over n of them between two barriers, with a ``dist.barrier()`` after
    each one (``barrier_each``) or after the last only (back to back)."""
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
        if barrier_each:
            dist.barrier()
    if not barrier_each:
        dist.barrier()
    return (time.perf_counter() - t0) / n


REF_KEYS = ("ref_one", "ref_chain", "hf_chain", "ref_local")


def _rank_main(rank: int, commands, results) -> None:
    """One reference rank: reads the batches to run (its first command), puts its first logits
    of every model, layout and batch (from the ranks holding whole logits), then times
    ``(layout, batch, n_one, n_chain)`` commands: ``REF_KEYS`` seconds per forward."""
    import torch
    import torch.distributed as dist
    batches = commands[rank].get()
    forwards = _reference_forwards(rank)
    ids = {b: token_ids(b) for b in batches}
    local = {layout: _local_math(layout, rank) for layout in LAYOUTS}
    with torch.no_grad():  # not inference_mode: DTensor then takes its slow path every op
        for (kind, layout), fwd in forwards.items():
            for b in batches:
                out = fwd(ids[b])  # warm-up, and the logits for the check
                local[layout](ids[b])
                if rank == LOGITS_RANK[layout]:
                    results.put(("logits", (kind, layout, b), out.clone()))
        dist.barrier()
        if rank == 0:
            results.put(("ready", None, None))

        def timed(cmd):
            layout, b, n_one, n_chain = cmd
            lean, hf = forwards[("lean", layout)], forwards[("hf", layout)]
            return [per_forward(lambda: lean(ids[b]), n_one, barrier_each=True),
                    per_forward(lambda: lean(ids[b]), n_chain, barrier_each=False),
                    per_forward(lambda: hf(ids[b]), n_chain, barrier_each=False),
                    per_forward(lambda: local[layout](ids[b]), n_one, barrier_each=False)]
        serve_timings(rank, commands, results, timed)


class LlamaRanks(ReferenceRanks):
    """4 torch processes with the parallelized lean and transformers Llamas, timing on command;
    ``logits[(model, layout, batch)]`` their first forwards' logits."""

    def __init__(self, settings: dict, batches):
        super().__init__(_rank_main, WORLD, settings, "llama_vs_dtensor")
        for q in self.commands:
            q.put(tuple(batches))
        self.logits, ready = {}, False
        want = 2 * len(LAYOUTS) * len(batches)
        while not ready or len(self.logits) < want:
            kind, key, value = self.get()  # rank 2's logits may come after rank 0's "ready"
            if kind == "logits":
                self.logits[key] = value
            ready = ready or kind == "ready"

    def time(self, layout: str, batch: int, sizes: Sizes) -> dict:
        """``{REF_KEYS: seconds per forward}``, the slowest rank's."""
        return dict(zip(REF_KEYS, self.ask(layout, batch, sizes.one, sizes.chain)))


# dtorch -------------------------------------------------------------------------------------------
def dtorch_model(shape, names, hf):
    from dtorch import init_device_mesh
    from dtorch.models import LlamaForCausalLM
    model = LlamaForCausalLM(hf.config, device_mesh=init_device_mesh("cpu", shape,
                                                                     mesh_dim_names=names))
    model.load_state_dict(hf.state_dict())
    return model


def time_dtorch(model, ids, sizes: Sizes) -> dict:
    """Seconds per forward: ``one`` (``model(ids)`` + ``synchronize()``, ``sizes.one`` of them),
    ``issue`` (the controller's part of one: issuing it and flushing), ``to_torch``
    (``model(ids).to_torch()``), ``read`` (``to_torch()`` of finished logits), ``sync`` (an
    empty round trip) and ``chain`` (``sizes.chain`` forwards, one ``synchronize()``)."""
    import dtorch
    from dtorch.runtime import session
    c = session.get_controller()
    dtorch.synchronize()
    one = issue = 0.0
    for _ in range(sizes.one):
        t0 = time.perf_counter()
        logits = model(ids).logits
        c.flush()
        t1 = time.perf_counter()
        dtorch.synchronize()
        one, issue = one + time.perf_counter() - t0, issue + t1 - t0
        del logits
    t0 = time.perf_counter()
    logits = model(ids).logits
    logits.to_torch()
    t1 = time.perf_counter()
    logits.to_torch()  # reading finished logits again: the round trip + transfer alone
    t2 = time.perf_counter()
    dtorch.synchronize()
    t3 = time.perf_counter()
    dtorch.synchronize()  # an empty round trip
    t4 = time.perf_counter()
    for _ in range(sizes.chain):
        del logits
        logits = model(ids).logits
    dtorch.synchronize()
    t5 = time.perf_counter()
    del logits
    return {"one": one / sizes.one, "issue": issue / sizes.one, "to_torch": t1 - t0,
            "read": t2 - t1, "sync": t4 - t3, "chain": (t5 - t4) / sizes.chain}


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


def check_logits(ref: LlamaRanks, models: dict, hf, batches) -> None:
    """dtorch's logits, the lean model's on this process and both DTensor references' equal
    transformers' on this process (atol 1e-4), every layout and batch; raises otherwise."""
    import torch
    lean = lean_model(hf)
    for b in batches:
        ids = token_ids(b)
        with torch.no_grad():
            want, mine = hf(ids).logits, lean(ids)
        for layout, model in models.items():
            got = {"dtorch": model(ids).logits.to_torch(), "lean Llama": mine,
                   "lean Llama under DTensor": ref.logits[("lean", layout, b)],
                   "transformers under DTensor": ref.logits[("hf", layout, b)]}
            for who, value in got.items():
                err = (value - want).abs().max().item()
                assert torch.allclose(value, want, atol=1e-4), (layout, b, who, err)
    print(f"{TAG} logits equal transformers' (atol 1e-4): dtorch, the lean Llama, both "
          f"DTensor references; every layout, batch {list(batches)}", flush=True)


def _report(layout: str, b: int, t: dict) -> None:
    r = {k: v.median if hasattr(v, "median") else v for k, v in t.items()}
    print(f"{TAG} {layout} batch {b}: one forward dtorch {fmt_s(r['one']).strip()} vs lean "
          f"DTensor {fmt_s(r['ref_one']).strip()} ({r['one'] / r['ref_one']:.2f}); back to "
          f"back {fmt_s(r['chain']).strip()} vs {fmt_s(r['ref_chain']).strip()} "
          f"({r['chain'] / r['ref_chain']:.2f}), transformers' model "
          f"{fmt_s(r['hf_chain']).strip()}; to the controller {fmt_s(r['to_torch']).strip()}; "
          f"controller issue {fmt_s(r['issue']).strip()}, read {fmt_s(r['read']).strip()}, round "
          f"trip {fmt_s(r['sync']).strip()}; reference local math "
          f"{fmt_s(r['ref_local']).strip()}; {r['instr']:.0f} instructions/rank, "
          f"{r['counts']}", flush=True)


def measure(sizes: Sizes) -> dict:
    """``{(layout, batch): {name: Timing, "instr": ..., "counts": ...}}``."""
    import torch
    hf = hf_model()
    out = {}
    # inference on both sides: the references run under no_grad, so does dtorch (its
    # parameters require grad and would record the graph otherwise)
    with dtorch_cluster(WORLD), LlamaRanks(dtorch_rank_settings(), sizes.batches) as ref, \
            torch.no_grad():
        models = {name: dtorch_model(*LAYOUTS[name], hf) for name in LAYOUTS}
        check_logits(ref, models, hf, sizes.batches)
        for b in sizes.batches:
            ids = token_ids(b)
            for layout, model in models.items():
                instr, counts = per_forward_counts(model, ids)
                time_dtorch(model, ids, sizes)  # warm-up
                t = out[(layout, b)] = take_turns(sizes.repeats,
                                                  lambda: ref.time(layout, b, sizes),
                                                  lambda: time_dtorch(model, ids, sizes))
                t.update(instr=instr, counts=counts)
                _report(layout, b, t)
    return out


def rows_of(layout: str, b: int, t: dict, sizes: Sizes) -> list[Row]:
    """The four rows of one layout and batch (see the module doc)."""
    ms = lambda k: fmt_s(t[k].median).strip()  # noqa: E731
    name = f"Llama {layout} batch {b}"
    parts = (f"dtorch: controller issue {ms('issue')}, round trip {ms('sync')}, "
             f"{t['instr']:.0f} instructions/rank; reference local math {ms('ref_local')}")
    return [
        Row.timed(f"{name}, one forward (same model code: lean Llama)", t["one"], t["ref_one"],
                  TARGET, f"model(ids) + synchronize() vs lean Llama under DTensor, forward + "
                          f"barrier; {parts}"),
        Row.timed(f"{name}, {sizes.chain} forwards back to back (same model code: lean Llama)",
                  t["chain"], t["ref_chain"], TARGET,
                  f"per forward; {sizes.chain} forwards then one synchronize() vs {sizes.chain} "
                  f"forwards then one barrier"),
        Row.timed(f"{name}, one forward to the logits on the controller", t["to_torch"],
                  t["ref_one"], None,
                  f"info, not the same work: model(ids).to_torch() (read {ms('read')}) vs lean "
                  f"Llama under DTensor, forward + barrier, its logits left on its ranks"),
        Row.timed(f"{name}, {sizes.chain} forwards back to back, transformers' model",
                  t["chain"], t["hf_chain"], None,
                  "info: transformers' model under DTensor; dtorch runs its own Llama until it "
                  "can run transformers' unmodified"),
    ]


def run(quick: bool = False) -> list[Row]:
    sizes = Sizes(quick)
    print(f"{TAG} Llama {CONFIG['num_hidden_layers']} layers hidden {CONFIG['hidden_size']} seq "
          f"{SEQ}, dtorch vs PyTorch DTensor parallelize_module (SPMD) on {WORLD} ranks, "
          f"taking turns ...", flush=True)
    got = measure(sizes)
    return [row for (layout, b), t in got.items() for row in rows_of(layout, b, t, sizes)]


if __name__ == "__main__":
    main(run, __doc__)
