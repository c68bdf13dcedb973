"""The reverse walk: backward on the controller's graph, as planned instructions.

Nodes are visited in decreasing id (a reverse topological order: every edge points to an
older node). Per node, the incoming gradients of each output are summed (equal placements
first) and brought to the placements the node needs (a planned, counted redistribute), then
one ``Backward`` instruction runs ``torch.autograd.grad`` on every rank's local graph; the
input gradients come back with the placements of :mod:`dtorch.autograd.cotangent`. A
redistribute node's backward is the redistribute back. A leaf's gradient is brought to the
leaf's placements (DP's all_reduce, FSDP's reduce_scatter) and accumulated into ``.grad``.
Everything a user can get wrong is checked before the first instruction is issued. The
collectives of a backward are marked ``phase="backward"`` in CommDebugMode. Example::

    run_backward(loss, None, retain_graph=False, create_graph=False)
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .. import comm_debug
from ..runtime import messages as m
from . import buckets, cotangent, versions
from .node import AutogradMeta, Node
from .redistribute import grad_target

_SECOND_TIME = (
    "Trying to backward through the graph a second time (or directly access saved tensors "
    "after they have already been freed). Saved intermediate values of the graph are freed "
    "when you call .backward() or autograd.grad(). Specify retain_graph=True if you need to "
    "backward through the graph a second time or if you need to access saved tensors after "
    "calling backward.")


def _as_tuple(x) -> tuple:
    from ..tensor import DTensor
    if x is None:
        return ()
    if isinstance(x, (DTensor, torch.Tensor)):
        return (x,)
    return tuple(x)


def _no_create_graph(create_graph) -> None:
    if create_graph:
        raise NotImplementedError("create_graph=True (higher-order gradients) is not supported "
                                  "yet on DTensors; compute first-order gradients only")


# checks (before anything is sent) ---------------------------------------------------------------
def _roots(tensors, grad_tensors):
    """``[(root, gradient or None)]`` after torch's checks."""
    from ..tensor import DTensor
    roots = _as_tuple(tensors)
    grads = _as_tuple(grad_tensors) if grad_tensors is not None else (None,) * len(roots)
    if len(grads) != len(roots):
        raise RuntimeError(f"got {len(grads)} gradients for {len(roots)} tensors; give one "
                           f"gradient (or None) per tensor")
    out = []
    for i, (t, g) in enumerate(zip(roots, grads)):
        if not isinstance(t, DTensor):
            raise TypeError(f"element {i} of tensors is a {type(t).__name__}, not a DTensor")
        if not t.requires_grad:
            raise RuntimeError(f"element {i} of tensors does not require grad and does not have "
                               f"a grad_fn")
        if g is None:
            if t.numel() != 1:
                raise RuntimeError(f"grad can be implicitly created only for scalar outputs "
                                   f"(element {i} has shape {tuple(t.shape)}); pass "
                                   f"gradient= of that shape")
            if not t.dtype.is_floating_point:
                raise RuntimeError(f"grad can be implicitly created only for real scalar "
                                   f"outputs but got {t.dtype}")
        else:
            _check_gradient(i, t, g)
        out.append((t, g))
    return out


def _check_gradient(i, t, g) -> None:
    from ..tensor import DTensor
    if not isinstance(g, (DTensor, torch.Tensor)):
        raise TypeError(f"gradient {i} must be a DTensor (or a torch.Tensor), not "
                        f"{type(g).__name__}")
    if tuple(g.shape) != tuple(t.shape):
        raise RuntimeError(f"Mismatch in shape: grad_output[{i}] has a shape of "
                           f"{torch.Size(g.shape)} and output[{i}] has a shape of "
                           f"{torch.Size(t.shape)}. Pass a gradient of the output's shape")
    if isinstance(g, DTensor) and g.device_mesh != t.device_mesh:
        raise RuntimeError(f"gradient {i} lives on {g.device_mesh}, its output on "
                           f"{t.device_mesh}; redistribute it to the output's mesh first")


