"""Deferred poison checks: which results came from a failed peer's placeholder.

A rank whose input to a collective is poisoned (an op failed there earlier) still takes part,
with zeros, so its peers never wait; their results are then wrong and must be poisoned too.
Rather than a flag all_reduce beside every collective (1-2 ms each on a small machine), each
rank remembers, since the last check, which of its values depend on which collective
instruction, and the ranks compare notes once: before a value is read (Fetch, Sync) and at the
end of a batch, with one MAX all_reduce of one int per collective instruction. A value that
depends on a collective whose input was poisoned on any rank becomes poisoned before anyone
can read it. Every rank sees every instruction, so all agree on the numbering and on when to
check. Example::

    >>> w = PoisonWindow(rank=1)
    >>> w.collective("all_gather", src=7, out=8, poisoned=False, member=True)
    >>> w.derive([9], w.depends([8]))
    >>> w.settle(exchange=None)             # nobody was poisoned
    {}
    >>> w.collective("all_gather", src=9, out=10, poisoned=True, member=True)
    >>> w.settle(exchange=None)             # rank 1 itself came in poisoned
    {10: (1, 'all_gather')}
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

# steps that mix data of several ranks (slice and to_partial stay on one rank)
CHECKED_KINDS = frozenset({"all_gather", "all_to_all", "all_reduce", "reduce_scatter",
                           "send_recv"})

_NONE: frozenset = frozenset()


class PoisonWindow:
    """One rank's notes since the last check: what depends on which collective instruction."""

    def __init__(self, rank: int):
        self.rank = rank
        self.count = 0  # collective instructions since the last check (the same on every rank)
        self._lineage: dict[int, frozenset] = {}  # tid -> indices of collectives it depends on
        self._inputs: dict[int, frozenset | None] = {}  # index -> my input's lineage; None: poisoned
        self._kinds: dict[int, str] = {}

    @property
    def pending(self) -> bool:
        """Whether a check is due (every rank gives the same answer at the same instruction)."""
        return self.count > 0

    def collective(self, kind: str, src: int, out: int | None, poisoned: bool,
                   member: bool) -> None:
        """Note one collective instruction; ``member``: this rank took part in it."""
        k = self.count
        self.count += 1
        if not member:
            return
        deps = self._lineage.get(src, _NONE)
        self._inputs[k] = None if poisoned else deps
        self._kinds[k] = kind
        if out is not None:
            self._lineage[out] = deps | {k}

    def depends(self, tids: Iterable[int]) -> frozenset:
        """The collectives any of ``tids`` depends on (empty right after a check: cheap)."""
        if not self._lineage:
            return _NONE
        out = _NONE
        for tid in tids:
            out = out | self._lineage.get(tid, _NONE)
        return out

    def derive(self, outs: Iterable[int], deps: frozenset) -> None:
        """``outs`` were computed from values depending on ``deps``."""
        if deps:
            for tid in outs:
                self._lineage[tid] = deps

    def forget(self, tid: int) -> None:
        self._lineage.pop(tid, None)

    def tracked(self) -> list[int]:
        """Every value that depends on a collective since the last check."""
        return list(self._lineage)

    def settle(self, exchange: Callable[[torch.Tensor], None] | None
               ) -> dict[int, tuple[int, str]]:
        """Compare notes with the other ranks and start a new window.

        ``exchange(flags)`` MAX-all-reduces an int32 tensor in place over all ranks (None: this
        rank alone). Returns ``{tid: (rank whose input was poisoned, collective kind)}`` for
        the values to poison. Usually one exchange; a poisoned input that travelled through
        several collectives takes one more per hop.
        """
        bad: dict[int, int] = {}  # collective index -> rank whose input to it was poisoned
        while True:
            flags = torch.zeros(self.count, dtype=torch.int32)
            for k, deps in self._inputs.items():
                if deps is None or not deps.isdisjoint(bad):
                    flags[k] = self.rank + 1
            if exchange is not None:
                exchange(flags)
            found = {k: v - 1 for k, v in enumerate(flags.tolist()) if v}
            if found.keys() == bad.keys():
                break
            bad = found
        doomed = {}
        for tid, deps in self._lineage.items():
            hit = sorted(deps.intersection(bad))
            if hit:
                doomed[tid] = (bad[hit[0]], self._kinds[hit[0]])
        self.count = 0
        self._lineage, self._inputs, self._kinds = {}, {}, {}
        return doomed
