"""Fan-out that does not grow with the world: the controller hands a flush to at most
``fanout`` ranks, and each relays to the heads of its sub-blocks.

The ranks are split into at most ``fanout`` contiguous blocks; the first rank of a block is its
head. The controller sends each head a :class:`Relay`: the batches of every rank in its block
(each distinct batch once, by index) and their sequence numbers. A head forwards, to the head
of each of its sub-blocks (the rest of its block, split the same way), the routes of that
sub-block, then queues its own batch. A relay unpickles the envelope only: the batches'
instructions stay bytes until the rank they are for runs them. Worlds up to ``fanout`` ranks
keep the direct path (one ``Batch`` per rank). Example::

    >>> top_blocks(10, 3)
    [range(0, 4), range(4, 7), range(7, 10)]
    >>> sub_blocks(range(0, 4), 3)
    [range(1, 2), range(2, 3), range(3, 4)]
    >>> [parent_of(r, 10, 3) for r in range(10)]
    [None, 0, 0, 0, None, 4, 4, None, 7, 7]
"""

from __future__ import annotations

import bisect
import os
from typing import NamedTuple

DEFAULT_FANOUT = 32


def fanout_setting() -> int:
    """``DTORCH_FANOUT`` (default 32): the most ranks the controller sends a flush to."""
    value = os.environ.get("DTORCH_FANOUT", str(DEFAULT_FANOUT))
    try:
        fanout = int(value)
    except ValueError:
        fanout = 0
    if fanout < 2:
        raise ValueError(f"DTORCH_FANOUT={value!r}: give an integer of at least 2 (the most "
                         f"ranks the controller sends a flush to; default {DEFAULT_FANOUT})")
    return fanout


def split(block: range, parts: int) -> list[range]:
    """``block`` in at most ``parts`` contiguous, nearly equal, non-empty ranges."""
    n = len(block)
    parts = min(parts, n)
    out, start = [], block.start
    for i in range(parts):
        size = n // parts + (1 if i < n % parts else 0)
        out.append(range(start, start + size))
        start += size
    return out


def top_blocks(world: int, fanout: int) -> list[range]:
    """The blocks whose heads the controller sends to (every rank alone when the world fits
    within ``fanout``)."""
    return split(range(world), fanout)


def sub_blocks(block: range, fanout: int) -> list[range]:
    """The blocks a head relays to: the rest of its block, split the same way."""
    return split(range(block.start + 1, block.stop), fanout) if len(block) > 1 else []


def block_of(rank: int, world: int, fanout: int) -> range:
    """The block whose head ``rank`` is."""
    blocks = top_blocks(world, fanout)
    while True:
        block = blocks[bisect.bisect_right([b.start for b in blocks], rank) - 1]
        if block.start == rank:
            return block
        blocks = sub_blocks(block, fanout)


def parent_of(rank: int, world: int, fanout: int) -> int | None:
    """The rank that relays to ``rank``; None for the heads the controller sends to."""
    blocks, parent = top_blocks(world, fanout), None
    while True:
        block = blocks[bisect.bisect_right([b.start for b in blocks], rank) - 1]
        if block.start == rank:
            return parent
        parent, blocks = block.start, sub_blocks(block, fanout)


class Relay(NamedTuple):
    """The batches of a block: ``routes`` are ``(first rank, past the last, seq, batch
    index, quick, staged)``, sorted and disjoint, one per run of consecutive ranks that get
    the same batch with the same sequence number (a rank with staged shards has its own);
    ``batches`` each distinct ``(definitions, segments)`` once; with ``ack`` each rank answers
    once it holds its batch."""

    routes: tuple
    batches: tuple
    ack: int | None = None


def relay_for(block: range, routes: list, batches: tuple, ack) -> Relay:
    """The Relay of the routes that fall in ``block`` (cut at its ends), with only the
    batches they use, re-indexed."""
    first = bisect.bisect_right(routes, block.start, key=lambda r: r[1])  # ends past start
    used: dict[int, int] = {}
    mine = []
    for start, stop, seq, i, quick, staged in routes[first:]:
        if start >= block.stop:
            break
        mine.append((max(start, block.start), min(stop, block.stop), seq,
                     used.setdefault(i, len(used)), quick, staged))
    return Relay(tuple(mine), tuple(batches[i] for i in used), ack)


def route_of(relay: Relay, rank: int) -> tuple | None:
    """The route of ``relay`` that holds ``rank``, or None."""
    i = bisect.bisect_right(relay.routes, rank, key=lambda r: r[0]) - 1
    if i >= 0 and relay.routes[i][1] > rank:
        return relay.routes[i]
    return None


def plan_flush(batches: dict, seqs: dict, staged: dict, world: int, fanout: int,
               ack=None) -> list[tuple[int, Relay]]:
    """``[(head rank, Relay)]``: what the controller sends for one flush in a world larger
    than ``fanout`` (``batches``: ``{rank: RankBatch}``, shared objects for ranks that get
    the same; ``seqs``: each rank's sequence number for it). Ranks with the same batch and
    sequence number travel as one range, so a flush for every rank costs the same at any size.

    >>> from dtorch.runtime.batches import RankBatch
    >>> b = RankBatch(None, (), False, 1)
    >>> [(head, [route[:2] for route in r.routes], len(r.batches)) for head, r in
    ...  plan_flush({r: b for r in range(10)}, {r: 0 for r in range(10)}, {}, 10, 3)]
    [(0, [(0, 4)], 1), (4, [(4, 7)], 1), (7, [(7, 10)], 1)]
    """
    index: dict[int, int] = {}
    distinct = []
    routes: list = []
    last = None  # the open run: [start, stop, seq, batch index, quick, batch object]
    for rank in sorted(batches):
        batch, seq, mine = batches[rank], seqs[rank], staged.get(rank) or None
        if last is not None and mine is None and last[1] == rank and last[5] is batch \
                and last[2] == seq:
            last[1] = rank + 1
            continue
        i = index.get(id(batch))
        if i is None:
            i = index[id(batch)] = len(distinct)
            distinct.append((batch.definitions, batch.segments))
        if last is not None:
            routes.append(tuple(last[:5]) + (last[6],))
        last = [rank, rank + 1, seq, i, batch.quick, batch if mine is None else None, mine]
    if last is not None:
        routes.append(tuple(last[:5]) + (last[6],))
    distinct = tuple(distinct)
    out = []
    for block in top_blocks(world, fanout):
        relay = relay_for(block, routes, distinct, ack)
        if relay.routes:
            out.append((block.start, relay))
    return out
