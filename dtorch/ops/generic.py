"""The all-Replicate rule: any deterministic torch function runs when every DTensor input is
Replicate on one mesh, dedicated rule or not.

Every rank then holds the whole of every input, so every rank computes the whole output and
the outputs are Replicate; nothing moves. Ops whose outputs depend on the values (``nonzero``,
``unique``, ``allclose``: torch cannot infer them on ``meta``) run *eagerly*: one round trip
in which a rank reports what came out. Ops with random results raise, since each rank's torch
generator would draw its own numbers. Example::

    >>> from types import SimpleNamespace as Spec
    >>> from dtorch import Replicate, Partial
    >>> all_replicate([Spec(placements=(Replicate(), Replicate()))])
    True
    >>> all_replicate([Spec(placements=(Replicate(), Partial()))])
    False
    >>> import torch
    >>> random_reason(torch.bernoulli, (None,), {})
    'torch.bernoulli draws random numbers'
"""

from __future__ import annotations

import functools
import importlib
import pickle
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from ..errors import UnsupportedOpError
from ..runtime import messages as m
from .registry import display_name

_ALWAYS_RANDOM = [
    torch.bernoulli, torch.normal, torch.multinomial, torch.poisson, torch.rand_like,
    torch.randn_like, torch.randint_like, F.gumbel_softmax, F.fractional_max_pool2d,
    F.fractional_max_pool3d, torch.Tensor.bernoulli, torch.Tensor.bernoulli_,
    torch.Tensor.normal_, torch.Tensor.multinomial, torch.Tensor.uniform_,
    torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.geometric_,
    torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.svd_lowrank, torch.pca_lowrank,
    getattr(F, "fractional_max_pool2d_with_indices", None),
    getattr(F, "fractional_max_pool3d_with_indices", None)]
# (dropout in training draws from dtorch's counter-based stream: dtorch.ops.dropout)
_RANDOM_WHEN_TRAINING = {F.rrelu: 3, torch.rrelu: 3}
_DEFAULT_TRAINING = {F.rrelu: False, torch.rrelu: False}
_RANDOM_WHEN = {  # other random cases: func -> predicate(args, kwargs)
    F.multi_head_attention_forward: lambda a, k: (
        k.get("dropout_p", a[10] if len(a) > 10 else 0) > 0
        and k.get("training", a[13] if len(a) > 13 else True)),
}


_HOMES = (("torch", torch), ("torch.Tensor", torch.Tensor), ("torch.nn.functional", F),
          ("torch.linalg", torch.linalg), ("torch.special", torch.special), ("torch.fft", torch.fft))


class ByName(NamedTuple):
    """A torch callable sent by where it lives, for the ones pickle cannot send by reference
    (``torch.unique`` is a local function of ``boolean_dispatch``)."""

    home: str
    name: str

    @property
    def __name__(self) -> str:
        return self.name

    def __call__(self, *args, **kwargs):
        home = torch.Tensor if self.home == "torch.Tensor" else importlib.import_module(self.home)
        return getattr(home, self.name)(*args, **kwargs)


class AtenOp(NamedTuple):
    """A ``torch.ops`` operator sent by name (``torch.ops.aten.slice.Tensor``)."""

    namespace: str
    name: str
    overload: str | None

    @property
    def __name__(self) -> str:
        return self.name

    def __call__(self, *args, **kwargs):
        packet = getattr(getattr(torch.ops, self.namespace), self.name)
        return (getattr(packet, self.overload) if self.overload else packet)(*args, **kwargs)


def _aten(fn):
    if isinstance(fn, torch._ops.OpOverload):
        return AtenOp(fn.namespace, fn._schema.name.split("::")[-1], fn._overloadname)
    if isinstance(fn, torch._ops.OpOverloadPacket):
        namespace, name = fn._qualified_op_name.split("::")
        return AtenOp(namespace, name, None)
    return None


def picklable(fn):
    """``fn`` itself when pickle can send it, else a :class:`ByName` that finds it on the rank.

    >>> picklable(torch.add) is torch.add, picklable(torch.unique)
    (True, ByName(home='torch', name='unique'))
    """
    try:
        pickle.dumps(fn)
        return fn
    except Exception:  # noqa: BLE001 - pickle raises several types
        pass
    aten = _aten(fn)
    if aten is not None:
        return aten
    name = getattr(fn, "__name__", None)
    for home, ns in _HOMES:
        if name and getattr(ns, name, None) is fn:
            return ByName(home, name)
    dunder = _tensor_dunders().get(id(fn))
    if dunder is not None:  # torch.Tensor.__pow__ is a wrapper named "pow": send it by slot
        return ByName("torch.Tensor", dunder)
    raise UnsupportedOpError(f"{display_name(fn)} cannot be sent to the ranks (pickle cannot "
                             f"find it by name); call a torch function instead")


