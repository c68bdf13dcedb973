"""Fusing a replayed program's stretches of calls into one compiled function
(``DTORCH_FUSE=1`` on the ranks; off by default).

With the flag, a prepared program's (``replay.py``) longest stretches of plain single-output
calls that are not in place, frees between them allowed, become one function compiled with ``torch.compile`` on first
use and kept with the program; the values it writes that live past the stretch are stored, the
rest never are. Values stay within float tolerance of unfused execution (and are identical with
the flag off). A stretch that fails to compile or to run, on clean inputs or not, runs call by
call, as without the flag, from then on (so an op's error reads as it would unfused). Off by
default because it loses here: ``bench/op_overhead.py``'s fused row measures it. Example::

    >>> import torch
    >>> fused = FusedCalls([(torch.mul, ((0, 0),), [None, 2.0], {}, (1,)),
    ...                     (torch.add, ((0, 1),), [None, 1.0], {}, (2,))], freed={1, 0})
    >>> fused.inputs, fused.outputs, fused.frees_outside
    ((0,), (2,), (0,))
"""

from __future__ import annotations

import os

MIN_CALLS = 2  # shorter stretches run as they are


def fuse_enabled() -> bool:
    """``DTORCH_FUSE=1`` in the rank's process (set it before ``dtorch.init`` for the embedded
    cluster; on each worker of a cluster you start)."""
    return os.environ.get("DTORCH_FUSE", "0") == "1"


class FusedCalls:
    """A stretch of prepared calls as one function of the slots it reads from outside the
    stretch, returning the slots it writes that are not freed inside it."""

    def __init__(self, calls: list, freed: set, instructions: int = 0):
        self.calls = calls  # (fn, refs, constants, kwargs, out slots), in order
        written: set = set()
        inputs: list = []
        for _, refs, _, _, outs in calls:
            for _, slot in refs:
                if slot not in written and slot not in inputs:
                    inputs.append(slot)
            written.update(outs)
        self.inputs = tuple(inputs)
        self.outputs = tuple(s for *_, outs in calls for s in outs if s not in freed)
        self.frees_outside = tuple(sorted(freed - written))  # freed after the stretch ran
        self.instructions = instructions or len(calls)
        self.compiled = None
        self.broken = False

    def _body(self, *values):
        env = dict(zip(self.inputs, values))
        for fn, refs, constants, kwargs, outs in self.calls:
            args = list(constants)
            for position, slot in refs:
                args[position] = env[slot]
            env[outs[0]] = fn(*args, **kwargs)
        return tuple(env[s] for s in self.outputs)

    def __call__(self, values: list) -> tuple:
        if self.compiled is None:
            import torch
            import torch._inductor.config as inductor
            inductor.compile_threads = 1  # no compile workers forked from a rank's process
            self.compiled = torch.compile(self._body, dynamic=False)
        return self.compiled(*values)


def _fusable(data) -> bool:
    """A prepared call with one output that is a new value: an in-place op (its output is
    its input's slot) never fuses, so a stretch that fails and runs again call by call
    cannot apply a mutation twice."""
    refs, _, outs, _, _ = data
    return len(outs) == 1 and outs[0] not in {slot for _, slot in refs}


def fuse_stretches(steps: list) -> list:
    """``steps`` (``PreparedRun``'s) with each stretch of at least ``MIN_CALLS`` single-output
    calls (frees between them allowed) replaced by one ``("fused", first instruction,
    FusedCalls, the stretch's own steps)`` step."""
    out: list = []
    stretch: list = []

    def close():
        calls = [s for s in stretch if s[0] == "call"]
        if len(calls) >= MIN_CALLS:
            freed = {slot for kind, _, data, _ in stretch if kind == "free" for slot in data}
            fused = FusedCalls([(fn, refs, constants, kwargs, outs) for _, _, (
                refs, constants, outs, fn, kwargs), _ in calls], freed, len(stretch))
            out.append(("fused", calls[0][1], fused, list(stretch)))
        else:
            out.extend(stretch)
        stretch.clear()

    for step in steps:
        kind, _, data, _ = step
        if (kind == "call" and _fusable(data)) or (kind == "free" and stretch):
            stretch.append(step)
        else:
            close()
            out.append(step)
    close()
    return out
