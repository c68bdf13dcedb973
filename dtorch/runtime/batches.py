"""Building one flush's batches: each rank receives only the instructions it runs.

Pending instructions are cut into *segments*, runs of consecutive instructions with the same
target ranks (``instr.ranks``; every rank for setup, seeds, frees, syncs and random factories,
which keep every rank's generator in step). Each segment is pickled once, with meshes, rank
tuples and planned steps interned (``intern.py``); a rank gets the segments it is in, plus the
definitions of the ids it has not seen. So what a rank receives per op does not grow with the
world size, and a rank outside a sub-mesh receives nothing of its work. Example::

    >>> from dtorch.runtime import messages as m
    >>> from dtorch.runtime.intern import InternTable
    >>> pending = [m.Free((1,)), m.Fetch(1, 5, (2,)), m.Fetch(2, 6, (2,)), m.Sync(3)]
    >>> out = rank_batches(pending, InternTable(), [set()] * 4)
    >>> {r: out[r].instructions for r in sorted(out)}
    {0: 2, 1: 2, 2: 4, 3: 2}
"""

from __future__ import annotations

import pickle
from typing import NamedTuple

from . import messages as m
from .intern import InternTable, definitions, dumps

# instructions that neither compute nor communicate: a rank whose batch holds only these may
# run it on its channel thread when its interpreter is idle (reads answer sooner)
QUICK = (m.Fetch, m.Sync, m.Free)
REPLAY = True  # runs that repeat travel as a program id and their ids (tests turn it off)


class Segment(NamedTuple):
    """Consecutive instructions for the same ranks (None: every rank), pickled once. ``wire``
    is what the ranks receive: ``(bytes, ids)``, or ``(program id, ids)`` for a run that
    repeated (``intern.py``: the program travels once per rank; ``replay.py`` runs it)."""

    targets: tuple | None
    wire: tuple
    used: frozenset
    quick: bool
    count: int


class RankBatch(NamedTuple):
    """What one rank receives for one flush."""

    definitions: bytes | None
    segments: tuple[tuple, ...]
    quick: bool
    instructions: int

    @property
    def nbytes(self) -> int:
        """The bytes of its definitions, runs and ids (pickled as they travel)."""
        return len(self.definitions or b"") + len(pickle.dumps(self.segments, protocol=5))


def targets_of(instr) -> tuple | None:
    """The ranks that must receive ``instr`` (None: every rank)."""
    if type(instr) is m.Create and instr.all_ranks:
        return None
    return getattr(instr, "ranks", None)


def segments(pending: list, table: InternTable) -> list[Segment]:
    runs: list[tuple] = []
    for instr in pending:
        t = targets_of(instr)
        if runs and (runs[-1][0] is t or runs[-1][0] == t):
            runs[-1][1].append(instr)
        else:
            runs.append((t, [instr]))
    out = []
    for t, instrs in runs:
        data, used, ids = _pickled(instrs, table)
        program = table.program(data) if REPLAY else None
        if program is not None:
            used, data = used | {program}, program
        out.append(Segment(t, (data, ids), frozenset(used),
                           all(type(i) in QUICK for i in instrs), len(instrs)))
    return out


def rank_batches(pending: list, table: InternTable, known: list) -> dict[int, RankBatch]:
    """``{rank: RankBatch}`` for every rank that has something to run.

    Ranks are split into classes that receive the same segments (a segment for every rank
    splits nothing, so the usual flush costs no per-rank work until the end) and know the same
    ids (``known[r]``: ranks with the same history share one set object); each class gets one
    RankBatch."""
    world = len(known)
    segs = segments(pending, table)
    classes = [(list(range(world)), [])]  # (ranks, indices of their segments)
    for i, seg in enumerate(segs):
        if seg.targets is None or len(seg.targets) == world:
            for _, indices in classes:
                indices.append(i)
            continue
        inside = set(seg.targets)
        split = []
        for ranks, indices in classes:
            ins = [r for r in ranks if r in inside]
            if len(ins) == len(ranks):
                indices.append(i)
                split.append((ranks, indices))
                continue
            if ins:
                split.append((ins, indices + [i]))
            split.append(([r for r in ranks if r not in inside], indices))
        classes = split
    out = {}
    for ranks, indices in classes:
        if not indices:
            continue
        mine = [segs[i] for i in indices]
        used = set().union(*(s.used for s in mine))
        by_history: dict[int, list[int]] = {}
        for r in ranks:
            by_history.setdefault(id(known[r]), []).append(r)
        for members in by_history.values():
            seen = known[members[0]]
            new = used - seen
            batch = RankBatch(definitions(table, sorted(new)) if new else None,
                              tuple(s.wire for s in mine), all(s.quick for s in mine),
                              sum(s.count for s in mine))
            now_known = seen | new if new else seen
            for r in members:
                out[r] = batch
                known[r] = now_known
    return out


def _raise_unsendable(message: str):
    raise TypeError(message)


def _pickled(instructions: list, table: InternTable) -> tuple[bytes, set, tuple]:
    """The segment as bytes; an instruction pickle cannot send becomes one that fails on the
    ranks with the reason (its outputs poisoned), so the rest of the batch still goes."""
    try:
        return dumps(instructions, table)
    except Exception:  # noqa: BLE001 - find the culprits below
        pass
    out = []
    for instr in instructions:
        try:
            dumps(instr, table)
            out.append(instr)
        except Exception as exc:  # noqa: BLE001
            outs = getattr(instr, "outs", None) or (getattr(instr, "out", None),)
            out.append(m.Call(tuple(t for t in outs if t is not None), _raise_unsendable,
                              (f"{type(instr).__name__} could not be sent to the ranks: "
                               f"{type(exc).__name__}: {exc}",), {},
                              getattr(instr, "ranks", ())))
    return dumps(out, table)


def unpickle_segments(batch, rank_table: dict) -> list:
    """On a rank: the instructions of a received batch, in order (definitions first); a
    repeated run stays one ``Run`` item (``replay.py``)."""
    from .intern import loads
    from .replay import Run
    definitions_, segs = batch
    if definitions_:
        rank_table.update(pickle.loads(definitions_))
    out = []
    for data, ids in segs:
        if type(data) is bytes:
            out.extend(loads(data, rank_table, ids))
        else:
            out.append(Run(data, ids))
    return out
