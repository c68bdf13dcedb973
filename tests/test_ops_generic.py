"""The all-Replicate rule: any deterministic torch function runs on Replicate DTensors, rule or
not, with Replicate outputs and no communication; data-dependent ops run eagerly; random ops
and sharded inputs without a rule raise clearly (real 4-rank cluster, 1-D and 2-D meshes)."""

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.ops import UnsupportedOpError
from dtorch.runtime import session
from test_ops_support import Batch, dt, no_comm

R = Replicate()
aten = torch.ops.aten

NO_RULE = {  # ops that have no dedicated rule (checked below), with torch's inputs: the aten
    # operators under torch.cov, torch.histc, ... (the Python functions have rules)
    "cov": (aten.cov.default, lambda: (torch.randn(3, 5),)),
    "corrcoef": (aten.corrcoef.default, lambda: (torch.randn(3, 5),)),
    "histc": (lambda x: aten.histc.default(x, 4, -2, 2), lambda: (torch.randn(10),)),
    "pdist": (aten.pdist.default, lambda: (torch.randn(4, 3),)),
    "quantile": (lambda x: aten.quantile.scalar(x, 0.25, 1), lambda: (torch.randn(3, 5),)),
    "vander": (lambda x: aten.vander.default(x, 3), lambda: (torch.randn(4),)),
}
DATA_DEPENDENT = {
    "nonzero": lambda x: torch.nonzero(x > 0),
    "unique": lambda x: torch.unique(x.round(), return_counts=True),
    "masked_select": lambda x: x.masked_select(x > 0),
    # predicates both ways: a constant answer must fail one of each pair
    "allclose-true": lambda x: torch.allclose(x, x + 1e-9),
    "allclose-false": lambda x: torch.allclose(x, x + 1e-3),
    "equal-true": lambda x: torch.equal(x, x * 1),
    "equal-false": lambda x: torch.equal(x, x * 2),
    "argwhere": lambda x: torch.argwhere(x < 0),
}


def _replicated(mesh, tensors):
    return [dt(t, mesh, [R] * mesh.ndim) for t in tensors]


def _check(batch, got, want, mesh):
    if isinstance(want, torch.Tensor):
        batch.add(got, want, [R] * mesh.ndim)
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            _check(batch, g, w, mesh)
    else:
        assert got == want


@pytest.mark.parametrize("mesh_name", ["mesh1d", "mesh2d"])
def test_ops_without_a_rule_run_on_replicated_inputs(mesh_name, request):
    mesh = request.getfixturevalue(mesh_name)
    batch = Batch()
    for name, (fn, make) in NO_RULE.items():
        inputs = make()
        got = no_comm(lambda: fn(*_replicated(mesh, inputs)))
        _check(batch, got, fn(*inputs), mesh)
    batch.check()


def test_the_listed_ops_really_have_no_rule():
    for fn in (aten.cov.default, aten.corrcoef.default, aten.histc.default, aten.pdist.default,
               aten.quantile.scalar, aten.vander.default):
        assert dtorch.ops.lookup(fn) is None, fn


@pytest.mark.parametrize("name", sorted(DATA_DEPENDENT))
def test_data_dependent_ops_run_eagerly(mesh1d, name):
    fn = DATA_DEPENDENT[name]
    x = torch.randn(4, 5) * 2
    got = no_comm(lambda: fn(dt(x, mesh1d, [R])))
    if name.endswith(("-true", "-false")):
        assert got is name.endswith("-true")
    batch = Batch()
    _check(batch, got, fn(x), mesh1d)
    batch.check()


def test_an_eager_op_on_a_failed_input_raises_at_the_call(mesh1d):
    bad = dtorch.from_local([torch.ones(2, dtype=torch.complex64)] * 4, mesh1d,
                            [Partial("max")]).redistribute(placements=[R])  # fails on the ranks
    with pytest.raises(dtorch.RemoteError, match="nonzero|MAX|max"):
        torch.nonzero(bad)
    with pytest.raises(dtorch.RemoteError):
        dtorch.synchronize()
    assert torch.nonzero(dt(torch.tensor([0., 1.]), mesh1d, [R])).to_torch().tolist() == [[1]]


def test_generic_inplace_ops_keep_the_handle(mesh1d):
    y, m, v = torch.randn(3), torch.randn(3, 4), torch.randn(4)
    dy = dt(y, mesh1d, [R])
    out = dy.addmv_(dt(m, mesh1d, [R]), dt(v, mesh1d, [R]))
    assert out is dy
    assert torch.allclose(dy.to_torch(), y.addmv_(m, v), atol=1e-6)


def test_a_sub_mesh_runs_only_on_its_ranks(mesh2d):
    sub = mesh2d.unbind("dp")[1]  # ranks 2, 3
    a = torch.randn(3, 5)
    got = torch.cov(dt(a, sub, [R]))
    assert got.device_mesh == sub
    assert torch.allclose(got.to_local(3), torch.cov(a))


@pytest.mark.parametrize("call", [
    torch.bernoulli, lambda x: x.uniform_(), lambda x: torch.multinomial(x, 2),
    torch.rand_like, lambda x: F.rrelu(x, training=True)])
