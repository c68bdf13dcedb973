"""Plain torch tensors beside DTensors are Replicate constants, sent once and cached
(dtorch.ops.constants): results against torch, zero collectives, the bytes counted by
``dtorch.constants_sent()`` and ``CommDebugMode.get_constant_bytes()``, the LRU bound, the
size warning, and the MixedTensorError cases that remain."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import MixedTensorError, Replicate, Shard, config
from dtorch.ops.constants import ConstantSizeWarning
from dtorch.runtime import session

R = Replicate()
CASES = [("mesh1d", (Shard(0),)), ("mesh1d", (Shard(1),)), ("mesh2d", (Shard(0), Shard(1))),
         ("mesh2d", (Shard(1), Shard(0)))]


@pytest.fixture(params=CASES, ids=lambda c: f"{c[0]}-{'-'.join(map(str, c[1]))}")
def case(request):
    name, placements = request.param
    return request.getfixturevalue(name), placements


@pytest.fixture(autouse=True)
def fresh(live):
    dtorch.clear_constants()
    yield
    dtorch.clear_constants()


def dt(value, mesh, placements, requires_grad=False):
    return dtorch.tensor(value, device_mesh=mesh, placements=list(placements),
                         requires_grad=requires_grad)


def counted(fn):
    """``fn()`` under CommDebugMode: (result, comm counts, constant bytes per rank)."""
    with dtorch.CommDebugMode() as mode:
        out = fn()
    return out, mode.get_comm_counts(), mode.get_constant_bytes()


def check(out, expected, placements):
    assert isinstance(out, dtorch.DTensor)
    assert out.placements == tuple(placements)
    torch.testing.assert_close(out.to_torch(), expected)


@pytest.mark.parametrize("shape", [(5, 3), (3, 2), (6, 7)])
def test_binary_with_a_constant(case, shape):
    mesh, placements = case
    xv, t = torch.randn(shape), torch.randn(shape)
    row = torch.randn(shape[-1])
    x = dt(xv, mesh, placements)
    out, comms, sent = counted(lambda: x + t)
    assert comms == {} and sent == t.nbytes
    check(out, xv + t, placements)
    out, comms, sent = counted(lambda: t * x - row)
    assert comms == {} and sent == row.nbytes  # t cached already
    check(out, t * xv - row, placements)


def test_constants_inside_lists_and_keywords(case):
    mesh, placements = case
    xv, t, w = torch.randn(6, 5), torch.randn(6, 5), torch.rand(5)
    x = dt(xv, mesh, placements)
    out, comms, sent = counted(lambda: torch.stack([x, t]).sum(0))
    assert comms == {} and sent == t.nbytes
    torch.testing.assert_close(out.to_torch(), xv + t)
    out, comms, _ = counted(lambda: torch.add(x, other=w, alpha=2))
    assert comms == {}
    check(out, torch.add(xv, w, alpha=2), placements)


def test_where_with_a_plain_bool_mask(case):
    mesh, placements = case
    xv, yv = torch.randn(7, 5), torch.randn(7, 5)
    mask = torch.rand(7, 5) > 0.5
    x, y = dt(xv, mesh, placements), dt(yv, mesh, placements)
    out, comms, sent = counted(lambda: torch.where(mask, x, y))
    assert comms == {} and sent == mask.nbytes
    check(out, torch.where(mask, xv, yv), placements)
    out, comms, _ = counted(lambda: torch.where(mask, x, 0.0))
    assert comms == {}
    check(out, torch.where(mask, xv, 0.0), placements)


@pytest.mark.parametrize("name,placements", [("mesh1d", (Shard(0),)), ("mesh1d", (Shard(2),)),
                                             ("mesh2d", (Shard(0), Shard(2)))])
def test_rotary_table_on_a_slice(request, name, placements):
    mesh = request.getfixturevalue(name)
    xv = torch.randn(5, 9, 6)
    n = 7
    pos = torch.arange(n, dtype=torch.float32)
    table = torch.cos(pos[:, None] / (10000 ** (torch.arange(6) / 6)))
    x = dt(xv, mesh, placements)
    out, comms, sent = counted(lambda: x[:, :n] * table)
    assert comms == {} and sent == table.nbytes
    check(out, xv[:, :n] * table, placements)


@pytest.mark.parametrize("name,placements", [("mesh1d", (Shard(0),)),
                                             ("mesh2d", (Shard(0), Shard(1)))])
@pytest.mark.parametrize("batch", [5, 3])
def test_attention_with_a_plain_mask(request, name, placements, batch):
    mesh = request.getfixturevalue(name)
    q, k, v = (torch.randn(batch, 2, 6, 4) for _ in range(3))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    additive = torch.randn(6, 6)
    dq, dk, dv = (dt(a, mesh, placements) for a in (q, k, v))
    for mask in (causal, additive):
        out, comms, sent = counted(
            lambda: F.scaled_dot_product_attention(dq, dk, dv, attn_mask=mask))
        assert comms == {} and sent == mask.nbytes
        check(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), placements)


def test_numpy_array_turned_tensor(mesh1d):
    a = np.arange(15, dtype=np.float32).reshape(5, 3)
    xv = torch.randn(5, 3)
    x = dt(xv, mesh1d, (Shard(0),))
    check(x + torch.from_numpy(a), xv + torch.from_numpy(a), (Shard(0),))
    check(x + a, xv + torch.as_tensor(a), (Shard(0),))


def test_sent_once_and_again_when_changed(mesh1d):
    xv = torch.randn(6, 4)
    x = dt(xv, mesh1d, (Shard(0),))
    t = torch.randn(6, 4)
    start = dtorch.constants_sent()
    assert start.sends == 0 and start.cached == 0
    _, _, sent = counted(lambda: x + t)
    assert sent == t.nbytes
    stats = dtorch.constants_sent()
    assert (stats.sends, stats.bytes_per_rank, stats.total_bytes) == (1, t.nbytes, 4 * t.nbytes)
    for same in (t, t.clone()):  # the same object, and an equal tensor in a new object
        out, _, sent = counted(lambda: x + same)
        assert sent == 0
        check(out, xv + t, (Shard(0),))
    assert dtorch.constants_sent().sends == 1 and dtorch.constants_sent().hits == 2
    t.add_(1)  # changed in place: sent again
    out, _, sent = counted(lambda: x + t)
    assert sent == t.nbytes and dtorch.constants_sent().sends == 2
    check(out, xv + t, (Shard(0),))


def test_a_growing_mask_is_sent_as_it_changes(mesh1d):
    """A decoding loop: the mask grows one step at a time; each new one is sent once."""
    scores = torch.randn(2, 8, 8)
    x = dt(scores, mesh1d, (Shard(0),))
    for step in (3, 4, 5):
        mask = torch.ones(step, step, dtype=torch.bool).tril()
        for repeat in range(2):
            out, comms, sent = counted(
                lambda: x[:, :step, :step].masked_fill(~mask, float("-inf")))
            assert comms == {}
            # ~mask is a new (equal) tensor each time: cached after the first send
            assert sent == (mask.nbytes if repeat == 0 else 0)
            check(out, scores[:, :step, :step].masked_fill(~mask, float("-inf")), (Shard(0),))
    assert dtorch.constants_sent().sends == 3


def test_lru_bound_evicts_and_frees_the_ranks(mesh1d):
    x = dt(torch.randn(4, 4), mesh1d, (Shard(0),))
    a, b = torch.randn(4, 4), torch.randn(4, 4)  # 64 bytes each
    bound = config.constant_cache_bytes
    config.constant_cache_bytes = 100
    try:
        del_out = x + a
        del del_out
        dtorch.synchronize()
        held = session.get_controller().stats()[0]["tensors"]
        out = x + b  # a is evicted: its rank-side value freed
        del out
        dtorch.synchronize()
        stats = dtorch.constants_sent()
        assert (stats.sends, stats.cached, stats.cached_bytes, stats.evicted) == (2, 1, 64, 1)
        assert session.get_controller().stats()[0]["tensors"] == held
        _, _, sent = counted(lambda: x + b)
        assert sent == 0
        _, _, sent = counted(lambda: x + a)
        assert sent == a.nbytes
        big = torch.randn(4, 8)  # 128 bytes, over the bound: sent each time, never cached
        for _ in range(2):
            out, _, sent = counted(lambda: x @ big)
            assert sent == big.nbytes
        check(out, x.to_torch() @ big, (Shard(0),))
        assert dtorch.constants_sent().cached == 1
    finally:
        config.constant_cache_bytes = bound


def test_size_warning_once_per_shape(mesh1d):
    x = dt(torch.randn(8, 8), mesh1d, (Shard(0),))
    limit = config.constant_warn_bytes
    config.constant_warn_bytes = 128
    try:
        with pytest.warns(ConstantSizeWarning, match=r"shape \(8, 8\).*make it a DTensor"):
            x + torch.randn(8, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            x + torch.randn(8, 8)  # another value, same shape: no second warning
            x + torch.randn(8)  # under the bound
    finally:
        config.constant_warn_bytes = limit


def refused(fn, match):
    """``fn`` raises MixedTensorError (matching) on the controller, nothing issued or sent."""
    c = session.get_controller()
    before, sends = c.issued, dtorch.constants_sent().sends
    with pytest.raises(MixedTensorError, match=match) as info:
        fn()
    assert c.issued == before and dtorch.constants_sent().sends == sends
    assert info.value.__context__ is None  # a clean traceback: no dispatch internals


def test_mixed_tensor_error_remains_where_a_constant_is_wrong(mesh1d):
    x = dt(torch.randn(5, 3), mesh1d, (Shard(0),))
    dtorch.synchronize()
    w = torch.randn(5, 3, requires_grad=True)
    refused(lambda: x * w, "requires grad.*gradient would be lost.*requires_grad=True")
    linear = torch.nn.Linear(3, 2)
    refused(lambda: linear(x), "Parameter.*parallelize_module")
    plain = torch.zeros(5, 3)
    refused(lambda: plain.add_(x), "in-place target")
    refused(lambda: plain.copy_(x), "in-place target")
    row = dt(torch.randn(2, 3), mesh1d, (R,))
    refused(lambda: plain.__setitem__(slice(0, 2), row), "in-place target")
    refused(lambda: torch.add(x, x, out=plain), "out= is a plain torch.Tensor")
    refused(lambda: x + torch.zeros(5, 3, device="meta"), "on meta.*'cpu' mesh")
    assert torch.equal(plain, torch.zeros(5, 3))
    with torch.no_grad():  # no gradient to lose: a constant
        check(x * w, x.to_torch() * w, (Shard(0),))


def test_a_refused_op_sends_no_constant(mesh1d):
    """The constant is sent when the op is planned, so a PlacementError sends nothing; the
    same constant in a legal call is sent then (once)."""
    from test_ops_support import illegal
    xv, t = torch.randn(6, 4), torch.randn(6, 4)
    x = dt(xv, mesh1d, (Shard(0),))
    dtorch.synchronize()
    illegal(lambda: torch.cat([x, t], 0))
    illegal(lambda: torch.cat([t, x], 0))
    assert dtorch.constants_sent().sends == 0
    out, comms, sent = counted(lambda: x + t)
    assert comms == {} and sent == t.nbytes
    check(out, xv + t, (Shard(0),))
    _, _, sent = counted(lambda: t - x)
    assert sent == 0 and dtorch.constants_sent().sends == 1


def test_gradient_flows_past_a_constant(case):
    mesh, placements = case
    xv, t = torch.randn(6, 5), torch.randn(6, 5)
    x = dt(xv, mesh, placements, requires_grad=True)
    (x * t + t).sum().backward()
    ref = xv.clone().requires_grad_()
    (ref * t + t).sum().backward()
    torch.testing.assert_close(x.grad.to_torch(), ref.grad)


def test_plan_sees_a_replicate_constant(mesh1d):
    from dtorch.ops.dispatch import plan_of
    x = dt(torch.randn(5, 3), mesh1d, (Shard(0),))
    plan = plan_of(torch.add, (x, torch.randn(5, 3)))
    assert plan.out_specs[0].placements == (Shard(0),)
    assert plan is plan_of(torch.add, (x, torch.randn(5, 3)))  # one cache entry per shape


class _Positional(torch.nn.Module):
    """torch.nn code that makes its constants in forward, as transformers' models do."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 8)

    def forward(self, x):
        seq = x.shape[1]
        positions = torch.arange(seq, dtype=torch.float32)[:, None]  # a new tensor per call
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        h = self.proj(x) + positions
        scores = h @ h.transpose(-1, -2)
        return scores.masked_fill(~causal, 0.0)


