"""Replaying a run of instructions that repeats: prepared once on the rank, run per instance.

A loop body, a training step or a decode step issues the same instructions each time with
fresh ids. The controller notices the repeat (the run's bytes, ids as slots, are the same:
``intern.py``) and sends the program once, then only its id and the instance's ids. The rank
prepares the program once: each plain ``Call`` becomes a step that knows its function, which
arguments are shards (and from which slot) and which are constants, and where its outputs
go; each ``Free`` a list of slots; any other instruction a filler that puts the ids into
its fields and executes it as usual. Running an instance then skips unpickling, dispatch and
the walk over arguments.

Poisoned values: the run's inputs from outside it are checked once when it starts; while no
step failed or wrote a poisoned output, the prepared calls read their shards without looking
at each (one flag per run). Once something is poisoned, the rest of the run takes the checked
path, instruction by instruction, so an error travels exactly as without replay. Example::

    >>> from dtorch.runtime.interpreter import Interpreter
    >>> from dtorch.runtime import messages as m
    >>> from dtorch.runtime.intern import SLOTS, Slot
    >>> import torch
    >>> interp = Interpreter(0, None)
    >>> program = PreparedRun(interp, [m.Call((Slot(1),), torch.add, (m.Ref(Slot(0)), 1.0), {},
    ...                                       (0,)), m.Free((Slot(0),), (0,))])
    >>> interp.store[10] = torch.zeros(2)
    >>> program.run((10, 11), None)
    []
    >>> interp.store
    {11: tensor([1., 1.])}
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import torch.utils._pytree as pytree
from torch import Tensor

from . import messages as m
from .intern import Slot
from .interpreter import _AS_SENT, _outputs_of
from .fusion import fuse_stretches
from .local_graphs import tensors_of
from .poison import Poison



_monotonic = time.monotonic


class Run(NamedTuple):
    """One instance of a program: its interned id and the instance's ids, in slot order."""

    program: int
    ids: tuple


def filler(obj) -> Callable | None:
    """A function ``ids -> obj`` with every ``Slot`` in it replaced by its id (built once per
    program), or None when ``obj`` holds no slot (it is used as it is)."""
    kind = type(obj)
    if kind is Slot:
        index = obj.index
        return lambda ids: ids[index]
    if kind is dict:
        parts = {k: filler(v) for k, v in obj.items()}
        if not any(parts.values()):
            return None
        makers = {k: p or _constant(obj[k]) for k, p in parts.items()}
        return lambda ids: {k: make(ids) for k, make in makers.items()}
    if kind is tuple or kind is list or (isinstance(obj, tuple) and hasattr(obj, "_fields")):
        parts = [filler(x) for x in obj]
        if not any(parts):
            return None
        makers = [p or _constant(x) for p, x in zip(parts, obj)]
        if kind is tuple or kind is list:
            return lambda ids: kind([make(ids) for make in makers])
        return lambda ids: kind(*[make(ids) for make in makers])
    return None


def _constant(value):
    return lambda ids: value


def _reads(instr) -> set:
    """The slots ``instr``'s ``Ref`` placeholders read (once per program: pytree's walk)."""
    leaves = pytree.tree_leaves(instr, is_leaf=lambda x: type(x) is m.Ref)
    return {x.tid.index for x in leaves if type(x) is m.Ref and type(x.tid) is Slot}