@functools.lru_cache(maxsize=1)
def _tensor_dunders() -> dict:
    """``{id(torch.Tensor.__pow__): "__pow__", ...}``: operator slots by identity."""
    return {id(v): k for k, v in vars(torch.Tensor).items()
            if k.startswith("__") and k.endswith("__") and callable(v)}


def all_replicate(tensors) -> bool:
    """Whether every input (TArgs or DTensors: anything with ``placements``) is Replicate on
    every mesh dim."""
    return all(p.is_replicate() for t in tensors for p in t.placements)


def random_reason(func, args, kwargs) -> str | None:
    """Why ``func(*args, **kwargs)`` has random results, or None when it is deterministic."""
    if func in _ALWAYS_RANDOM:
        return f"{display_name(func)} draws random numbers"
    when = _RANDOM_WHEN.get(func)
    if when is not None and when(args, kwargs):
        return f"{display_name(func)} with dropout in training mode draws random numbers"
    pos = _RANDOM_WHEN_TRAINING.get(func)
    if pos is not None:
        training = kwargs.get("training", args[pos] if len(args) > pos else
                              _DEFAULT_TRAINING.get(func, True))
        if training:
            return f"{display_name(func)} with training=True draws random numbers"
    return None


def random_error(func, args, kwargs):
    """The UnsupportedOpError for a call with random results (whatever the placements), or
    None when it is deterministic."""
    why = random_reason(func, args, kwargs)
    if why is None:
        return None
    return UnsupportedOpError(
        f"{why}, and each rank's generator would draw different ones. Make random values "
        f"with dtorch.rand / dtorch.randn / dtorch.randint (the same values as torch under "
        f"dtorch.manual_seed, whatever the placements), or gather with .to_torch()")


def run_eager(controller, func, cargs, ckwargs, mesh, wrap, node=None, grad_tids=(),
              requires_grad=None):
    """Run ``func`` on every rank of ``mesh`` now and return its result with DTensors
    (``wrap(shape, dtype, tid)``) in place of the output tensors: one round trip. With
    ``node``, the ranks keep its autograd graph (see ``Eager``) and ``requires_grad`` (a
    list) receives, per output tensor, whether it requires grad there."""
    from ..runtime.controller import remote_error
    raw = controller.new_tid()
    ranks = mesh.ranks
    answers = controller.wait(controller.request(
        lambda req: m.Eager(req, raw, func, tuple(cargs), ckwargs, ranks, ranks[0], node,
                            tuple(grad_tids)), [ranks[0]]))
    status, value = answers[ranks[0]]
    if status != "ok":
        controller.issue(m.Free((raw,)))
        raise remote_error(value, f"running {display_name(func)}")
    with warnings.catch_warnings():  # torch warns about its own LeafSpec when unpickling
        warnings.simplefilter("ignore", FutureWarning)
        spec, leaves = pickle.loads(value)
    layouts = {leaf[3] for leaf in leaves if leaf[0] == "tensor"} - {"torch.strided"}
    if layouts:
        controller.issue(m.Free((raw,)))
        refuse_layout(func, layouts.pop())
    if requires_grad is not None:
        requires_grad.extend(bool(leaf[4]) if len(leaf) > 4 else False
                             for leaf in leaves if leaf[0] == "tensor")
    tids = tuple(controller.new_tid() for kind, *_ in leaves if kind == "tensor")
    controller.issue(m.Unflatten(raw, tids, ranks))
    tid_iter = iter(tids)
    values = [wrap(leaf[1], leaf[2], next(tid_iter)) if leaf[0] == "tensor" else leaf[1]
              for leaf in leaves]
    return pytree.tree_unflatten(values, spec)


def refuse_layout(func, layout) -> None:
    """Raise: ``func`` returns a tensor of a non-strided ``layout`` (sparse, ...)."""
    raise UnsupportedOpError(f"{display_name(func)} returns a {layout} tensor; DTensors are "
                             f"dense (strided). Keep the dense tensor, or gather with "
                             f".to_torch() and convert there")