def test_a_parallelized_module_sends_its_constants_once(mesh1d):
    torch.manual_seed(0)
    ref = _Positional()
    model = _Positional()
    model.load_state_dict(ref.state_dict())
    dtorch.parallelize_module(model, mesh1d, {"proj": dtorch.ColwiseParallel(
        output_layouts=Replicate())})
    xv = torch.randn(5, 7, 6)
    x = dt(xv, mesh1d, (Shard(0),))
    with torch.no_grad():
        want = ref(xv)
        out, _, first = counted(lambda: model(x))
        torch.testing.assert_close(out.to_torch(), want, rtol=1e-5, atol=1e-5)
        out, _, again = counted(lambda: model(x))
    assert first > 0 and again == 0
    torch.testing.assert_close(out.to_torch(), want, rtol=1e-5, atol=1e-5)


def test_a_constant_is_never_changed_through_an_aliasing_output(mesh1d):
    """``t.type_as(x)`` / ``t.view_as(x)`` may return the constant itself on the ranks: an
    in-place op on that output must not change what the next use of an equal tensor reads."""
    dtorch.clear_constants()
    x = dtorch.tensor(torch.zeros(4, 4), device_mesh=mesh1d, placements=[Shard(0)])
    torch.ones(4, 4).type_as(x).add_(5)
    assert torch.equal((x + torch.ones(4, 4)).to_torch(), torch.ones(4, 4))
    torch.ones(4, 4).view_as(x).mul_(3)
    assert torch.equal((x + torch.ones(4, 4)).to_torch(), torch.ones(4, 4))
    assert dtorch.constants_sent().sends == 1  # one cached value, a rank-local copy per use


