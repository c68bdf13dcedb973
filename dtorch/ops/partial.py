"""Partial algebra: which elementwise ops may run on Partial operands without a reduction.

An op may run rank-locally on Partial values when the reduction commutes with it: sums with
sums (``P(sum) + P(sum) -> P(sum)``), products by a replicated factor (``P(sum) * R``), and
for max/min, monotone shifts (``P(max) + R -> P(max)``, ``-P(max) -> P(min)``).
``placements`` are per operand for one mesh dim (Python scalars count as ``R``); the result is
the output placement, or None when the op would be wrong on partial values. Example::

    >>> from dtorch import Partial, Replicate
    >>> partial_result("add", [Partial(), Partial()])
    Partial(reduce_op='sum')
    >>> partial_result("add", [Partial(), Replicate()]) is None
    True
    >>> partial_result("mul", [Partial(), Replicate()])
    Partial(reduce_op='sum')
    >>> partial_result("neg", [Partial("max")])
    Partial(reduce_op='min')
"""

from __future__ import annotations

from ..placement import Partial

_FLIP = {"max": "min", "min": "max", "sum": "sum", "avg": "avg"}
LINEAR = ("sum", "avg")

LEGAL = {
    "add": "P(sum)+P(sum) -> P(sum); P(avg) with P(avg) or R -> P(avg); P(max|min) + R -> "
           "P(max|min); P(sum) + R or a scalar is illegal",
    "mul": "P(sum|avg) * R (or a scalar) -> P(sum|avg); P / R -> P; P * P and R / P are illegal",
    "maximum": "maximum(P(max), P(max) or R) -> P(max); minimum likewise with P(min)",
    "where": "where(R cond, P(sum), P(sum)) -> P(sum); with P(avg|max|min) a value may be R",
    "masked_fill": "masked_fill(P(sum), R mask, 0) -> P(sum); P(avg|max|min) with any value",
    "clamp": "clamp(P(max|min), R bounds) -> P(max|min)",
    "linear": "P(sum|avg) -> P(sum|avg)",
    "neg": "-P(sum|avg) -> P(sum|avg); -P(max) -> P(min)",
    "identity": "P(op) -> P(op)",
    "copy": "copy_(P(op) <- P(op)); copy_(P(avg|max|min) <- R)",
    "fill": "fill_ keeps P(avg|max|min); P(sum) is illegal",
    "none": "no Partial input (reduce it first)",
}


_ALIASES = {"sub": "add", "rsub": "add", "div": "mul", "rdiv": "mul", "minimum": "maximum",
            "where_method": "where", "zero": "identity"}


def legal_text(kind: str) -> str:
    return LEGAL.get(_ALIASES.get(kind, kind), LEGAL["none"])


def partial_result(kind: str, placements, scalar=None):
    """The output placement for one mesh dim where some operand is Partial (none Shard)."""
    ops = {p.reduce_op for p in placements if p.is_partial()}
    if len(ops) != 1:
        return None
    r = ops.pop()
    is_p = [p.is_partial() for p in placements]
    n_p = sum(is_p)
    rule = _RULES.get(kind)
    return rule(r, is_p, n_p, scalar) if rule is not None else None


def _add(r, is_p, n_p, _):
    if r == "sum":
        return Partial(r) if all(is_p) else None
    if r == "avg" or n_p == 1:
        return Partial(r)
    return None


def _sub(r, is_p, n_p, _, first=0):
    if r in LINEAR:
        return _add(r, is_p, n_p, None)
    if n_p != 1:
        return None
    return Partial(r) if is_p[first] else Partial(_FLIP[r])


def _rsub(r, is_p, n_p, _):
    return _sub(r, is_p, n_p, None, first=1)


def _mul(r, is_p, n_p, _):
    return Partial(r) if r in LINEAR and n_p == 1 else None


def _div(r, is_p, n_p, _, numerator=0):
    return Partial(r) if r in LINEAR and n_p == 1 and is_p[numerator] else None


def _rdiv(r, is_p, n_p, _):
    return _div(r, is_p, n_p, None, numerator=1)


def _maximum(r, is_p, n_p, _):
    return Partial(r) if r == "max" else None


def _minimum(r, is_p, n_p, _):
    return Partial(r) if r == "min" else None


def _where(r, is_p, n_p, _, cond=0):
    if is_p[cond]:
        return None
    values = [p for i, p in enumerate(is_p) if i != cond]
    if r == "sum":
        return Partial(r) if all(values) else None
    return Partial(r)


def _where_method(r, is_p, n_p, _):
    return _where(r, is_p, n_p, None, cond=1)


def _masked_fill(r, is_p, n_p, scalar):
    if not is_p[0] or any(is_p[1:]):
        return None
    if r == "sum":
        return Partial(r) if scalar == 0 else None
    return Partial(r)


def _clamp(r, is_p, n_p, _):
    return Partial(r) if r in ("max", "min") and is_p[0] and n_p == 1 else None


def _linear(r, is_p, n_p, _):
    return Partial(r) if r in LINEAR else None


def _neg(r, is_p, n_p, _):
    return Partial(_FLIP[r])


def _identity(r, is_p, n_p, _):
    return Partial(r)


def _copy(r, is_p, n_p, _):
    # operands: (self, src); the result is src's value on every rank
    if is_p[1]:
        return Partial(r)
    return Partial(r) if r != "sum" else None


def _fill(r, is_p, n_p, _):
    return Partial(r) if r != "sum" else None


_RULES = {"add": _add, "sub": _sub, "rsub": _rsub, "mul": _mul, "div": _div, "rdiv": _rdiv,
          "maximum": _maximum, "minimum": _minimum, "where": _where,
          "where_method": _where_method, "masked_fill": _masked_fill, "clamp": _clamp,
          "linear": _linear, "neg": _neg, "identity": _identity, "copy": _copy,
          "fill": _fill, "zero": _identity}
