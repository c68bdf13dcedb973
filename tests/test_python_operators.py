"""Every Python operator on DTensors against torch, on a real 4-rank cluster: binary,
reflected, in-place and unary; tensor-tensor, tensor-scalar and scalar-tensor; Replicate,
Shard(0) (uneven rows), Shard(1) on a 1-D mesh and (Shard(0), Shard(1)) on a 2x2 mesh.

Each result is checked against plain torch doing the same on one device, with the placements
an elementwise op keeps (and each rank's local shard against the layout, see ``Batch``).
"""

import operator

import pytest
import torch

from dtorch import Replicate, Shard, init_device_mesh
from test_ops_support import Batch, dt

R = Replicate()
FLOAT_OPS = {  # name -> (binary operator, in-place operator)
    "add": (operator.add, operator.iadd), "sub": (operator.sub, operator.isub),
    "mul": (operator.mul, operator.imul), "truediv": (operator.truediv, operator.itruediv),
    "floordiv": (operator.floordiv, operator.ifloordiv), "mod": (operator.mod, operator.imod),
    "pow": (operator.pow, operator.ipow),
}
INT_OPS = {
    "and": (operator.and_, operator.iand), "or": (operator.or_, operator.ior),
    "xor": (operator.xor, operator.ixor), "lshift": (operator.lshift, operator.ilshift),
    "rshift": (operator.rshift, operator.irshift),
}
COMPARISONS = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
               "gt": operator.gt, "ge": operator.ge}
LAYOUTS = ["R", "S0", "S1", "2d-S0S1"]
SHAPE = (5, 6)  # 5 rows on 4 ranks: 2, 1, 1, 1 (uneven)


def _mesh_and_placements(layout):
    if layout == "2d-S0S1":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), (Shard(0), Shard(1))
    mesh = init_device_mesh("cpu", 4)
    return mesh, {"R": (R,), "S0": (Shard(0),), "S1": (Shard(1),)}[layout]


def _floats(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(SHAPE, generator=g) * 3 + 0.5  # positive: pow, //, % stay finite


def _ints(seed, high=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, SHAPE, generator=g)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float_operators(live, layout):
    mesh, pl = _mesh_and_placements(layout)
    a, b = _floats(0), _floats(1)
    x, y = dt(a, mesh, pl), dt(b, mesh, pl)
    batch = Batch()
    for name, (op, iop) in FLOAT_OPS.items():
        batch.add(op(x, y), op(a, b), pl)          # tensor-tensor
        batch.add(op(x, 2.0), op(a, 2.0), pl)      # tensor-scalar
        batch.add(op(2.0, x), op(2.0, a), pl)      # scalar-tensor (reflected)
        batch.add(op(x, 2), op(a, 2), pl)          # an int scalar
        batch.add(op(3, x), op(3, a), pl)
        z, want = dt(a, mesh, pl), a.clone()
        z_id = id(z)
        z = iop(z, y)                              # z op= y
        want = iop(want, b)
        assert id(z) == z_id, f"{name}: in-place must keep the handle"
        batch.add(z, want, pl)
        w, want2 = dt(a, mesh, pl), a.clone()
        w = iop(w, 2)                              # z op= 2
        batch.add(w, iop(want2, 2), pl)
    batch.check()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_integer_operators(live, layout):
    mesh, pl = _mesh_and_placements(layout)
    a, b = _ints(2), _ints(3, high=4)  # shift amounts small and non-negative
    x, y = dt(a, mesh, pl), dt(b, mesh, pl)
    batch = Batch()
    for name, (op, iop) in INT_OPS.items():
        batch.add(op(x, y), op(a, b), pl)
        batch.add(op(x, 2), op(a, 2), pl)
        batch.add(op(2, y), op(2, b), pl)          # 2 << x, 2 >> x, 2 & x ...
        z = iop(dt(a, mesh, pl), y)
        batch.add(z, iop(a.clone(), b), pl)
        z = iop(dt(a, mesh, pl), 1)
        batch.add(z, iop(a.clone(), 1), pl)
    for op in (operator.floordiv, operator.mod, operator.mul, operator.add, operator.sub):
        batch.add(op(x, y + 1), op(a, b + 1), pl)
        batch.add(op(7, y + 1), op(7, b + 1), pl)
    batch.add(~x, ~a, pl)
    batch.add(-x, -a, pl)
    batch.add(abs(x - 8), abs(a - 8), pl)
    batch.check()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_comparisons_and_unary(live, layout):
    mesh, pl = _mesh_and_placements(layout)
    a, b = _floats(4), _floats(5)
    a[0, 0] = b[0, 0]  # one equal pair
    x, y = dt(a, mesh, pl), dt(b, mesh, pl)
    batch = Batch()
    for op in COMPARISONS.values():
        batch.add(op(x, y), op(a, b), pl)
        batch.add(op(x, 2.0), op(a, 2.0), pl)
        batch.add(op(2.0, x), op(2.0, a), pl)      # reflected: Python swaps the comparison
    batch.add(-x, -a, pl)
    batch.add(+x, +a, pl)
    batch.add(abs(x - 2), abs(a - 2), pl)
    flags = x > 2
    batch.add(~flags, ~(a > 2), pl)
    batch.add(flags & (y > 2), (a > 2) & (b > 2), pl)
    batch.add(flags | (y > 2), (a > 2) | (b > 2), pl)
    batch.add(flags ^ (y > 2), (a > 2) ^ (b > 2), pl)
    batch.check()


def test_matmul_operator(live):
    mesh = init_device_mesh("cpu", 4)
    a, b = _floats(6), _floats(7).T.contiguous()
    batch = Batch()
    batch.add(dt(a, mesh, [Shard(0)]) @ dt(b, mesh, [R]), a @ b, [Shard(0)])
    batch.add(dt(a, mesh, [R]) @ dt(b, mesh, [Shard(1)]), a @ b, [Shard(1)])
    batch.add(dt(a, mesh, [R]) @ dt(b, mesh, [R]), a @ b, [R])
    batch.check()


def test_pow_square_loss_on_a_sharded_batch(live):
    """The loss the issue found broken: ``((y - t) ** 2).mean()`` on a dp-sharded batch."""
    mesh = init_device_mesh("cpu", 4)
    y, t = _floats(8), _floats(9)
    loss = ((dt(y, mesh, [Shard(0)]) - dt(t, mesh, [Shard(0)])) ** 2).sum()
    torch.testing.assert_close(loss.to_torch(), ((y - t) ** 2).sum())