def test_small_constants_see_writes_torch_does_not_count(mesh1d):
    x = dtorch.tensor(torch.zeros(4, 4), device_mesh=mesh1d, placements=[Shard(0)])
    m = torch.full((4, 4), 2.0)
    assert torch.equal((x + m).to_torch(), m)
    m.data.add_(10)  # no version bump
    assert torch.equal((x + m).to_torch(), torch.full((4, 4), 12.0))
    m.numpy()[:] = 7
    assert torch.equal((x + m).to_torch(), torch.full((4, 4), 7.0))


def test_a_plain_in_place_target_of_any_dim_is_refused(mesh1d):
    total = torch.tensor(5.0)
    loss = dtorch.tensor(torch.tensor(2.0), device_mesh=mesh1d)
    c = session.get_controller()
    before = c.issued
    with pytest.raises(MixedTensorError, match="in-place target"):
        total.add_(loss)
    assert c.issued == before
    assert total.item() == 5.0 and loss.to_torch().item() == 2.0


def test_cached_constants_do_not_keep_the_cluster_in_use(live):
    """Only cached constants alive (the user dropped every DTensor): ``dtorch.init`` with a
    different size replaces the cluster, and the cache starts afresh on the new one."""
    import gc
    x = dtorch.ones(4, 4, device_mesh=dtorch.init_device_mesh("cpu", 4))
    y = x + torch.arange(4.0)  # the arange is a cached Replicate constant
    assert torch.equal(y.to_torch(), torch.ones(4, 4) + torch.arange(4.0))
    del x, y
    gc.collect()
    assert dtorch.constants_sent().cached == 1
    try:
        small = dtorch.init(n_workers=2)
        assert small.world == 2
        z = dtorch.ones(2, 4, device_mesh=dtorch.init_device_mesh("cpu", 2)) + torch.arange(4.0)
        assert torch.equal(z.to_torch(), torch.ones(2, 4) + torch.arange(4.0))
        del z
    finally:
        gc.collect()
        dtorch.shutdown()
        dtorch.init(n_workers=4)


def test_a_comparison_with_a_plain_tensor_looks_it_up_once(mesh1d):
    """Comparisons have a decomposed form (a 0-dim Partial operand, scalar_partials); a call
    it does not take must not turn its plain tensors into constants first: one cache lookup
    per call, not two."""
    d = dt(torch.arange(8.0), mesh1d, [Shard(0)])
    t = torch.arange(8.0)
    assert torch.equal((d == t).to_torch(), torch.ones(8, dtype=torch.bool))
    before = dtorch.constants_sent()
    for _ in range(5):
        d == t
    after = dtorch.constants_sent()
    assert (after.hits - before.hits, after.sends - before.sends) == (5, 0)
