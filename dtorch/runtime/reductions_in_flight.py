"""All_reduces left in flight on a rank: ``StartReduce`` posts one (gloo's or NCCL's
asynchronous collective, the poison flag inside its payload) and stores a ``Started`` under
its output id; the rank runs its next instructions while the backend moves the data;
``FinishReduce`` waits for it (a ``Free`` of the id never waits: see ``_drop_started``). What gradient buckets use to overlap
the backward. A mixin of the ``Interpreter``, which gives ``store``, ``counts``,
``instructions``, ``_collective_input``, ``_collective_failure`` and ``_fail``."""

from __future__ import annotations

from typing import NamedTuple

from . import messages as m
from .collectives import InFlight, StepContext, finish_all_reduce, start_all_reduce
from .poison import Poison, RemoteFailure


class Started(NamedTuple):
    """A store entry: an all_reduce in flight and its input's Poison (or None)."""

    pending: InFlight
    poison: Poison | None
    at: int  # the rank's instruction count when it started


class ReductionsInFlight:
    """The ``StartReduce`` / ``FinishReduce`` handlers and the wait a ``Free`` needs."""

    def _start_reduce(self, instr: m.StartReduce):
        """Post the all_reduce and keep it in flight under ``instr.out`` (with the input's
        poison, if any: the flag went out set, the result is poisoned when it lands)."""
        got = self._collective_input(instr, instr.step.before, "all_reduce")
        if got is None:
            return
        _, value, poison = got
        ctx = StepContext(self.rank, instr.shape, instr.dtype, instr.mesh, instr.mesh,
                          self.group_of, self.device, self.pool)
        try:
            pending = start_all_reduce(instr.step, value, ctx, poison is not None)
        except Exception as exc:  # noqa: BLE001
            self.store[instr.out] = poison or self._collective_failure("all_reduce", exc)
            return
        self.counts[instr.step.kind] += 1
        self.store[instr.out] = Started(pending, poison, self.instructions)

    def _finish_reduce(self, instr: m.FinishReduce):
        if self.rank not in instr.ranks:
            return
        started = self.store.get(instr.tid)
        if not isinstance(started, Started):  # poisoned at the start, or never started
            self.store[instr.tid] = started if isinstance(started, Poison) else self._fail(
                "all_reduce", KeyError(f"no all_reduce in flight for tensor {instr.tid}"))
            return
        self.store[instr.tid] = self._landed(started)

    def _landed(self, started: "Started"):
        """Wait for a started reduction: its result, or the Poison it carries."""
        self.beside_reductions += self.instructions - started.at - 1
        try:
            value, peer = finish_all_reduce(started.pending)
        except Exception as exc:  # noqa: BLE001 - a timeout or a lost peer
            return started.poison or self._collective_failure("all_reduce", exc)
        if started.poison is not None:
            return started.poison
        if peer is not None:
            return Poison(RemoteFailure(
                self.rank, "all_reduce", "a peer's input to this all_reduce came from a failed "
                "op; dtorch.synchronize() raises that failure with its traceback", ""))
        return value

    def _drop_started(self, started: Started) -> None:
        """A ``Free`` of a reduction never finished. A ``Free`` may run on the worker's event
        loop, which must not wait for peers: a finished one is landed (its failure reported
        by ``synchronize()``), one still moving is left to the backend, which keeps its buffer
        until it is done."""
        if started.pending.work.is_completed():
            self._landed(started)