class PreparedRun:
    """A program prepared for one rank's interpreter (see the module docstring)."""

    def __init__(self, interp, template: list, fuse: bool = False):
        self.interp = interp
        self.steps = [self._prepare(instr) for instr in template]
        if fuse:
            self.steps = fuse_stretches(self.steps)
        self.inputs = self._inputs_from_outside(template)
        self.size = len(template)

    def _prepare(self, instr) -> tuple:
        """``(kind, instr, data, fill)``: "call" or "free" with what they need prepared, or
        "other"; ``fill(ids)`` rebuilds the instruction (None: it holds no slot)."""
        kind, fill = type(instr), filler(instr)
        if kind is m.Call and type(instr.fn) is not m.CompositePlan and \
                self.interp.rank in instr.ranks and not filler(instr.kwargs) and \
                all(type(a) in _AS_SENT or (type(a) is m.Ref and type(a.tid) is Slot)
                    for a in instr.args) and all(type(o) is Slot for o in instr.outs):
            refs = tuple((i, a.tid.index) for i, a in enumerate(instr.args)
                         if type(a) is m.Ref)
            constants = [None if type(a) is m.Ref else a for a in instr.args]
            outs = tuple(o.index for o in instr.outs)
            return "call", instr, (refs, constants, outs, instr.fn, instr.kwargs), fill
        if kind is m.Free and all(type(t) is Slot for t in instr.tids):
            return "free", instr, tuple(t.index for t in instr.tids), fill
        return "other", instr, None, fill

    @staticmethod
    def _inputs_from_outside(template: list) -> tuple:
        """Slots read before the run writes them: where poison could come in from."""
        written: set = set()
        outside: set = set()
        for instr in template:
            read = _reads(instr)
            if type(instr) in (m.Redistribute, m.StartReduce) and type(instr.src) is Slot:
                read.add(instr.src.index)
            outside |= read - written
            written |= {o.index for o in _outputs_of(instr) if type(o) is Slot}
        return tuple(sorted(outside))

    def run(self, ids: tuple, staged) -> list:
        """Run one instance; returns the ``(req, answer)`` pairs its requests gave."""
        store = self.interp.store
        clean = not any(type(store.get(ids[i])) is Poison for i in self.inputs)
        answers: list = []
        self._run_steps(self.steps, ids, staged, clean, answers)
        return answers

    def _run_steps(self, steps, ids, staged, clean: bool, answers: list) -> bool:
        """Run prepared steps; returns whether the run is still clean."""
        interp = self.interp
        for kind, instr, data, fill in steps:
            if kind == "call" and clean:
                clean = self._call(instr, data, ids)
            elif kind == "free":
                interp.instructions += 1
                try:
                    interp.free_tids([ids[i] for i in data])
                except Exception as exc:  # noqa: BLE001 - as Interpreter.execute would
                    interp._fail("Free", exc)
            elif kind == "fused":
                if not (clean and self._fused(instr, data, ids)):
                    clean = self._run_steps(fill, ids, staged, clean, answers)
            else:  # the checked path: the instruction rebuilt with this instance's ids
                if fill is not None:
                    instr = fill(ids)
                answer = interp.execute(instr, staged)
                if answer is not None:
                    answers.append(answer)
                if clean:
                    clean = not _poisoned(interp, instr)
        return clean

    def _fused(self, first, fused, ids) -> bool:
        """A stretch of calls as its compiled function (``fusion.py``); False when it could
        not run (it then runs call by call, and never fused again)."""
        if fused.broken:
            return False
        interp = self.interp
        store = interp.store
        interp.current = (first, time.monotonic())
        try:
            values = fused([store[ids[s]] for s in fused.inputs])
        except Exception:  # noqa: BLE001 - a compile error, or an op's: the calls say which
            fused.broken = True
            return False
        finally:
            interp.current = None
        for slot, value in zip(fused.outputs, values):
            store[ids[slot]] = value
        interp.free_tids([ids[s] for s in fused.frees_outside])
        interp.instructions += fused.instructions
        interp.fused += fused.instructions
        return True

    def _call(self, instr, data, ids) -> bool:
        """A prepared call on clean inputs; False once it failed (the run is no longer clean)."""
        interp = self.interp
        store = interp.store
        refs, constants, outs, fn, kwargs = data
        interp.instructions += 1
        interp.current = (instr, _monotonic())
        try:
            args = list(constants)
            for position, slot in refs:
                args[position] = store[ids[slot]]
            result = fn(*args, **kwargs)
            if len(outs) == 1 and isinstance(result, Tensor):  # the common case, first
                store[ids[outs[0]]] = result
                return True
            values = tensors_of(result, len(outs))
            ok = True
        except Exception as exc:  # noqa: BLE001 - the op's error, as in Interpreter._call
            values = [interp._fail(getattr(fn, "__name__", str(fn)), exc)] * len(outs)
            ok = False
        finally:
            interp.current = None
        for slot, value in zip(outs, values):
            store[ids[slot]] = value
        return ok


def _poisoned(interp, instr) -> bool:
    """Whether ``instr`` left a poisoned output (or may have: a checkpoint writes shards)."""
    if type(instr) is m.Checkpoint:
        return True
    store = interp.store
    return any(type(store.get(t)) is Poison for t in _outputs_of(instr))