def _reachable(starts) -> dict:
    """``{node id: node}`` reachable from ``starts`` (nodes)."""
    seen: dict = {}
    stack = [n for n in starts if n is not None]
    while stack:
        node = stack.pop()
        if node.id in seen:
            continue
        seen[node.id] = node
        stack.extend(e.node for e in node.edges if e.node is not None and e.node.id not in seen)
    return seen


def _check_not_released(nodes) -> None:
    if any(n.released for n in nodes.values()):
        raise RuntimeError(_SECOND_TIME)
    for n in nodes.values():
        if n.refusal is not None:
            from ..errors import UnsupportedOpError
            raise UnsupportedOpError(n.refusal)
        versions.check(n)


def _key_of(t):
    """How the walk names a tensor it must capture: its leaf meta, or (node id, output)."""
    meta = t._ag
    return meta if meta.grad_fn is None else (meta.grad_fn.id, meta.output_nr)


def _needed(nodes: dict, targets: set) -> set:
    """Ids of the nodes from which a target is reachable (the others need not run)."""
    needed: set = set()
    for nid in sorted(nodes):
        node = nodes[nid]
        for j, e in enumerate(node.edges):
            if (e.leaf is not None and e.leaf in targets) or (
                    e.node is not None and ((e.node.id, e.index) in targets or
                                            e.node.id in needed)):
                needed.add(nid)
                break
    return needed


