"""Elementwise unary ops and activations: placements are kept.

Shard and Replicate pass through; a Partial input is legal only where the op commutes with
the pending reduction (``neg``, ``clone``, eval-mode ``dropout``: training mode is
:mod:`dtorch.ops.dropout`; see
:mod:`dtorch.ops.partial`). Activations taking ``inplace=True`` mutate their input. Example::

    >>> import torch
    >>> from dtorch.ops.registry import lookup
    >>> lookup(torch.nn.functional.gelu).family, lookup(torch.Tensor.exp_).inplace
    ('activation', True)
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedOpError
from .binary import broadcast_rule, operands_of
from .registry import rule

UNARY = ("abs", "absolute", "acos", "arccos", "acosh", "arccosh", "asin", "arcsin", "asinh",
         "arcsinh", "atan", "arctan", "atanh", "arctanh", "ceil", "cos", "cosh", "deg2rad",
         "rad2deg", "digamma", "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "floor", "frac",
         "lgamma", "log", "log10", "log1p", "log2", "logit", "i0", "nan_to_num", "reciprocal",
         "round", "rsqrt", "sign", "sgn", "sin", "sinc", "sinh", "sqrt", "square",
         "tan", "trunc", "fix", "bitwise_not", "logical_not", "isnan", "isinf",
         "isposinf", "isneginf", "isfinite", "isreal", "signbit", "__invert__", "__abs__")
ACTIVATIONS = ("relu", "relu6", "gelu", "silu", "sigmoid", "tanh", "softplus", "leaky_relu",
               "elu", "selu", "celu", "mish", "hardswish", "hardsigmoid", "hardtanh",
               "logsigmoid", "softsign", "tanhshrink", "threshold", "hardshrink", "softshrink")
ACTIVATIONS_INPLACE = ("relu_", "elu_", "leaky_relu_", "hardtanh_", "threshold_", "celu_",
                       "selu_", "sigmoid_", "tanh_")


def _inplace_flag(op) -> int | None:
    return 0 if op.arg(None, "inplace", False) else None


def unary_rule(kind: str):
    """A rule keeping the input's placements; Partial per ``kind`` (see dtorch.ops.partial)."""
    def rule_fn(op):
        return broadcast_rule(op, operands_of(op, ("input",)), kind, inplace=_inplace_flag(op))
    rule_fn.__name__ = f"unary_{kind}_rule"
    return rule_fn


_none, _neg, _identity = unary_rule("none"), unary_rule("neg"), unary_rule("identity")

rule(*UNARY, family="unary", arg_names=("input",))(_none)
rule(*(n + "_" for n in UNARY if not n.startswith("_")), family="unary", inplace=True,
     arg_names=("input",))(_none)
rule("neg", "negative", "__neg__", family="unary", arg_names=("input",))(_neg)
rule("neg_", "negative_", family="unary", inplace=True, arg_names=("input",))(_neg)
rule("clone", "detach", "positive", "__pos__", "alias", family="unary",
     arg_names=("input",))(_identity)
rule("detach_", "zero_", family="unary", inplace=True, arg_names=("input",))(_identity)
rule("fill_", family="unary", inplace=True, arg_names=("input", "value"))(unary_rule("fill"))

# complex parts: linear, so P(sum|avg) commutes. A lazy conj view cannot be read back from a
# rank, so the ranks materialize the conjugate (same values).
_linear = unary_rule("linear")
rule("real", "imag", "conj_physical", family="unary", arg_names=("input",))(_linear)
rule("resolve_conj", "resolve_neg", family="unary", arg_names=("input",))(_identity)


@rule("conj", family="unary", arg_names=("input",))
def conj_rule(op):
    return broadcast_rule(op, operands_of(op, ("input",)), "linear", fn=torch.conj_physical)


# activations: F.<name> (and torch.<name> / Tensor.<name> where torch has them)
rule(*ACTIVATIONS, family="activation", arg_names=("input",))(_none)
rule(*ACTIVATIONS_INPLACE, family="activation", inplace=True, arg_names=("input",))(_none)


@rule("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
      "feature_alpha_dropout", family="activation", arg_names=("input", "p", "training"))
def dropout_rule(op):
    """Eval mode: the identity (placements kept, Partial included). Calls on DTensors go to
    :mod:`dtorch.ops.dropout` first, which draws the mask in training; none reaches here."""
    from .dropout import DROPOUTS, draws_mask
    if op.func in DROPOUTS and draws_mask(op.func, op.args, op.kwargs):
        raise UnsupportedOpError(f"{op.name} in training mode reached the eval rule; it runs "
                                 f"through dtorch.ops.dropout")
    return broadcast_rule(op, operands_of(op, ("input",)), "identity",
                          inplace=_inplace_flag(op))
