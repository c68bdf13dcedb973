"""Binary and ternary elementwise ops with broadcasting, on a real 4-rank cluster.

Every placement pair on a 1-D mesh (sampled pairs on a 2x2 mesh) against an independent
statement of the rule: legal pairs give torch's values with the expected placements and move
nothing; illegal pairs raise PlacementError before anything is sent.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtorch
from dtorch import Partial, Replicate, Shard
from test_ops_support import PARTIALS, Batch, dt, illegal, make, no_comm, placements_1d

R = Replicate()
SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

OPS = {
    "add": (lambda a, b: a + b, "add"),
    "sub": (torch.sub, "sub"),
    "rsub": (torch.rsub, "rsub"),
    "mul": (torch.mul, "mul"),
    "div": (lambda a, b: a / b, "div"),
    "maximum": (torch.maximum, "maximum"),
    "minimum": (torch.minimum, "minimum"),
    "pow": (torch.pow, "none"),
    "atan2": (torch.atan2, "none"),
}


def partial_oracle(kind, pa, pb):
    """The Partial algebra, restated: output placement or None (illegal)."""
    ra = pa.reduce_op if pa.is_partial() else None
    rb = pb.reduce_op if pb.is_partial() else None
    if ra and rb and ra != rb:
        return None
    r = ra or rb
    both = ra is not None and rb is not None
    flip = {"max": "min", "min": "max"}
    if kind == "rsub":  # rsub(a, b) = b - a
        kind, pa, pb, ra, rb = "sub", pb, pa, rb, ra
    if kind in ("add", "sub"):
        if r == "sum":
            return Partial("sum") if both else None
        if r == "avg":
            return Partial("avg")
        if both:
            return None
        return Partial(r) if (kind == "add" or ra) else Partial(flip[r])
    if kind == "mul":
        return Partial(r) if r in ("sum", "avg") and not both else None
    if kind == "div":
        return Partial(r) if r in ("sum", "avg") and ra and not rb else None
    if kind == "maximum":
        return Partial(r) if r == "max" else None
    if kind == "minimum":
        return Partial(r) if r == "min" else None
    return None


def oracle(kind, pa, pb, sa, sb, so):
    """Per mesh dim: output placement, None (illegal) or "either" (nested-order corner)."""
    if pa.is_partial() or pb.is_partial():
        if pa.is_shard() or pb.is_shard():
            return None
        return partial_oracle(kind, pa, pb)
    n = len(so)
    sharded = [(p.dim + n - len(s), s[p.dim]) for p, s in ((pa, sa), (pb, sb)) if p.is_shard()]
    if not sharded:
        return R
    dims = {d for d, _ in sharded}
    if len(dims) > 1 or any(size != so[d] for d, size in sharded):
        return None
    return Shard(dims.pop())


def oracle_all(kind, pla, plb, sa, sb, so):
    out = tuple(oracle(kind, a, b, sa, sb, so) for a, b in zip(pla, plb))
    if None in out:
        return None
    # a Replicate operand narrowed on mesh dim i while it is Shard(d) on a later mesh dim
    for pl, s in ((pla, sa), (plb, sb)):
        for i, (p, o) in enumerate(zip(pl, out)):
            d = o.dim - (len(so) - len(s)) if isinstance(o, Shard) else None
            if p == R and d is not None and d >= 0 and s[d] == so[o.dim] and any(
                    q == Shard(d) for q in pl[i + 1:]):
                return "either"
    return out


@st.composite
def broadcast_shapes(draw):
    out = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    k = draw(st.integers(1, len(out)))
    other = [1 if draw(st.booleans()) and draw(st.booleans()) else s for s in out[-k:]]
    if draw(st.booleans()):
        return tuple(out), tuple(other)
    return tuple(other), tuple(out)


def _values(sa, sb, name, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(sa, generator=g, dtype=torch.float64)
    b = torch.rand(sb, generator=g, dtype=torch.float64) + 0.5
    if name == "pow":
        a = a.abs() + 0.1
    return a, b


def _run_pairs(mesh, name, sa, sb, pairs, seed=0):
    fn, kind = OPS[name]
    a, b = _values(sa, sb, name, seed)
    expected = fn(a, b)
    so = tuple(expected.shape)
    batch = Batch()
    for pla, plb in pairs:
        da, db = make(a, mesh, pla, seed), make(b, mesh, plb, seed + 1)
        want = oracle_all(kind, pla, plb, sa, sb, so)
        if want is None:
            illegal(lambda: fn(da, db))
            continue
        if want == "either":
            try:
                out = no_comm(lambda: fn(da, db))
            except dtorch.PlacementError:
                continue
            batch.add(out, expected)
            continue
        batch.add(no_comm(lambda: fn(da, db)), expected, want)
    assert batch.items or len(pairs) < 8, "no legal pair was checked"
    batch.check()


@SETTINGS
@given(shapes=broadcast_shapes(), name=st.sampled_from(sorted(OPS)), seed=st.integers(0, 99))
def test_every_placement_pair_1d(mesh1d, shapes, name, seed):
    sa, sb = shapes
    pairs = [(pa, pb) for pa in placements_1d(len(sa)) for pb in placements_1d(len(sb))]
    _run_pairs(mesh1d, name, sa, sb, pairs, seed)


def _pl2(draw, ndim):
    choices = ([R] + [Shard(d) for d in range(ndim)]) * 3 + PARTIALS
    return tuple(draw(st.sampled_from(choices)) for _ in range(2))


@SETTINGS
@given(shapes=broadcast_shapes(), name=st.sampled_from(sorted(OPS)), data=st.data())
def test_sampled_placements_2d(mesh2d, shapes, name, data):
    sa, sb = shapes
    pairs = [(_pl2(data.draw, len(sa)), _pl2(data.draw, len(sb))) for _ in range(6)]
    _run_pairs(mesh2d, name, sa, sb, pairs)


def test_seed_exception_replicate_beside_shard_is_a_local_slice(mesh1d):
    x, bias = torch.randn(7, 5), torch.randn(7, 1)
    xs = dt(x, mesh1d, [Shard(0)])
    br = dt(bias, mesh1d, [R])
    out = no_comm(lambda: xs + br)
    assert out.placements == (Shard(0),)
    row = dt(torch.randn(5), mesh1d, [R])
    out2 = no_comm(lambda: row * dt(x, mesh1d, [Shard(1)]))
    assert out2.placements == (Shard(1),)
    batch = Batch()
    batch.add(out, x + bias)
    batch.add(out2, row.to_torch() * x)
    batch.add(br, bias, [R])  # the Replicate operand itself is untouched
    batch.check()


def test_partial_algebra_examples(mesh1d):
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    ps, qs = make(x, mesh1d, [Partial()], 1), make(y, mesh1d, [Partial()], 2)
    r = dt(y, mesh1d, [R])
    batch = Batch()
    batch.add(no_comm(lambda: ps + qs), x + y, [Partial()])
    batch.add(no_comm(lambda: ps - qs), x - y, [Partial()])
    batch.add(no_comm(lambda: ps * r), x * y, [Partial()])
    batch.add(no_comm(lambda: 3.0 * ps), 3 * x, [Partial()])
    batch.add(no_comm(lambda: -ps), -x, [Partial()])
    pm = make(x, mesh1d, [Partial("max")], 3)
    batch.add(no_comm(lambda: pm + r), x + y, [Partial("max")])
    batch.add(no_comm(lambda: r - pm), y - x, [Partial("min")])
    batch.add(no_comm(lambda: -pm), -x, [Partial("min")])
    batch.check()
    illegal(lambda: ps + r, match=r"P\(sum\)")
    illegal(lambda: ps + 1.0)
    illegal(lambda: ps * qs)
    illegal(lambda: r / ps)
    illegal(lambda: torch.relu(ps))
    err = illegal(lambda: ps + r)
    text = str(err)
    assert "Tensor.__add__" in text and "input [P(sum)], other [R]" in text
    assert "redistribute(placements=[Replicate()])" in text and "all_reduce" in text


def test_where_masked_fill_clamp(mesh1d, mesh2d):
    x = torch.randn(6, 5)
    cond = x > 0
    y = torch.randn(5)
    batch = Batch()
    for mesh, pl in ((mesh1d, [Shard(0)]), (mesh1d, [Shard(1)]), (mesh2d, [Shard(1), Shard(0)]),
                     (mesh2d, [R, Shard(1)])):
        rr = [R] * mesh.ndim
        xs, cs, yr = dt(x, mesh, pl), dt(cond, mesh, pl), dt(y, mesh, rr)
        batch.add(no_comm(lambda: torch.where(cs, xs, yr)), torch.where(cond, x, y), pl)
        batch.add(no_comm(lambda: torch.where(cs, xs, 0.0)), torch.where(cond, x, 0.0), pl)
        batch.add(no_comm(lambda: xs.where(cs, yr)), x.where(cond, y), pl)
        batch.add(no_comm(lambda: xs.masked_fill(cs, -1.0)), x.masked_fill(cond, -1.0), pl)
        batch.add(no_comm(lambda: xs.clamp(-0.5, 0.5)), x.clamp(-0.5, 0.5), pl)
        batch.add(no_comm(lambda: torch.clamp(xs, min=yr)), torch.clamp(x, min=y), pl)
    xd = x.double()
    pm = make(xd, mesh1d, [Partial("max")], 5)
    ps = make(xd, mesh1d, [Partial("sum")], 6)
    cr = dt(cond, mesh1d, [R])
    batch.add(no_comm(lambda: pm.clamp(-0.5, 0.5)), xd.clamp(-0.5, 0.5), [Partial("max")])
    batch.add(no_comm(lambda: ps.masked_fill(cr, 0.0)), xd.masked_fill(cond, 0.0), [Partial()])
    batch.add(no_comm(lambda: torch.where(cr, ps, ps * 2)), torch.where(cond, xd, xd * 2),
              [Partial()])
    batch.check()
    illegal(lambda: ps.masked_fill(cr, 1.0))
    illegal(lambda: ps.clamp(0, 1))
    illegal(lambda: torch.where(cr, ps, 0.0))
    c0, x1 = dt(cond, mesh1d, [Shard(0)]), dt(x, mesh1d, [Shard(1)])
    illegal(lambda: torch.where(c0, x1, 0.0))


@pytest.mark.parametrize("pl", [[Shard(0)], [Shard(1)], [R], [Partial()]], ids=str)
def test_inplace_binary(mesh1d, pl):
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    a = make(x, mesh1d, pl, 7)
    partial = pl[0].is_partial()
    b = make(y.expand(5, 3).contiguous(), mesh1d, pl, 8) if partial else dt(y, mesh1d, [R])
    expected = x.clone()
    expected.add_(y if not partial else y.expand(5, 3))
    no_comm(lambda: a.add_(b))
    expected.mul_(2.0)
    no_comm(lambda: a.mul_(2.0))
    if not partial:
        expected.sub_(y).div_(y.abs() + 1)
        a.sub_(b)
        a.div_(b.abs() + 1)
    batch = Batch()
    batch.add(a, expected, pl)
    batch.check()


def test_integer_ops_are_exact(mesh2d):
    x = torch.randint(-50, 50, (5, 7))
    y = torch.randint(1, 9, (7,))
    xs, yr = dt(x, mesh2d, [Shard(0), Shard(1)]), dt(y, mesh2d, [R, R])
    batch = Batch()
    batch.add(no_comm(lambda: xs * yr + 3), x * y + 3, [Shard(0), Shard(1)])
    batch.add(no_comm(lambda: xs // yr), x // y, [Shard(0), Shard(1)])
    batch.add(no_comm(lambda: xs % yr), x % y, [Shard(0), Shard(1)])
    batch.add(no_comm(lambda: xs & yr), x & y, [Shard(0), Shard(1)])
    batch.add(no_comm(lambda: xs > yr), x > y, [Shard(0), Shard(1)])
    batch.add(no_comm(lambda: (xs == yr) | (xs < 0)), (x == y) | (x < 0), [Shard(0), Shard(1)])
    batch.check()
