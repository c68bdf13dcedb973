"""Shared checks for the op tests (imported by tests/test_ops_*.py), and dispatch tests.

``Batch`` collects (DTensor result, torch expectation, expected placements) and checks them all
with pipelined fetches: ``to_torch()`` against torch, and every rank's local shard against the
layout (shape, and values where there is no Partial). ``no_comm`` runs an op under
``CommDebugMode`` and asserts nothing moved; ``illegal`` asserts a PlacementError that issued
nothing to the workers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Partial, PlacementError, Replicate, Shard
from dtorch.layout import rank_block
from dtorch.runtime import messages as msg
from dtorch.runtime.wire import unpack
from dtorch.runtime import session

R = Replicate()
PARTIALS = [Partial("sum"), Partial("avg"), Partial("max"), Partial("min")]


def dt(value, mesh, placements) -> dtorch.DTensor:
    return dtorch.tensor(value, device_mesh=mesh, placements=list(placements))


def make(value: torch.Tensor, mesh, placements, seed: int = 0) -> dtorch.DTensor:
    """A DTensor holding ``value``; a Partial on one mesh dim gets random per-rank shares
    that reduce to ``value`` (so Partial rules are tested on real partial values)."""
    placements = tuple(placements)
    partial = [m for m, p in enumerate(placements) if p.is_partial()]
    if len(partial) != 1 or not value.is_floating_point():
        return dt(value, mesh, placements)
    m = partial[0]
    shares = _shares(value, placements[m].reduce_op, mesh.shape[m], seed)
    blocks = tuple(R if p.is_partial() else p for p in placements)
    local = {}
    for rank in mesh.ranks:
        coord = mesh.get_coordinate(rank)
        block = rank_block(value.shape, mesh, blocks, coord)
        local[rank] = shares[coord[m]][block.slices()].clone()
    return dtorch.from_local(local, mesh, placements, shape=tuple(value.shape))


def _shares(value, op, n, seed):
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand((n, *value.shape), generator=g, dtype=value.dtype) + 0.25
    if op == "sum":
        noise[-1] = value - noise[:-1].sum(0)
        return list(noise)
    if op == "avg":
        return list(value + noise - noise.mean(0))
    chosen = torch.randint(0, n, value.shape, generator=g)
    sign = -1 if op == "max" else 1
    return [torch.where(chosen == i, value, value + sign * noise[i]) for i in range(n)]


def placements_1d(ndim: int, partial: bool = True) -> list[tuple]:
    """Every placement of an ``ndim``-D tensor on a 1-D mesh."""
    out = [(R,)] + [(Shard(d),) for d in range(ndim)]
    return out + ([(p,) for p in PARTIALS] if partial else [])


def no_comm(fn):
    """Run ``fn`` under CommDebugMode; assert it issued no collective; return its result."""
    with dtorch.CommDebugMode() as mode:
        out = fn()
    assert mode.get_total_counts() == 0, mode.get_comm_counts()
    return out


def illegal(fn, match: str | None = None, error=PlacementError):
    """``fn`` raises ``error`` (PlacementError) on the controller and sends nothing to the
    workers."""
    c = session.get_controller()
    before = c.issued
    with pytest.raises(error, match=match) as info:
        fn()
    assert c.issued == before, "an illegal op issued instructions"
    return info.value


# (rtol, atol) per dtype: torch.testing.assert_close's defaults, float64 stricter than float32
TOLERANCES = {torch.float64: (1e-7, 1e-7), torch.float32: (1.3e-6, 1e-5),
              torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing results of ``dtype`` (a complex type: its parts')."""
    if dtype.is_complex:
        dtype = dtype.to_real()
    return TOLERANCES.get(dtype, (1.3e-6, 1e-5))


class Batch:
    """Collect results, then check them with one pipelined round of fetches."""

    def __init__(self):
        self.items = []

    def add(self, out, expected: torch.Tensor, placements=None, exact: bool = None,
            rtol: float | None = None, atol: float | None = None):
        """Queue ``out`` to be checked against ``expected``: exactly for integer and bool
        results, else within ``rtol``/``atol``, by default the tolerance of the dtype
        (``TOLERANCES``: float64 results are checked at float64 precision)."""
        if isinstance(out, (tuple, list)):
            for o, e in zip(out, expected):
                self.add(o, e, placements, exact, rtol, atol)
            return
        assert isinstance(out, dtorch.DTensor), type(out)
        assert tuple(out.shape) == tuple(expected.shape), (out.shape, expected.shape)
        assert out.dtype == expected.dtype, (out.dtype, expected.dtype)
        if placements is not None:
            assert out.placements == tuple(placements), (out.placements, tuple(placements))
        if exact is None:
            exact = not (expected.is_floating_point() or expected.is_complex())
        default_rtol, default_atol = tolerance(expected.dtype)
        self.items.append((out, expected, exact, default_rtol if rtol is None else rtol,
                           default_atol if atol is None else atol))

    def check(self):
        c = session.get_controller()
        pending = []
        for out, expected, exact, rtol, atol in self.items:
            ranks = tuple(out.device_mesh.ranks)
            locals_ = c.request(lambda req, t=out._tid, rk=ranks: msg.Fetch(req, t, rk), ranks)
            pending.append((out, expected, exact, rtol, atol, locals_, out.to_torch_async()))
        for out, expected, exact, rtol, atol, locals_, full in pending:
            _compare(full.get(timeout=120), expected, exact, rtol, atol, "to_torch()")
            answers = c.wait(locals_, timeout=120)
            _check_locals(out, expected, answers, exact, rtol, atol)
        self.items = []


