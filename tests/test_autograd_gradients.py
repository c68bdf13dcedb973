"""Gradients through DTensor ops against torch.autograd on one device, on a real 4-rank
cluster: elementwise, broadcasting, matmul, reductions and shape ops under Replicate,
Shard(0), Shard(1) and Partial inputs, on 1-D and 2-D meshes.

Every case runs the same function on torch tensors and on DTensors, takes
``dtorch.autograd.grad`` / ``torch.autograd.grad`` with the same random output gradient, and
compares each input's gradient value (and that its placements are the input's own).
"""

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard, init_device_mesh
from test_ops_support import make

R = Replicate()
S0, S1 = Shard(0), Shard(1)


def _value(shape, seed, positive=False):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(shape, generator=g, dtype=torch.float64)
    return v.abs() + 0.5 if positive else v


def check(fn, values, placements, mesh, seed=0):
    """``fn``'s gradients w.r.t. every input: dtorch on ``placements`` vs torch."""
    ts = [v.clone().requires_grad_() for v in values]
    want_out = fn(*ts)
    g = _value(want_out.shape, 100 + seed)
    want = torch.autograd.grad(want_out, ts, g)
    ds = [make(v, mesh, p).requires_grad_() for v, p in zip(values, placements)]
    out = fn(*ds)
    assert out.requires_grad and not out.is_leaf and out.grad_fn is not None
    grad_pl = tuple(R if p.is_partial() else p for p in out.placements)
    dg = dtorch.tensor(g, device_mesh=mesh, placements=grad_pl)
    got = dtorch.autograd.grad(out, ds, dg)
    torch.testing.assert_close(out.to_torch(), want_out.detach())
    for i, (d, w, x) in enumerate(zip(got, want, ds)):
        assert d.placements == x.placements, (i, d.placements, x.placements)
        torch.testing.assert_close(d.to_torch(), w, msg=lambda m: f"input {i}: {m}")


A = (8, 6)
ELEMENTWISE = {
    "exp": lambda x: torch.exp(x),
    "sin-mul": lambda x: x.sin() * x,
    "tanh": lambda x: torch.tanh(x),
    "relu": lambda x: torch.relu(x),
    "sigmoid": lambda x: torch.sigmoid(x),
    "square": lambda x: x ** 2,
    "cube-minus": lambda x: 2 - x ** 3,
    "pow-scalar-base": lambda x: 2 ** x,
    "neg-abs": lambda x: -abs(x),
    "softmax-last": lambda x: torch.softmax(x, -1),
}


@pytest.mark.parametrize("placement", [R, S0, S1], ids=["R", "S0", "S1"])
def test_unary_ops(mesh1d, placement):
    for name, fn in ELEMENTWISE.items():
        if name == "softmax-last" and placement == S1:
            continue  # softmax over the sharded dim has no rule
        check(fn, [_value(A, 1)], [(placement,)], mesh1d)


BINARY = {
    "add": lambda x, y: x + y,
    "sub": lambda x, y: x - y,
    "mul": lambda x, y: x * y,
    "div": lambda x, y: x / y,
    "pow": lambda x, y: x ** y,
    "maximum": lambda x, y: torch.maximum(x, y),
    "where": lambda x, y: torch.where(x > 0, x, y * 2),
    "mse-style": lambda x, y: (x - y) ** 2 / 3,
}


@pytest.mark.parametrize("placement", [R, S0, S1], ids=["R", "S0", "S1"])
def test_binary_ops(mesh1d, placement):
    for name, fn in BINARY.items():
        x, y = _value(A, 2, positive=True), _value(A, 3, positive=True)
        check(fn, [x, y], [(placement,), (placement,)], mesh1d)


def test_broadcast_replicate_operand_gets_a_reduced_gradient(mesh1d):
    """A Replicate bias beside a Shard(0) input: its gradient is Partial on the ranks and
    all_reduced to the bias's own Replicate."""
    x, b = _value(A, 4), _value((6,), 5)
    check(lambda x, b: (x + b) * b, [x, b], [(S0,), (R,)], mesh1d)
    check(lambda x, b: x * b, [x, b], [(S1,), (R,)], mesh1d)


@pytest.mark.parametrize("pa,pb", [(S0, R), (R, S1), (S1, S0), (R, R)],
                         ids=["S0@R", "R@S1", "S1@S0", "R@R"])
def test_matmul(mesh1d, pa, pb):
    a, b = _value((8, 4), 6), _value((4, 8), 7)
    check(lambda a, b: a @ b, [a, b], [(pa,), (pb,)], mesh1d)
    check(lambda a, b: torch.matmul(a, b) * 3, [a, b], [(pa,), (pb,)], mesh1d)


def test_linear_with_bias(mesh1d):
    x, w, bias = _value((8, 4), 8), _value((6, 4), 9), _value((6,), 10)
    f = torch.nn.functional.linear
    check(lambda x, w, b: f(x, w, b), [x, w, bias], [(S0,), (R,), (R,)], mesh1d)
    check(lambda x, w, b: f(x, w, b), [x, w, bias], [(R,), (S0,), (S0,)], mesh1d)


