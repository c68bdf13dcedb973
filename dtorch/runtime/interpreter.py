"""The rank interpreter: executes instructions in order on one rank's local shards.

It owns the store ``{tensor id: local torch.Tensor}``. A failed instruction does not stop the
stream: its outputs become :class:`Poison` values carrying the error, later instructions that
read them are poisoned too, and a poisoned rank still takes part in every collective it is named
in (with zeros of the shape the metadata gives) so its peers never wait for it. Example::

    interp = Interpreter(rank=0, group_of=lambda ranks: None)
    interp.execute(Create(...))
"""

from __future__ import annotations

import pickle
import time
import traceback
from collections import Counter
from typing import Callable

import torch
import torch.utils._pytree as pytree

from .. import layout
from ..redistribute import COLLECTIVES
from . import messages as m
from .buffers import BufferPool, use_as_rank_pool
from .wire import pack, unpack
from .collectives import StepContext, collective_calls, is_comm_failure, run_step, send_recv
from .composite import run_composite
from . import random_masks
from .local_graphs import LocalGraph, LocalGraphs, tensors_of as _tensors_of  # noqa: F401
from .reductions_in_flight import ReductionsInFlight, Started
from .poison import Poison, RemoteFailure  # noqa: F401 - re-exported: the interpreter's values


MAX_KEPT_ERRORS = 100
_AS_SENT = frozenset((int, float, bool, str, type(None)))  # arguments used as they arrive

_DETERMINISTIC = {"zeros": torch.zeros, "ones": torch.ones, "empty": torch.empty}
_BLOCKWISE = {"init_uniform": torch.Tensor.uniform_, "init_normal": torch.Tensor.normal_}


def _global_factory(fn: str, args, kwargs, shape, dtype, gen):
    if fn == "rand":
        return torch.rand(shape, generator=gen, dtype=dtype)
    if fn == "randn":
        return torch.randn(shape, generator=gen, dtype=dtype)
    if fn == "randint":
        return torch.randint(args[0], args[1], shape, generator=gen, dtype=dtype)
    if fn == "randperm":
        return torch.randperm(shape[0], generator=gen, dtype=dtype)
    if fn == "arange":
        return torch.arange(*args, dtype=dtype)
    if fn == "full":
        return torch.full(shape, args[0], dtype=dtype)
    raise ValueError(f"unknown factory {fn!r}")


def _label(instr) -> str:
    """How errors and liveness reports name an instruction: ``Call(torch.add)``."""
    fn = getattr(instr, "fn", None)
    name = type(instr).__name__
    if type(fn) is m.CompositePlan:
        return f"{name}({fn.name})"
    return f"{name}({getattr(fn, '__name__', fn)})" if fn is not None else name


_OUTPUTS = {m.Create: lambda i: (i.tid,), m.Load: lambda i: (i.tid,),
            m.Redistribute: lambda i: (i.out,), m.Call: lambda i: i.outs,
            m.Eager: lambda i: (i.out,), m.Unflatten: lambda i: i.outs,
            m.RecordedCall: lambda i: i.outs, m.Backward: lambda i: i.outs,
            m.StartReduce: lambda i: (i.out,), m.FinishReduce: lambda i: (i.tid,)}


def _outputs_of(instr) -> tuple[int, ...]:
    """The tensor ids an instruction writes."""
    outputs = _OUTPUTS.get(type(instr))
    return tuple(outputs(instr)) if outputs is not None else ()


def describe_result(value):
    """``(treespec, leaves)``: tensor leaves as ``("tensor", shape, dtype)``, other leaves as
    ``("value", v)`` (what the controller needs to wrap an eager result)."""
    leaves, spec = pytree.tree_flatten(value)
    return spec, [("tensor", tuple(v.shape), v.dtype, str(v.layout))
                  if isinstance(v, torch.Tensor) else ("value", v) for v in leaves]