# the walk ---------------------------------------------------------------------------------------
class _Walk:
    """One backward: pending gradients per (node id, output) and per leaf."""

    def __init__(self, roots, retain: bool, targets=None, bucket_early: bool = False):
        self.roots = roots
        self.retain = retain
        self.targets = targets  # None: accumulate into leaves; else capture these keys
        self.pending: dict = {}
        self.leaves: dict = {}  # id(meta) -> (meta, spec, [grads])
        self.captured: dict = {}
        self.user_grads: set = set()
        self.bucket_early = bucket_early  # reduce a full bucket as soon as it is ready
        self.buckets = buckets.Bucketer()

    def seed(self) -> None:
        for t, g in self.roots:
            g = self._seed_gradient(t, g)
            meta = t._ag
            if meta.grad_fn is None:
                self.leaves.setdefault(id(meta), (meta, t._spec, []))[2].append(g)
            else:
                self.pending.setdefault((meta.grad_fn.id, meta.output_nr), []).append(g)

    def _seed_gradient(self, t, g):
        from ..factories import ones, tensor
        meta = t._ag
        want = (cotangent.incoming_placements(t.placements) if meta.grad_fn is not None
                else t.placements)
        if g is None:  # ones in the placements needed: made where they are, nothing moves
            return ones(*t.shape, dtype=t.dtype, device_mesh=t.device_mesh, placements=want)
        if isinstance(g, torch.Tensor):
            return tensor(g.detach().to(t.dtype), device_mesh=t.device_mesh,
                          placements=cotangent.incoming_placements(t.placements))
        if g.dtype != t.dtype:
            g = g.to(t.dtype)
        self.user_grads.add(id(g))
        return g

    def run(self, nodes: dict, needed: set | None) -> None:
        waiting = _leaf_edges(nodes) if self.bucket_early else None
        for nid in sorted(nodes, reverse=True):
            self._visit(nodes[nid], needed)
            if waiting is not None:
                self._leaf_edges_done(nodes[nid], waiting)

    def _visit(self, node: Node, needed: set | None) -> None:
        nid = node.id
        grads = self._incoming(node)
        if not grads or (needed is not None and nid not in needed):
            return
        if node.pre_hooks:  # fully_shard gathers the weights the local graphs saved
            for hook in node.pre_hooks:
                hook()
        if node.backward is not None:  # a composite's backward plan (ring attention)
            in_grads = node.backward(node, grads, self.retain)
        elif node.keeps_graph:
            in_grads = _op_backward(node, grads, self.retain)
        else:  # FSDP's reduce_scatter runs here when the input is a parameter
            with comm_debug.gradient_of(_leaf_name(node)):
                in_grads = _redistribute_backward(node, grads)
        for edge, spec, g in zip(node.edges, node.in_specs, in_grads):
            if edge.leaf is not None:
                self.leaves.setdefault(id(edge.leaf), (edge.leaf, spec, []))[2].append(g)
            else:
                self.pending.setdefault((edge.node.id, edge.index), []).append(g)
        if not self.retain and node.keeps_graph:
            node.release()

    def _leaf_edges_done(self, node: Node, waiting: dict) -> None:
        """A registered leaf whose last edge this node was has its final gradient: it joins
        its open bucket, which is reduced once it holds ``cap`` bytes (DDP's overlap: the
        reduction is issued among the rest of the backward)."""
        for edge in node.edges:
            leaf = edge.leaf
            if leaf is None or id(leaf) not in waiting:
                continue
            waiting[id(leaf)] -= 1
            item = self._bucket_item(leaf) if waiting[id(leaf)] == 0 else None
            if item is not None:
                self.buckets.add(item)

    def _bucket_item(self, meta):
        """``(meta, key, summed gradient, name)`` when this leaf's gradient is reduced in a
        bucket, else None."""
        entry = self.leaves.get(id(meta))
        if entry is None or buckets.cap_of(meta) is None or self.buckets.holds(meta) or \
                self.targets is not None or is_deferred(meta):
            return None
        _, spec, grads = entry
        if meta.grad is not None and meta.grad.placements != spec.placements:
            grads = grads + [meta.grad]  # left unreduced by no_sync: reduced with the rest
        key = buckets.bucket_key(meta, spec.placements, grads)
        return None if key is None else (meta, key, combine(grads, None), meta.name)

    def _incoming(self, node: Node) -> dict:
        """``{output index: gradient}`` summed, hooked, retained, captured."""
        out = {}
        for i in range(len(node.out_specs)):
            grads = self.pending.pop((node.id, i), None)
            if not grads:
                continue
            if ((node.keeps_graph or node.backward is not None) and not node.partial_grads) \
                    or len({g.placements for g in grads}) > 1:
                g = combine(grads, node.incoming(i))
            else:
                g = combine(grads, None)
            g = _run_hooks(node.hooks_of(i), g)
            meta = node.output_meta(i)
            if meta is not None:
                if meta.retains_grad and self.targets is None:
                    meta.grad = g if meta.grad is None else meta.grad + g
            if self.targets is not None and (node.id, i) in self.targets:
                self.captured[(node.id, i)] = g
            out[i] = g
        return out

    def finish_leaves(self, accumulate_into=None) -> None:
        """Each leaf's gradient in the leaf's placements (the reduction that costs, planned
        and counted here), hooked, then captured and/or accumulated into ``.grad``. Inside
        ``Module.no_sync()`` a parameter's gradient stays as it arrives (Partial): the first
        backward outside adds it to the new one and reduces once."""
        bucketed = self._bucketed(accumulate_into)
        for meta, spec, grads in self.leaves.values():
            capture = self.targets is not None and meta in self.targets
            accumulate = accumulate_into is None or meta in accumulate_into
            if not (capture or accumulate):
                continue
            deferred = accumulate and not capture and is_deferred(meta)
            old = meta.grad
            if accumulate and not deferred and old is not None and \
                    old.placements != spec.placements:  # left Partial by no_sync: reduce now
                grads, meta.grad = grads + [old], None
            with comm_debug.gradient_of(meta.name):
                if id(meta) in bucketed:  # reduced with others in one collective
                    g = bucketed[id(meta)]
                elif deferred and len({g.placements for g in grads}) == 1:
                    g = combine(grads, None)
                else:
                    g = combine(grads, spec.placements)
            g = _run_hooks(meta.hooks, g)  # what a user's hook runs is not the leaf's reduction
            if capture:
                self.captured[meta] = g
            if accumulate:
                with comm_debug.gradient_of(meta.name):
                    _accumulate(meta, g, id(g) in self.user_grads, deferred)


    def _bucketed(self, accumulate_into) -> dict:
        """Every leaf whose reduction a bucket shares (registered parameters whose gradient
        only needs its Partial dims reduced), reduced: ``{id(meta): gradient}``. Buckets
        still open are reduced now, then the leaves not seen ready during the walk."""
        if accumulate_into is not None:  # backward(inputs=...): each leaf on its own
            return {}
        for meta, _, _ in self.leaves.values():  # those no edge made final (roots), in order
            item = self._bucket_item(meta)
            if item is not None:
                self.buckets.add(item)
        return self.buckets.flush()