@pytest.mark.parametrize("placement", [R, Shard(0)], ids=["replicate", "shard0"])
def test_random_ops_raise_clearly_before_anything_is_sent(mesh1d, call, placement):
    x = dt(torch.rand(3, 4) * 0.8 + 0.1, mesh1d, [placement])
    c = session.get_controller()
    before = c.issued
    with pytest.raises(NotImplementedError, match="random"):  # UnsupportedOpError is one
        call(x)
    assert c.issued == before


def test_deterministic_variants_of_random_ops_run(mesh1d):
    x = torch.randn(3, 4)
    d = dt(x, mesh1d, [R])
    batch = Batch()
    batch.add(F.dropout(d, 0.5, training=False), x, [R])
    batch.add(F.rrelu(d), F.rrelu(x), [R])
    batch.check()


def test_sharded_inputs_without_a_rule_say_replicate_works(mesh1d):
    s = dt(torch.randn(4, 4), mesh1d, [Shard(0)])
    with pytest.raises(UnsupportedOpError, match=r"aten\.cov.*Replicate.*coverage\(\)"):
        aten.cov.default(s)


def test_dtorch_namespace_routes_ops_without_a_rule(mesh1d):
    a = torch.randn(3, 4)
    got = dtorch.cov(dt(a, mesh1d, [R]))
    assert torch.allclose(got.to_torch(), torch.cov(a))
    assert torch.equal(dtorch.cov(a), torch.cov(a))  # plain torch without DTensors


def test_torch_ops_operators_travel_by_name(mesh1d):
    x = torch.randn(4, 5)
    got = torch.ops.aten._softmax_backward_data(dt(x, mesh1d, [R]), dt(x, mesh1d, [R]), 0,
                                                torch.float32)
    want = torch.ops.aten._softmax_backward_data(x, x, 0, torch.float32)
    assert torch.allclose(got.to_torch(), want)
    assert torch.equal(torch.ops.aten.slice.Tensor(dt(x, mesh1d, [R]), 1, 1, 3).to_torch(),
                       x[:, 1:3])


def test_an_op_that_fails_only_on_zero_stand_ins_runs(mesh1d):
    """torch.cov checks its weights' values: meta cannot run it and zeros make it raise."""
    x, w = torch.randn(4, 5), torch.rand(5) + 0.5
    got = torch.cov(dt(x, mesh1d, [R]), aweights=dt(w, mesh1d, [R]))
    assert torch.allclose(got.to_torch(), torch.cov(x, aweights=w), atol=1e-6)


def test_plain_tensors_beside_replicated_inputs_are_constants(mesh1d):
    z = torch.randn(5, 5, 5)
    assert torch.allclose(torch.masked.std(dt(z, mesh1d, [R])).to_torch(), torch.masked.std(z))
    x = torch.randn(3, 4)
    assert torch.allclose((dt(x, mesh1d, [R]) + torch.ones(4)).to_torch(), x + 1)
    got = dt(x, mesh1d, [Shard(0)]) + torch.ones(4)  # beside a Shard too (dtorch.ops.constants)
    assert got.placements == (Shard(0),) and torch.allclose(got.to_torch(), x + 1)
    sharded = torch.masked.std(dt(z, mesh1d, [Shard(0)]), dim=1)
    assert torch.allclose(sharded.to_torch(), torch.masked.std(z, dim=1))


def test_sparse_tensors_are_refused_clearly_and_nothing_breaks(mesh1d):
    x = torch.randn(4, 5)
    with pytest.raises(UnsupportedOpError, match="dense tensors.*to_dense"):
        dtorch.distribute_tensor(torch.eye(4).to_sparse_csr(), mesh1d, [R])
    with pytest.raises(UnsupportedOpError, match="sparse_coo tensor; DTensors are dense"):
        dt(x, mesh1d, [R]).to_sparse()
    with pytest.raises(UnsupportedOpError, match="change the shape"):
        dt(x, mesh1d, [R]).resize_(2, 2)
    dtorch.synchronize()  # no rank hit an error: nothing was left behind
    assert torch.equal((dt(x, mesh1d, [R]) + 1).to_torch(), x + 1)


def test_attention_dropout_in_training_is_refused(mesh1d):
    e, h = 8, 2
    q = torch.randn(3, 1, e)
    w_in, b_in = torch.randn(3 * e, e), torch.randn(3 * e)
    w_out, b_out = torch.randn(e, e), torch.randn(e)
    d = [dt(t, mesh1d, [R]) for t in (q, w_in, b_in, w_out, b_out)]
    args = (d[0], d[0], d[0], e, h, d[1], d[2], None, None, False, 0.5, d[3], d[4])
    with pytest.raises(UnsupportedOpError, match="dropout in training mode"):
        F.multi_head_attention_forward(*args, training=True)
    got, _ = F.multi_head_attention_forward(*args, training=False)
    want, _ = F.multi_head_attention_forward(q, q, q, e, h, w_in, b_in, None, None, False, 0.5,
                                             w_out, b_out, training=False)
    assert torch.allclose(got.to_torch(), want, atol=1e-5)
