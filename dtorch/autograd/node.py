"""The controller's autograd graph: one node per recorded op, edges to the nodes (or leaves)
that made its inputs.

A DTensor that requires grad carries an :class:`AutogradMeta` (``x._ag``): its flag, its
``.grad``, and for a non-leaf the node that made it (``grad_fn``) and which output it is. A
node holds what backward needs: the specs of its inputs and outputs, one :class:`Edge` per
input that requires grad, and, for an op node, the id under which every rank keeps the op's
local graph. A node's ids increase in forward order, so decreasing ids are a reverse
topological order. When a node is garbage-collected, the ranks drop its local graph (with the
next batch, like a freed tensor). Example::

    y = x * 2            # x requires grad
    y.grad_fn.name()     # 'MulBackward0'
    y.grad_fn.next_functions   # ((AccumulateGrad, 0),)
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

from . import cotangent


NAMES_CHANGED = [0]  # bumped when a parameter may need naming again (a module tree changed)


class AutogradMeta:
    """The autograd state of one DTensor handle."""

    __slots__ = ("requires_grad", "grad", "grad_fn", "output_nr", "retains_grad", "hooks",
                 "name", "__weakref__")

    def __init__(self, requires_grad: bool = True, grad_fn=None, output_nr: int = 0):
        self.requires_grad = requires_grad
        self.grad = None
        self.grad_fn = grad_fn
        self.output_nr = output_nr
        self.retains_grad = False
        self.hooks: OrderedDict | None = None  # handle id -> fn(grad) -> grad or None
        self.name: str | None = None  # a parameter's name in the module that last ran it


class Edge(NamedTuple):
    """Where an input's gradient goes: output ``index`` of ``node``, or the leaf ``leaf``."""

    node: object | None
    index: int
    leaf: AutogradMeta | None


class AccumulateGrad:
    """What ``next_functions`` shows for a leaf (torch's name); ``variable`` is its meta."""

    def __init__(self, leaf: AutogradMeta):
        self.variable = leaf

    def name(self) -> str:
        return "torch::autograd::AccumulateGrad"


class Node:
    """A recorded op (or redistribute) on the controller; see the module doc."""

    __slots__ = ("id", "_name", "controller", "mesh", "in_specs", "out_specs", "edges",
                 "out_metas", "released", "keeps_graph", "refusal", "saved", "backward",
                 "pre_hooks", "partial_grads", "out_hooks", "__weakref__")

    def __init__(self, node_id: int, name: str, controller, mesh, in_specs, out_specs, edges,
                 keeps_graph: bool, refusal: str | None = None, backward=None):
        self.id, self._name, self.controller, self.mesh = node_id, name, controller, mesh
        self.in_specs, self.out_specs, self.edges = tuple(in_specs), tuple(out_specs), \
            tuple(edges)
        self.out_metas: list = [None] * len(self.out_specs)  # weakrefs to the outputs' metas
        self.released = False
        self.keeps_graph = keeps_graph
        self.refusal = refusal  # why backward cannot go through this node (None: it can)
        self.saved: tuple = ()  # (version counter, version, spec, which) per saved tensor
        self.backward = backward  # a composite's backward(node, grads, retain) -> grads, or None
        self.pre_hooks: list | None = None  # fn() run once its gradients are in, before it runs
        self.partial_grads = False  # its backward takes gradients as they come (Partial too)
        self.out_hooks: dict | None = None  # output index -> its hooks (kept past the handle)

    def name(self) -> str:
        return self._name

    @property
    def next_functions(self) -> tuple:
        return tuple((e.node, e.index) if e.node is not None else (AccumulateGrad(e.leaf), 0)
                     for e in self.edges)

    def attach(self, index: int, meta: AutogradMeta) -> None:
        self.out_metas[index] = weakref.ref(meta)

    def keep_hooks(self, index: int, hooks) -> None:
        """Output ``index``'s hooks live with the node, as torch's do on a ``grad_fn``: a
        hook registered on an activation inside a forward runs though its handle is gone."""
        if self.out_hooks is None:
            self.out_hooks = {}
        self.out_hooks[index] = hooks

    def hooks_of(self, index: int):
        """The hooks registered on output ``index`` (None: none)."""
        if self.out_hooks is not None and index in self.out_hooks:
            return self.out_hooks[index]
        meta = self.output_meta(index)
        return meta.hooks if meta is not None else None

    def output_meta(self, index: int) -> AutogradMeta | None:
        ref = self.out_metas[index]
        return ref() if ref is not None else None

    def incoming(self, index: int) -> tuple:
        """The placements output ``index``'s gradient must have."""
        return cotangent.incoming_placements(self.out_specs[index].placements)

    def release(self) -> None:
        """The graph is spent (backward without retain_graph): the ranks dropped it."""
        self.released = True

    def __del__(self):
        c = self.controller
        if self.keeps_graph and not self.released and c is not None and not c.closed:
            c.release_graph(self.id, self.mesh.ranks)

    def __repr__(self) -> str:
        return f"<{self._name} node {self.id}>"


def edge_of(t) -> Edge:
    """The edge to the producer of DTensor ``t`` (which requires grad)."""
    meta = t._ag
    if meta.grad_fn is None:
        return Edge(None, 0, meta)
    return Edge(meta.grad_fn, meta.output_nr, None)


def mark_output(t, node: Node, index: int) -> None:
    """Make DTensor ``t`` output ``index`` of ``node`` (a fresh meta: an in-place op gives its
    target a new history)."""
    meta = AutogradMeta(True, node, index)
    t._ag = meta
    node.attach(index, meta)