_deferred: list = []  # sets of AutogradMeta ids whose reduction Module.no_sync() defers


@contextmanager
def deferring(metas):
    """Inside, the gradients of these leaves accumulate unreduced (``Module.no_sync()``)."""
    ids = {id(meta) for meta in metas}
    _deferred.append(ids)
    try:
        yield
    finally:
        _deferred.remove(ids)


def is_deferred(meta) -> bool:
    return any(id(meta) in ids for ids in _deferred)


def _leaf_edges(nodes: dict) -> dict | None:
    """``{id(leaf): edges into it}`` for the leaves that reduce in buckets (None: none
    registered, nothing to count)."""
    if not buckets.any_registered():
        return None
    out: dict = {}
    for node in nodes.values():
        for edge in node.edges:
            if edge.leaf is not None and buckets.cap_of(edge.leaf) is not None:
                out[id(edge.leaf)] = out.get(id(edge.leaf), 0) + 1
    return out


def combine(grads: list, target):
    """The sum of ``grads``: equal placements summed first, then each sum brought to
    ``target`` (None: the one placement they share) and added."""
    groups: dict = {}
    for g in grads:
        key = g.placements
        groups[key] = g if key not in groups else groups[key] + g
    out = None
    for g in groups.values():
        if target is not None and g.placements != tuple(target):
            g = g._move(g.device_mesh, target)
        out = g if out is None else out + g
    return out


def _run_hooks(hooks, g):
    if not hooks:
        return g
    for hook in list(hooks.values()):
        new = hook(g)
        if new is not None:
            g = new
    return g


def _accumulate(meta: AutogradMeta, g, is_users: bool, deferred: bool = False) -> None:
    if meta.grad is None:
        meta.grad = g.clone() if is_users else g
        return
    if g.placements != meta.grad.placements:
        if deferred:  # the reduced gradient joins the unreduced ones (Replicate -> Partial: local)
            meta.grad = meta.grad._move(g.device_mesh, g.placements)
        else:
            g = g._move(meta.grad.device_mesh, meta.grad.placements)
    # out of place: ``meta.grad`` may be the very handle a hook or retain_grad exposed (a
    # redistribute that moves nothing hands its gradient on as it is)
    meta.grad = meta.grad + g


def _op_backward(node: Node, grads: dict, retain: bool) -> list:
    """One ``Backward`` instruction on every rank of the node's mesh."""
    from ..tensor import DTensor
    from ..spec import make_spec
    c, mesh = node.controller, node.mesh
    carried = [node.out_specs[i].placements for i in grads]
    out_scales = tuple(cotangent.incoming_scale(mesh.shape, s.placements)
                       for s in node.out_specs)
    in_scales = tuple(cotangent.outgoing_scale(mesh.shape, s.placements) for s in node.in_specs)
    tids = tuple(c.new_tid() for _ in node.in_specs)
    c.issue(m.Backward(node.id, tuple((i, g._tid) for i, g in grads.items()), tids, out_scales,
                       in_scales, retain, mesh.ranks))
    return [DTensor._wrap(make_spec(s.shape, s.dtype, mesh,
                                    cotangent.grad_placements(s.placements, carried)), tid, c)
            for s, tid in zip(node.in_specs, tids)]


def _leaf_name(node: Node) -> str | None:
    """The name of the parameter a redistribute node moved (None: not a named leaf)."""
    edge = node.edges[0] if len(node.edges) == 1 else None
    return edge.leaf.name if edge is not None and edge.leaf is not None else None


def _redistribute_backward(node: Node, grads: dict) -> list:
    """The gradient redistributed back to the input's mesh and placements. When the input
    is a parameter inside ``Module.no_sync()`` (or one that left it with an unreduced
    gradient) and the move would only reduce a Partial, the gradient goes on unreduced: the
    leaf reduces once, with what it accumulated (FSDP's no_sync: one reduce_scatter)."""
    mesh, placements = grad_target(node)
    g, leaf = grads[0], node.edges[0].leaf
    if leaf is not None and g.device_mesh == mesh and _only_reduces(g.placements, placements) \
            and (is_deferred(leaf) or (leaf.grad is not None and
                                        leaf.grad.placements == g.placements)):
        return [g]
    return [g._move(mesh, placements)]