def _compare(got, expected, exact, rtol, atol, what):
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape,
                                                                         expected.shape)
    if exact:
        assert torch.equal(got, expected), f"{what}: {got} != {expected}"
    else:
        assert torch.allclose(got, expected, rtol=rtol, atol=atol, equal_nan=True), \
            f"{what}: max error {(got - expected).abs().max()}"


def _check_locals(out, expected, answers, exact, rtol, atol):
    spec = out._spec
    partial = any(p.is_partial() for p in spec.placements)
    for rank, (status, wire) in answers.items():
        assert status == "ok", wire
        value = unpack(wire)
        block = rank_block(spec.shape, spec.mesh, spec.placements,
                           spec.mesh.get_coordinate(rank))
        assert tuple(value.shape) == block.shape, (rank, tuple(value.shape), block.shape)
        assert value.dtype == spec.dtype
        if not partial:
            _compare(value, expected[block.slices()], exact, rtol, atol, f"rank {rank} local")


# dispatch tests -----------------------------------------------------------------------------------
def test_coverage_lists_families():
    rows = dtorch.ops.coverage()
    families = {f for _, f in rows}
    assert {"unary", "binary", "compare", "cast", "matmul", "reduction", "softmax", "norm",
            "shape", "concat", "indexing", "embedding", "attention", "activation"} <= families
    assert ("torch.matmul", "matmul") in rows and ("F.layer_norm", "norm") in rows
    assert len(rows) > 300


def test_docs_coverage_table_is_current():
    import pathlib
    doc = pathlib.Path(__file__).resolve().parent.parent / "docs" / "ops.md"
    assert dtorch.ops.coverage_markdown() in doc.read_text(), (
        "docs/ops.md is stale: .venv/bin/python -c \"import dtorch.ops as o; o.write_coverage()\"")


def test_no_rule_error_names_op_and_coverage(mesh1d):
    x = dt(torch.randn(4, 4), mesh1d, [Shard(0)])
    with pytest.raises(dtorch.ops.UnsupportedOpError, match=r"aten\.cov.*coverage\(\)"):
        torch.ops.aten.cov.default(x)  # torch.cov refuses with the fix; its aten op has no rule


def test_mixed_meshes_raise(mesh1d, mesh2d):
    a = dt(torch.randn(4, 4), mesh1d, [R])
    b = dt(torch.randn(4, 4), mesh2d, [R, R])
    illegal(lambda: a + b, match="different meshes")


def test_plain_tensor_operand_is_a_constant_and_scalars_work(mesh1d):
    a = dt(torch.arange(8.), mesh1d, [Shard(0)])
    batch = Batch()
    batch.add(no_comm(lambda: a + torch.ones(8)), torch.arange(8.) + 1, [Shard(0)])
    batch.add(a + torch.tensor(2.0), torch.arange(8.) + 2, [Shard(0)])
    batch.add(2 ** a, 2 ** torch.arange(8.), [Shard(0)])
    batch.check()


def test_shape_and_dtype_errors_are_torchs_own_on_the_controller(mesh1d):
    a = dt(torch.randn(4, 3), mesh1d, [Shard(0)])
    b = dt(torch.randn(5, 3), mesh1d, [Shard(0)])
    i = dt(torch.arange(4), mesh1d, [R])
    c = session.get_controller()
    before = c.issued
    with pytest.raises(RuntimeError, match="must match the size"):
        a + b
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        torch.mm(a, b)
    with pytest.raises(RuntimeError, match="result type Float can't be cast"):
        i.add_(1.5)
    assert c.issued == before


def test_entry_points_reach_the_same_rules(mesh1d):
    x = torch.randn(4, 6)
    a = dt(x, mesh1d, [Shard(0)])
    batch = Batch()
    batch.add(torch.relu(a), torch.relu(x), [Shard(0)])
    batch.add(dtorch.relu(a), torch.relu(x), [Shard(0)])
    batch.add(dtorch.nn.functional.gelu(a), F.gelu(x), [Shard(0)])
    batch.add(F.softmax(a, -1), F.softmax(x, -1), [Shard(0)])
    batch.add(a.softmax(dim=-1), x.softmax(dim=-1), [Shard(0)])
    batch.add(a.sum(0), x.sum(0), [Partial()])
    batch.add(a.T, x.T, [Shard(1)])
    batch.check()
    assert dtorch.matmul(torch.ones(2, 2), torch.ones(2, 2)).sum() == 8  # plain torch fallback
    assert a.is_floating_point() and a.device == torch.device("cpu")
    with pytest.raises(AttributeError, match="coverage"):
        dtorch.no_such_function