class Interpreter(LocalGraphs, ReductionsInFlight):
    """One rank's store and instruction loop body."""

    def __init__(self, rank: int, group_of: Callable[[tuple[int, ...]], object],
                 make_groups: Callable[[tuple, str], None] | None = None, seed: int = 0,
                 device: str = "cpu"):
        self.rank = rank
        self.device = torch.device(device)
        self.pool = BufferPool()
        use_as_rank_pool(self.pool)  # rank-side kernels' outputs (a bucket's pack) reuse it
        self.broken: RemoteFailure | None = None  # a collective timed out: restart() needed
        self.store: dict[int, torch.Tensor | Poison] = {}
        self.graphs: dict[int, LocalGraph | Poison] = {}  # node id -> kept local graph
        self.errors: list[RemoteFailure] = []
        self.dropped_errors = 0
        self.counts: Counter = Counter()
        self.comm_seconds: Counter = Counter()  # "kind dim" -> seconds inside collectives
        self.mine: dict[int, tuple] = {}  # id(composite table) -> (table, this rank's entry)
        self.group_of = group_of
        self.make_groups = make_groups
        self.gen = torch.Generator().manual_seed(seed)
        self.instructions = 0
        self.random_values = 0  # values the counter-based stream drew here (random_masks)
        self.beside_reductions = 0  # instructions run while a StartReduce was in flight
        self.prepared: dict = {}  # program id -> replay.PreparedRun
        self.replayed = 0  # instructions run from prepared programs
        self.fused = 0  # of those, run inside a fused stretch (DTORCH_FUSE=1)
        self._poisoned_arg: Poison | None = None
        self.composite_peak_bytes = 0  # watched bytes at the peak of the last composite op
        self._handlers = {m.SetupMesh: self._setup_mesh, m.Seed: self._seed,
                          m.Create: self._create, m.Load: self._load,
                          m.Redistribute: self._redistribute, m.Call: self._call,
                          m.Fetch: self._fetch, m.Sync: self._sync, m.Free: self._free,
                          m.MeasureLinks: self._measure_links,
                          m.Eager: self._eager, m.Unflatten: self._unflatten,
                          m.RecordedCall: self._recorded_call, m.Backward: self._backward,
                          m.Checkpoint: self._checkpoint,
                          m.StartReduce: self._start_reduce,
                          m.FinishReduce: self._finish_reduce}
        self.post_later: Callable | None = None  # answers a request later (the actor's)
        self.timeout_s = 60.0  # the world's collective timeout (the actor sets its own)
        self.current: tuple | None = None  # (instruction, started) while one runs

    # entry point -----------------------------------------------------------------------------
    def execute(self, instr, staged: dict | None = None):
        """Run one instruction; returns ``(req, answer)`` for Fetch/Sync, else None.

        Whatever a handler raises becomes that instruction's error (its outputs poisoned, a
        request answered with it): the interpreter goes on with the next instruction."""
        self.instructions += 1
        self._staged = staged
        self.current = (instr, time.monotonic())  # labelled only when asked (running())
        try:
            return self._handlers[type(instr)](instr)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            return self._failed_instruction(instr, exc)
        finally:
            self.current = None

    def running(self) -> tuple[str, float] | None:
        """``(label, seconds)`` of the instruction running now, or None (liveness reports).

        >>> Interpreter(0, None).running() is None
        True
        """
        current = self.current
        if current is None:
            return None
        return _label(current[0]), time.monotonic() - current[1]

    def _failed_instruction(self, instr, exc: Exception):
        """Poison what ``instr`` would have written; answer its request with the error."""
        ranks = getattr(instr, "ranks", None)
        if ranks is not None and self.rank not in ranks:
            return None
        poison = self._fail(_label(instr), exc)
        for tid in _outputs_of(instr):
            self.store[tid] = poison
        req = getattr(instr, "req", None)
        return None if req is None else (req, ("err", poison.failure))

    def _fail(self, op: str, exc: BaseException) -> Poison:
        failure = RemoteFailure(self.rank, op, f"{type(exc).__name__}: {exc}",
                                "".join(traceback.format_exception(exc)))
        if len(self.errors) < MAX_KEPT_ERRORS:  # until synchronize() collects them
            self.errors.append(failure)
        else:
            self.dropped_errors += 1
        return Poison(failure)

    # instructions ----------------------------------------------------------------------------
    def _setup_mesh(self, instr: m.SetupMesh):
        if self.broken is None:
            self.make_groups(instr.groups, instr.backend)

    def _seed(self, instr: m.Seed):
        self.gen.manual_seed(instr.seed)

    def _create(self, instr: m.Create):
        member = self.rank in instr.ranks
        if not (member or instr.all_ranks):
            return
        try:
            value = self._make(instr, member)
        except Exception as exc:  # noqa: BLE001 - any failure becomes a poisoned value
            value = self._fail(f"dtorch.{instr.fn}", exc) if member else None
        if member:
            self.store[instr.tid] = value

    def _make(self, instr: m.Create, member: bool):
        coord = instr.mesh.get_coordinate(self.rank) if member else None
        if instr.fn in random_masks.FACTORIES:  # a dropout mask: only this rank's block
            mask = random_masks.block_of(instr, coord, self.device)
            self.random_values += mask.numel()
            return mask
        if instr.fn in _BLOCKWISE:
            return self._blockwise(instr, coord) if member else None
        if instr.fn in _DETERMINISTIC or instr.fn == "full":
            if not member:
                return None
            shape = layout.local_shape(instr.shape, instr.mesh, instr.placements, coord)
            if not layout.holds_value(instr.mesh, instr.placements, coord):
                return torch.zeros(shape, dtype=instr.dtype, device=self.device)
            if instr.fn == "full":
                return torch.full(shape, instr.args[0], dtype=instr.dtype, device=self.device)
            return _DETERMINISTIC[instr.fn](shape, dtype=instr.dtype, device=self.device)
        full = _global_factory(instr.fn, instr.args, instr.kwargs, instr.shape, instr.dtype,
                               self.gen)
        if not member:
            return None
        return layout.shard_of(full, instr.mesh, instr.placements, coord).to(self.device)

    def _blockwise(self, instr: m.Create, coord):
        """A parameter initialised block by block: each rank draws only its own block, from
        a generator seeded by (seed, the block's offset), so ranks holding the same block
        (Replicate dims) draw the same values and nobody builds the whole tensor."""
        block = layout.rank_block(instr.shape, instr.mesh, instr.placements, coord)
        if not layout.holds_value(instr.mesh, instr.placements, coord):
            return torch.zeros(block.shape, dtype=instr.dtype, device=self.device)
        gen = torch.Generator().manual_seed(hash((instr.args[0],) + block.offset) & (2**62 - 1))
        out = torch.empty(block.shape, dtype=instr.dtype)
        _BLOCKWISE[instr.fn](out, *instr.args[1:], generator=gen)
        return out.to(self.device)

    def _load(self, instr: m.Load):
        if self.rank in instr.ranks:
            self.store[instr.tid] = unpack(self._staged[instr.tid]).to(self.device)

    def _redistribute(self, instr: m.Redistribute):
        got = self._collective_input(instr, instr.steps[0].before, "redistribute")
        if got is None:
            return
        coord, value, poison = got
        ctx = StepContext(self.rank, instr.shape, instr.dtype, instr.mesh,
                          instr.dst_mesh or instr.mesh, self.group_of, self.device, self.pool,
                          self.comm_seconds)
        try:
            for step in instr.steps:
                if step.kind == "send_recv":
                    value, peer_poisoned = send_recv(step, value, ctx, poison is not None)
                    if peer_poisoned and poison is None:
                        poison = Poison(RemoteFailure(
                            self.rank, "redistribute", "the shard sent to this rank was computed "
                            "from a failed op on its source rank", ""))
                elif coord is not None:
                    value, peer = run_step(step, value, ctx, poison is not None)
                    if peer is not None and poison is None:
                        who = f"rank {peer}'s" if peer >= 0 else "a peer's"
                        poison = Poison(RemoteFailure(
                            self.rank, "redistribute", f"{who} input to this "
                            f"{step.kind} came from a failed op; dtorch.synchronize() raises "
                            f"that failure with its traceback", ""))
                if step.kind in COLLECTIVES and any(self.rank in g for g in step.groups):
                    self.counts[step.kind] += 1
        except Exception as exc:  # noqa: BLE001
            poison = poison or self._collective_failure("redistribute", exc)
        if value is not None or poison is not None:
            self.store[instr.out] = poison if poison is not None else value

    def _collective_input(self, instr, placements, op: str) -> tuple | None:
        """``(coord, local shard of instr.src, its Poison or None)`` for a collective
        instruction; a poisoned or missing shard is replaced by zeros of the shape the
        metadata gives, so this rank still takes part (its flag set). None when this rank
        does not run it, or is broken (its output poisoned with that, no collective started:
        the peers may not be in it)."""
        if self.rank not in instr.ranks:
            return None
        if self.broken is not None:
            self.store[instr.out] = Poison(self.broken)
            return None
        coord = instr.mesh.get_coordinate(self.rank)
        value = self.store.get(instr.src)
        poison = value if isinstance(value, Poison) else None
        if poison is not None or (value is None and coord is not None):
            if value is None:
                poison = self._fail(op, KeyError(f"tensor {instr.src} not found"))
            value = torch.zeros(layout.local_shape(instr.shape, instr.mesh, placements, coord),
                                dtype=instr.dtype, device=self.device)
        return coord, value, poison

    def _resolve(self, obj, subst=None):
        """``obj`` with each ``Ref`` replaced by its shard (``subst`` first) and each
        ``Coord`` by this rank's coordinate; the first Poison met is kept in
        ``_poisoned_arg``. The common leaves (a number, a shard) come first: every call's
        arguments pass here."""
        kind = type(obj)
        if kind in _AS_SENT:
            return obj
        if kind is m.Ref:
            value = self.store[obj.tid] if subst is None or obj.tid not in subst else \
                subst[obj.tid]
            if type(value) is Poison and self._poisoned_arg is None:
                self._poisoned_arg = value  # wherever it sits: top level, list, dict
            return value
        if kind is m.Coord:
            return obj.mesh.get_coordinate(self.rank)
        if kind is tuple or kind is list:
            return kind([x if type(x) in _AS_SENT else self._resolve(x, subst) for x in obj])
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):  # torch.Size
            return kind(self._resolve(x, subst) for x in obj)
        if isinstance(obj, dict):
            return {k: self._resolve(v, subst) for k, v in obj.items()}
        return obj

    def _call(self, instr: m.Call):
        if self.rank not in instr.ranks:
            return
        if type(instr.fn) is m.CompositePlan:
            return self._composite(instr)
        try:
            self._poisoned_arg = None
            args = self._resolve(instr.args)
            kwargs = self._resolve(instr.kwargs) if instr.kwargs else {}
            poison = self._poisoned_arg
            if poison is not None:
                outs = [poison] * len(instr.outs)
            else:
                outs = _tensors_of(instr.fn(*args, **kwargs), len(instr.outs))
        except Exception as exc:  # noqa: BLE001
            outs = [self._fail(getattr(instr.fn, "__name__", str(instr.fn)), exc)] * len(instr.outs)
        for tid, value in zip(instr.outs, outs):
            self.store[tid] = value

    # autograd -------------------------------------------------------------------------------
    def _composite(self, instr: m.Call):
        """A composite op (``instr.fn`` is its plan): run it even on poisoned inputs, so
        that this rank takes part in every collective of the plan (see runtime/composite)."""
        if self.broken is not None:  # never start a collective the peers may not be in
            outs = [Poison(self.broken)] * len(instr.outs)
        else:
            inputs = [self.store.get(r.tid) for r in instr.args]
            inputs = [v if v is not None else self._fail(instr.fn.name, KeyError(
                f"tensor {r.tid} not found")) for v, r in zip(inputs, instr.args)]
            try:
                outs = run_composite(self, instr.fn, inputs)
            except Exception as exc:  # noqa: BLE001 - a collective failed between ranks
                outs = [self._collective_failure(instr.fn.name, exc)] * len(instr.outs)
        for tid, value in zip(instr.outs, outs):
            self.store[tid] = value

    def _collective_failure(self, op: str, exc: BaseException) -> Poison:
        """Poison for an exception in a collective; a timeout or a lost peer also marks this
        rank broken (the ranks may be out of step: ``dtorch.restart()`` is needed)."""
        failure = self._fail(op, exc)
        if not is_comm_failure(exc):
            return failure
        self.broken = failure.failure._replace(
            message=failure.failure.message + " - a collective failed between ranks, so "
            "they may be out of step; call dtorch.restart()")
        if self.errors and self.errors[-1] is failure.failure:
            self.errors[-1] = self.broken  # synchronize() says so too
        return Poison(self.broken)

    def _fetch(self, instr: m.Fetch):
        if self.rank not in instr.ranks:
            return None
        value = self.store.get(instr.tid)
        if value is None:
            return instr.req, ("err", RemoteFailure(self.rank, "fetch", "tensor not found", ""))
        if isinstance(value, Poison):
            return instr.req, ("err", value.failure)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"tensor {instr.tid} holds a {type(value).__name__}, not a tensor")
        return instr.req, ("ok", pack(value))

    def _eager(self, instr: m.Eager):
        """Run ``fn`` and keep its whole result; ``answer_rank`` describes it (values depend
        on data, so the controller learns the outputs from a rank)."""
        if self.rank not in instr.ranks:
            return None
        if instr.node is not None:
            self._eager_recorded(instr)
        else:
            self._poisoned_arg = None
            args, kwargs = self._resolve(instr.args), self._resolve(instr.kwargs)
            if self._poisoned_arg is not None:
                self.store[instr.out] = self._poisoned_arg
            else:
                try:
                    self.store[instr.out] = instr.fn(*args, **kwargs)
                except Exception as exc:  # noqa: BLE001
                    self.store[instr.out] = self._fail(getattr(instr.fn, "__name__", "op"),
                                                       exc)
        if self.rank != instr.answer_rank:
            return None
        value = self.store[instr.out]
        if isinstance(value, Poison):
            return instr.req, ("err", value.failure)
        spec, leaves = describe_result(value)
        graph = self.graphs.get(instr.node) if instr.node is not None else None
        if isinstance(graph, LocalGraph):  # which tensor outputs require grad
            flags = iter([o.requires_grad for o in graph.outputs])
            leaves = [leaf + (next(flags),) if leaf[0] == "tensor" else leaf for leaf in leaves]
        return instr.req, ("ok", pickle.dumps((spec, leaves)))

    def _unflatten(self, instr: m.Unflatten):
        """Replace a kept result by its tensor leaves, stored under ``outs``."""
        if self.rank not in instr.ranks:
            return
        value = self.store.pop(instr.src, None)
        if value is None:
            value = self._fail("unflatten", KeyError(f"tensor {instr.src} not found"))
        if isinstance(value, Poison):
            leaves = [value] * len(instr.outs)
        else:
            leaves = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
            if len(leaves) != len(instr.outs):
                raise RuntimeError(f"this rank's result has {len(leaves)} tensors; the "
                                   f"controller expected {len(instr.outs)}")
        for tid, leaf in zip(instr.outs, leaves):
            self.store[tid] = leaf

    def _checkpoint(self, instr: m.Checkpoint):
        if self.broken is not None:  # never start the checkpoint's collectives out of step
            return instr.req, ("err", self.broken)
        from . import checkpoint_io
        return checkpoint_io.run(self, instr, self.post_later)

    def _measure_links(self, instr: m.MeasureLinks):
        if self.broken is not None:  # never start collectives the peers may not be in
            return instr.req, ("err", self.broken)
        from .link_timing import time_collective
        try:
            return instr.req, ("ok", time_collective(instr, self))
        except Exception as exc:  # noqa: BLE001 - a lost peer or a timeout breaks the world
            return instr.req, ("err", self._collective_failure("measure_links", exc).failure)

    def _sync(self, instr: m.Sync):
        errors, self.errors = self.errors, []
        if self.dropped_errors:
            errors.append(RemoteFailure(self.rank, "synchronize", f"{self.dropped_errors} more "
                                        f"failures were not kept", ""))
            self.dropped_errors = 0
        return instr.req, ("ok", errors)

    def replay(self, run, staged, rank_table: dict) -> list:
        """Run one instance of a repeated program (``replay.py``), preparing it the first
        time; returns the answers its requests gave."""
        prepared = self.prepared.get(run.program)
        if prepared is None:
            from .intern import SLOTS, loads
            from .fusion import fuse_enabled
            from .replay import PreparedRun
            template = loads(rank_table[run.program].data, rank_table, SLOTS)
            prepared = self.prepared[run.program] = PreparedRun(self, template, fuse_enabled())
        self.replayed += prepared.size
        return prepared.run(run.ids, staged)

    def _free(self, instr: m.Free):
        self.free_tids(instr.tids)

    def free_tids(self, tids) -> None:
        """Drop these tensors (their large buffers back to the pool) or kept graphs."""
        graphs, store, floor = self.graphs, self.store, self.pool.min_bytes
        for tid in tids:
            if graphs:
                graphs.pop(tid, None)  # a node id: the controller dropped its graph
            value = store.pop(tid, None)
            if isinstance(value, torch.Tensor):
                if value.layout == torch.strided and value.nbytes >= floor:
                    self.pool.give_back(value)  # reused only if nothing else can reach it
            elif isinstance(value, Started):  # never finished (a failed backward's bucket)
                self._drop_started(value)
            del value

    # introspection ---------------------------------------------------------------------------
    def _storage_bytes(self, tensors) -> int:
        """The memory the stored tensors and the kept graphs' leaves and outputs hold, each
        storage once (a view or a detached copy shares its base's; a freed one holds 0)."""
        seen = {}
        kept = [t for g in self.graphs.values() if isinstance(g, LocalGraph)
                for t in g.leaves + g.outputs]
        for t in tensors + kept:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                storage = t.untyped_storage()
                seen[storage.data_ptr() or id(storage)] = storage.nbytes()
        return sum(seen.values())

    def stats(self) -> dict:
        tensors = [v for v in self.store.values() if isinstance(v, torch.Tensor)]
        return {"rank": self.rank, "tensors": len(self.store),
                "bytes": sum(t.numel() * t.element_size() for t in tensors),
                "counts": dict(self.counts), "instructions": self.instructions,
                "random_values": self.random_values,
                "beside_reductions": self.beside_reductions,
                "replayed": self.replayed, "programs": len(self.prepared),
                "fused": self.fused,
                "in_flight": sum(isinstance(v, Started) for v in self.store.values()),
                "pool_bytes": self.pool.held, "pool_reused": self.pool.reused,
                "composite_peak_bytes": self.composite_peak_bytes,
                "graphs": len(self.graphs),
                "graph_bytes": sum(g.nbytes() for g in self.graphs.values()
                                   if isinstance(g, LocalGraph)),
                "storage_bytes": self._storage_bytes(tensors),
                "dist_calls": collective_calls(),
                "comm_seconds": dict(self.comm_seconds)}
