"""The poison flag every collective carries inside its own payload.

A rank whose input failed still takes part in each collective (its peers would hang
otherwise) and sets its flag; a rank that receives a set flag poisons its result instead of
keeping zeros. The flag is one more element of the collective's own data type: appended to
each gathered or exchanged chunk, or reduced with the data under codes that survive the
reduction. So one step is one collective. Example::

    >>> flag_codes("min")  # min-reduce: 0 wins, so 0 is the poisoned code
    (1, 0)
    >>> wire_for_reduction(torch.uint8, "sum", 512)  # 256 summed flags would wrap a uint8
    torch.int32
    >>> first_flagged(torch.tensor([0., 0., 1., 0.]), group=(7, 5, 6, 4), slots=[3, 1, 2, 0])
    6
"""

from __future__ import annotations

import torch

# (normal, poisoned) flag values per reduction, so the reduced flag says whether any was poisoned
_FLAG_CODES = {"sum": (0, 1), "avg": (0, 1), "max": (0, 1), "min": (1, 0)}


def flag_codes(op: str) -> tuple[int, int]:
    """``(normal, poisoned)`` flag values for a reduction ``op``."""
    return _FLAG_CODES[op]


def wire_for_reduction(dtype: torch.dtype, op: str, n: int) -> torch.dtype:
    """The dtype a reduction over ``n`` ranks runs in so that its flag cannot wrap.

    An 8-bit integer sum of 256 set flags is 0 again: groups that large sum 8-bit integers
    as int32 (the same sum modulo 256 once cast back). Float flags cannot wrap."""
    if op in ("sum", "avg") and dtype.itemsize == 1 and not dtype.is_floating_point and n >= 256:
        return torch.int32
    return dtype


def reduced_flag(flag: torch.Tensor, op: str) -> bool:
    """Whether the reduced flag element says some member was poisoned."""
    return flag.item() != _FLAG_CODES[op][0]


def flag_element(dtype: torch.dtype, poisoned: bool, device=None) -> torch.Tensor:
    """A one-element tensor of ``dtype``: 1 when this rank is poisoned, else 0 (gathered or
    exchanged flags are not summed: any dtype holds them)."""
    return torch.full((1,), int(poisoned), dtype=dtype, device=device)


def first_flagged(flags: torch.Tensor, group, slots) -> int | None:
    """The rank of the first collective slot whose flag is set, or None.

    ``flags[j]`` came from collective slot j; ``slots[j]`` is that member's index in
    ``group``."""
    hit = torch.nonzero(flags.cpu()).flatten()  # one device sync, not two
    return group[slots[int(hit[0])]] if hit.numel() else None


def flagged_row(size: int, dtype: torch.dtype) -> int:
    """Elements of one chunk: ``size`` data elements, then the flag (filling the rest), rounded
    up to 64 bytes so that every chunk of a stacked buffer starts aligned (gloo moves aligned
    chunks faster: 16 MB all_to_all 8.3 vs 10.3 ms with odd-sized rows).

    >>> flagged_row(1000, torch.float32), flagged_row(0, torch.float64)
    (1008, 8)
    """
    per = max(1, 64 // dtype.itemsize)
    return -(-(size + 1) // per) * per