def _only_reduces(src, dst) -> bool:
    """Whether moving ``src`` to ``dst`` only reduces Partials (and moves nothing else)."""
    from ..placement import Partial
    return src != tuple(dst) and all(
        a == b or isinstance(a, Partial) for a, b in zip(src, dst))


# entry points -----------------------------------------------------------------------------------
def _start(roots, targets=None):
    """``(nodes, needed)``: the nodes reachable from the roots and the ids of those the walk
    runs (None: all), checked. Only the nodes a gradient goes through are checked, as in
    torch: ``grad(z, y)`` runs even when the graph below ``y`` is spent or has a composite
    without a backward."""
    nodes = _reachable([t._ag.grad_fn for t, _ in roots])
    needed = _needed(nodes, targets) if targets is not None else None
    _check_not_released(nodes if needed is None else {i: nodes[i] for i in needed})
    return nodes, needed


def run_backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False,
                 inputs=None) -> None:
    """``dtorch.autograd.backward``: gradients accumulate into the leaves' ``.grad``."""
    _no_create_graph(create_graph)
    roots = _roots(tensors, grad_tensors)
    targets = None
    if inputs is not None:
        inputs = _as_tuple(inputs)
        if not inputs:
            raise RuntimeError("backward: inputs= must be a non-empty sequence of DTensors")
        for t in inputs:
            if not t.requires_grad:
                raise RuntimeError("One of the differentiated Tensors does not require grad")
            if not t.is_leaf:
                raise RuntimeError("backward(inputs=...) takes leaves only in dtorch")
        targets = {t._ag for t in inputs}
    nodes, needed = _start(roots, targets)
    walk = _Walk(roots, bool(retain_graph), None, bucket_early=targets is None)
    with torch.no_grad(), comm_debug.phase("backward"):
        try:
            walk.seed()
            walk.run(nodes, needed)
            walk.finish_leaves(targets)
        except BaseException:
            walk.buckets.abandon()  # reductions already posted are waited for, then dropped
            raise


def run_grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
             allow_unused: bool = False, materialize: bool = False):
    """``dtorch.autograd.grad``: a tuple with one gradient (or None) per input."""
    from ..factories import zeros
    _no_create_graph(create_graph)
    roots = _roots(outputs, grad_outputs)
    inputs = _as_tuple(inputs)
    if not inputs:
        raise RuntimeError("grad requires non-empty inputs.")
    for t in inputs:
        if not t.requires_grad:
            raise RuntimeError("One of the differentiated Tensors does not require grad")
    keys = [_key_of(t) for t in inputs]
    targets = set(keys)
    nodes, needed = _start(roots, targets)
    for key in keys:
        if not allow_unused and not _is_root(key, roots) and not _feeds(key, nodes):
            raise RuntimeError("One of the differentiated Tensors appears to not have been used "
                               "in the graph. Set allow_unused=True if this is the desired "
                               "behavior.")
    walk = _Walk(roots, bool(retain_graph), targets)
    with torch.no_grad(), comm_debug.phase("backward"):
        walk.seed()
        walk.run(nodes, needed)
        walk.finish_leaves(accumulate_into=set())
    out = []
    for t, key in zip(inputs, keys):
        g = walk.captured.get(key)
        if g is None and materialize:
            g = zeros(*t.shape, dtype=t.dtype, device_mesh=t.device_mesh,
                      placements=t.placements)
        out.append(g)
    return tuple(out)


def _is_root(key, roots) -> bool:
    return any(_key_of(t) is key if type(key) is AutogradMeta else _key_of(t) == key
               for t, _ in roots)


def _feeds(key, nodes: dict) -> bool:
    """Whether the tensor named ``key`` is an input of some node of the walk."""
    for node in nodes.values():
        for e in node.edges:
            if (e.leaf is key) if type(key) is AutogradMeta else (
                    e.node is not None and (e.node.id, e.index) == key):
                return True
    return False