def test_default_mesh_tensor_works_unchanged(live):
    x = torch.randn(3, 4)
    a = dtorch.tensor(x)  # no mesh: the default one-rank mesh
    w = dtorch.tensor(torch.randn(4, 2))
    out = torch.relu(a @ w + 1).sum(-1)
    assert torch.allclose(out.to_torch(), torch.relu(x @ w.to_torch() + 1).sum(-1), atol=1e-5)


def test_dtensor_stays_hashable_and_eq_is_elementwise(mesh1d):
    a = dt(torch.arange(4.), mesh1d, [Shard(0)])
    b = dt(torch.tensor([0., 5., 2., 7.]), mesh1d, [Shard(0)])
    assert len({a, b}) == 2 and a in [a]
    assert (a == b).to_torch().tolist() == [True, False, True, False]
    assert (a == None) is False  # noqa: E711 - as torch.Tensor: not elementwise


def test_inplace_returns_the_same_handle_and_keeps_placements(mesh1d):
    x = torch.randn(5, 3)
    a = dt(x, mesh1d, [Shard(0)])
    ra = a.add_(1.0)
    assert ra is a
    a *= 2
    a[:, 1] = 0.0
    F.relu(a, inplace=True)
    expected = torch.relu((x + 1) * 2)
    expected[:, 1] = 0.0
    batch = Batch()
    batch.add(a, expected, [Shard(0)])
    batch.check()
    r = dt(x, mesh1d, [R])
    s = dt(x, mesh1d, [Shard(0)])
    illegal(lambda: r.add_(s), match="in-place op cannot change placements")


def test_signatures_are_cached_no_meta_after_first_call(mesh1d, monkeypatch):
    from dtorch.ops import dispatch as d
    a = dt(torch.randn(4, 4), mesh1d, [Shard(0)])
    a * 3.0  # warm
    calls = []
    original = d.plan_signature
    monkeypatch.setattr(d, "plan_signature", lambda *args: calls.append(1) or original(*args))
    for _ in range(5):
        a * 3.0
    assert calls == []
    a * 3  # an int scalar is a different signature (dtype promotion differs)
    assert calls == [1]


def test_a_failed_local_op_poisons_what_depends_on_it(mesh1d):
    """Strides are not tracked: ``x.t().view(-1)`` passes the controller and fails on the
    ranks; ops fed by it fail with that error, read where the value is read."""
    a = dt(torch.randn(4, 6), mesh1d, [R])
    bad = a.t().view(24)
    good = dt(torch.randn(24), mesh1d, [R])
    joined = torch.cat([good, bad])
    with pytest.raises(dtorch.RemoteError, match="view"):
        joined.to_torch()
    with pytest.raises(dtorch.RemoteError, match="view"):
        dtorch.synchronize()  # also clears the ranks' error lists for later tests
    dtorch.synchronize()


def test_like_factories_and_metadata(mesh2d):
    x = torch.randn(5, 6)
    a = make(x.double(), mesh2d, [Shard(1), Partial()], 1)
    batch = Batch()
    batch.add(no_comm(lambda: torch.zeros_like(a)), torch.zeros(5, 6, dtype=torch.float64),
              [Shard(1), Partial()])
    batch.add(no_comm(lambda: torch.ones_like(a)), torch.ones(5, 6, dtype=torch.float64),
              [Shard(1), R])
    batch.add(no_comm(lambda: torch.full_like(a, 3.0)), torch.full((5, 6), 3.0,
                                                                   dtype=torch.float64),
              [Shard(1), R])
    batch.add(no_comm(lambda: a.new_zeros(2, 3)), torch.zeros(2, 3, dtype=torch.float64), [R, R])
    batch.add(no_comm(lambda: a.new_full((4,), 7)), torch.full((4,), 7.0, dtype=torch.float64),
              [R, R])
    batch.check()
    c = session.get_controller()
    before = c.issued
    assert a.is_floating_point() and not a.is_complex() and a.element_size() == 8
    assert a.nelement() == 30 and a.is_contiguous()
    assert c.issued == before  # answered on the controller


def test_zero_dim_tensor_arguments_are_not_replayed_from_the_cache(mesh1d):
    cond = dtorch.tensor(torch.tensor([True, False, True, False]), device_mesh=mesh1d,
                         placements=[Shard(0)])
    ones = dtorch.tensor(torch.ones(4), device_mesh=mesh1d, placements=[Shard(0)])
    for fill in (1.0, 5.0, -2.0):
        out = torch.where(cond, ones, torch.tensor(fill))
        assert out.to_torch().tolist() == [1.0, fill, 1.0, fill]
    for fill in (3.0, 7.0):
        y = dtorch.zeros(4, 4, device_mesh=mesh1d, placements=[Shard(0)])
        y[:, 0:2] = torch.tensor(fill)
        assert y.to_torch()[0].tolist() == [fill, fill, 0.0, 0.0]
