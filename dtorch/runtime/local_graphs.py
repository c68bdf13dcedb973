"""The rank side of autograd: ops run with autograd on, their local graphs kept under the
controller's node id, and ``torch.autograd.grad`` on them when the controller's backward
reaches the node (``RecordedCall``, ``Backward``, recorded ``Eager``). No collectives here:
gradients move between nodes as planned redistributes. A mixin of the ``Interpreter``, which
gives ``store``, ``graphs``, ``_fail`` and ``_resolve``."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

from . import messages as m
from .poison import Poison


def tensors_of(result, expected: int) -> list:
    """The output tensors of an op: one tensor, or the tensors of a tuple/list/namedtuple
    (a one-element ``split`` result too); their number must be what the controller planned."""
    if not expected:  # run for its effect (a test's busy rank, say)
        return []
    if expected == 1 and isinstance(result, torch.Tensor):  # the common case, first
        return [result]
    outs = list(result) if isinstance(result, (tuple, list)) else [result]
    if len(outs) != expected or not all(isinstance(o, torch.Tensor) for o in outs):
        raise TypeError(f"the op returned {type(result).__name__} with {len(outs)} values; the "
                        f"controller planned {expected} tensors")
    return outs


class LocalGraph(NamedTuple):
    """A recorded op's local autograd graph: the leaves (one per input that requires grad,
    in ``grad_tids`` order) and the op's outputs, still attached to the graph."""

    leaves: tuple
    outputs: tuple

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.leaves + self.outputs)


def _overlaps(t: torch.Tensor) -> bool:
    """Whether elements of ``t`` share memory (an expanded, stride-0 dim of size > 1)."""
    return any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape))


class LocalGraphs:
    """The Interpreter's handlers for recorded ops and their backward."""

    def _recorded_call(self, instr: m.RecordedCall):
        """Run the op with autograd on and keep its local graph (see RecordedCall)."""
        if self.rank not in instr.ranks:
            return
        try:
            outs, graph = self._run_recorded(instr)
        except Exception as exc:  # noqa: BLE001
            outs = [self._fail(getattr(instr.fn, "__name__", str(instr.fn)), exc)] * len(
                instr.outs)
            graph = outs[0] if outs else None
        if graph is not None:
            self.graphs[instr.node] = graph
        for tid, value in zip(instr.outs, outs):
            self.store[tid] = value

    def _run_recorded(self, instr: m.RecordedCall):
        leaves = {}
        for tid in instr.grad_tids:
            value = self.store[tid]
            if isinstance(value, Poison):
                return [value] * len(instr.outs), value
            leaves[tid] = value.detach().requires_grad_()
        subst = dict(leaves)
        target = None
        if instr.inplace is not None:  # mutate a clone: a leaf cannot be mutated in place
            target = self.store[instr.inplace]
            if not isinstance(target, Poison):
                base = leaves.get(instr.inplace, target)
                with torch.enable_grad():
                    subst[instr.inplace] = base.clone() if base.requires_grad else \
                        base.detach().clone()
        self._poisoned_arg = None
        args, kwargs = self._resolve(instr.args, subst), self._resolve(instr.kwargs, subst)
        if self._poisoned_arg is not None:
            return [self._poisoned_arg] * len(instr.outs), self._poisoned_arg
        with torch.enable_grad():
            outs = tensors_of(instr.fn(*args, **kwargs), len(instr.outs))
        stored = [o.detach() for o in outs]
        if target is not None:
            with torch.no_grad():  # bumps the version counter graphs that saved it check
                target.copy_(stored[0])
            stored[0] = target
        return stored, LocalGraph(tuple(leaves.values()), tuple(outs))

    def _backward(self, instr: m.Backward):
        """``torch.autograd.grad`` on a kept local graph (see Backward); no collectives."""
        if self.rank not in instr.ranks:
            return
        graph = self.graphs.get(instr.node) if instr.retain else self.graphs.pop(instr.node,
                                                                                   None)
        try:
            grads = self._run_backward(instr, graph)
        except Exception as exc:  # noqa: BLE001 - torch's own error, as a value
            grads = [self._fail("backward", exc)] * len(instr.outs)
        for tid, value in zip(instr.outs, grads):
            self.store[tid] = value

    def _run_backward(self, instr: m.Backward, graph):
        if graph is None:
            raise RuntimeError(f"the local graph of node {instr.node} is gone (freed, or "
                               f"backward already ran without retain_graph)")
        if isinstance(graph, Poison):
            return [graph] * len(instr.outs)
        outputs, cotangents = [], []
        for index, tid in instr.grads:
            g = self.store.get(tid)
            if g is None:
                raise KeyError(f"gradient tensor {tid} not found")
            if isinstance(g, Poison):
                return [g] * len(instr.outs)
            out = graph.outputs[index]
            if not out.requires_grad:  # e.g. an empty shard's identity: no contribution
                continue
            scale = instr.out_scales[index]
            outputs.append(out)
            cotangents.append(g if scale is None else g * scale)
        if outputs:
            found = torch.autograd.grad(outputs, graph.leaves, cotangents,
                                        retain_graph=instr.retain, allow_unused=True)
        else:
            found = [None] * len(graph.leaves)
        result = []
        for leaf, g, scale in zip(graph.leaves, found, instr.in_scales):
            if g is None or g._is_zerotensor():  # unused, or torch's lazy zeros (sgn')
                g = torch.zeros_like(leaf, requires_grad=False)
            elif _overlaps(g):  # sum's gradient is one value expanded: an in-place op on
                g = g.contiguous()  # a ``.grad`` (clipping, zero_) needs its own memory
            result.append(g if scale is None else g * scale)
        return result

    def _eager_recorded(self, instr: m.Eager):
        """An eager op with autograd on: its graph kept under ``instr.node``, its result
        stored detached (the Unflatten that follows splits it)."""
        try:
            leaves = {}
            for tid in instr.grad_tids:
                value = self.store[tid]
                if isinstance(value, Poison):
                    raise RuntimeError(f"an input failed: {value.failure.message}")
                leaves[tid] = value.detach().requires_grad_()
            self._poisoned_arg = None
            args = self._resolve(instr.args, leaves)
            kwargs = self._resolve(instr.kwargs, leaves)
            if self._poisoned_arg is not None:
                raise RuntimeError(f"an input failed: {self._poisoned_arg.failure.message}")
            with torch.enable_grad():
                result = instr.fn(*args, **kwargs)
            outputs = tuple(v for v in pytree.tree_leaves(result) if isinstance(v, torch.Tensor))
            self.graphs[instr.node] = LocalGraph(tuple(leaves.values()), outputs)
            self.store[instr.out] = pytree.tree_map(
                lambda v: v.detach() if isinstance(v, torch.Tensor) else v, result)
        except Exception as exc:  # noqa: BLE001
            poison = self._fail(getattr(instr.fn, "__name__", "op"), exc)
            self.store[instr.out] = poison
            self.graphs[instr.node] = poison