REDUCTIONS = {
    "sum": lambda x: x.sum(),
    "mean": lambda x: x.mean(),
    "sum0": lambda x: x.sum(0),
    "mean1": lambda x: x.mean(1),
    "sum-keepdim": lambda x: x.sum(1, keepdim=True) * x,
}


@pytest.mark.parametrize("placement", [R, S0, S1], ids=["R", "S0", "S1"])
def test_reductions(mesh1d, placement):
    for name, fn in REDUCTIONS.items():
        if name == "sum-keepdim" and placement == S1:
            continue  # a Partial sum times a Shard(1) has no rule
        check(fn, [_value(A, 11)], [(placement,)], mesh1d)


def test_reductions_on_uneven_shards(mesh1d):
    x = _value((5, 3), 12)  # rows 2, 1, 1, 1
    for fn in (lambda x: x.sum(), lambda x: x.mean(), lambda x: (x * x).mean(0)):
        check(fn, [x], [(S0,)], mesh1d)


SHAPES = {
    "t": lambda x: x.t() * 2,
    "transpose": lambda x: x.transpose(0, 1).sin(),
    "view": lambda x: x.view(4, 2, 6).tanh(),
    "reshape": lambda x: x.reshape(8, 3, 2) ** 2,
    "unsqueeze": lambda x: x.unsqueeze(0).exp(),
    "permute": lambda x: x.unsqueeze(-1).permute(2, 0, 1) * 3,
    "slice-rows": lambda x: x[2:6] * 2,
    "slice-cols": lambda x: x[:, 1:4].exp(),
}


@pytest.mark.parametrize("placement", [R, S0, S1], ids=["R", "S0", "S1"])
def test_shape_ops(mesh1d, placement):
    for name, fn in SHAPES.items():
        if placement == S0 and name == "slice-rows" or placement == S1 and name in (
                "slice-cols",):
            continue  # slicing a sharded dim has no local rule
        check(fn, [_value(A, 13)], [(placement,)], mesh1d)


def test_cat(mesh1d):
    x, y = _value(A, 14), _value(A, 15)
    check(lambda x, y: torch.cat([x, y], 1).sin(), [x, y], [(S0,), (S0,)], mesh1d)
    check(lambda x, y: torch.cat([x, y], 0) * 2, [x, y], [(S1,), (S1,)], mesh1d)


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_partial_inputs(mesh1d, op):
    """Partial values: linear ops keep them Partial; their gradients come back Replicate on
    the ranks and are stored in the leaf's own Partial placements."""
    x, y, c = _value(A, 16), _value(A, 17), _value(A, 18)
    p = Partial(op)
    check(lambda x, y: x + y, [x, y], [(p,), (p,)], mesh1d)
    check(lambda x, c: x * c, [x, c], [(p,), (R,)], mesh1d)
    check(lambda x: (x * 3).sum(), [x], [(p,)], mesh1d)
    check(lambda x: _replicate(x).exp(), [x], [(p,)], mesh1d)


def _replicate(x):
    """All-Replicate on a DTensor (recorded: its backward is a redistribute back); torch's
    tensor as it is."""
    return x.redistribute(placements=[R] * x.device_mesh.ndim) if isinstance(
        x, dtorch.DTensor) else x


def test_two_d_mesh(mesh2d):
    x, y = _value(A, 19), _value(A, 20)
    check(lambda x, y: x * y + x.exp(), [x, y], [(S0, S1), (S0, S1)], mesh2d)
    check(lambda x: x.sum(), [x], [(S0, S1)], mesh2d)
    check(lambda x: x.mean(), [x], [(S0, S1)], mesh2d)
    a, w = _value((8, 4), 21), _value((4, 6), 22)
    check(lambda a, w: (a @ w).tanh(), [a, w], [(S0, R), (R, S1)], mesh2d)
    check(lambda a, w: a @ w, [a, w], [(S0, S1), (R, S0)], mesh2d)


def test_repeated_use_and_diamond(mesh1d):
    """One tensor feeding several ops (its gradients summed across nodes), and x * x."""
    x = _value(A, 23)
    check(lambda x: x * x, [x], [(S0,)], mesh1d)
    check(lambda x: (x.exp() + x.sin()) * x, [x], [(S1,)], mesh1d)
    check(lambda x: x.sum(1, keepdim=True) * x.exp(), [x], [(S0,)], mesh1d)


def test_backward_accumulates_into_grad_like_torch(mesh1d):
    v = _value(A, 24)
    t = v.clone().requires_grad_()
    x = make(v, mesh1d, [S0]).requires_grad_()
    for _ in range(3):
        (t.sin() * t).sum().backward()
        (x.sin() * x).sum().backward()
    assert x.grad.placements == (S0,)
    torch.testing.assert_close(x.grad.to_torch(), t.grad)
    x.grad = None
    assert x.grad is None
    (x * 2).sum().backward()
    torch.testing.assert_close(x.grad.to_torch(), torch.full(A, 2.0, dtype=torch.float64))


def test_inplace_ops_in_the_graph(mesh1d):
    """In-place ops on non-leaves are recorded (a new node for the target), as torch."""
    v = _value(A, 25)

    def fn(x):
        y = x * 2
        y.add_(x.exp())
        y.mul_(3)
        return y
    check(fn, [v], [(S0,)], mesh1d)
