"""The autograd API of DTensors, as torch's, on a real 4-rank cluster: requires_grad on
factories, leaves and non-leaves, grad_fn, detach, retain_grad, hooks, grad modes,
dtorch.autograd.grad/backward, modules; and every bad input a clear error on the controller,
raised before anything is sent, with the cluster usable after."""

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard, init_device_mesh
from dtorch.runtime import session

R = Replicate()


def _sent():
    c = session.get_controller()
    return c.issued, c.flushes


def refused(fn, exc=RuntimeError, match=None):
    """``fn`` raises ``exc`` on the controller and issues nothing to the workers."""
    before = _sent()
    with pytest.raises(exc, match=match):
        fn()
    assert _sent() == before, "a refused call sent something to the workers"


def usable(mesh):
    """The cluster still computes right after an error."""
    x = dtorch.arange(8.0, device_mesh=mesh, placements=[Shard(0)], requires_grad=True)
    (x * x).sum().backward()
    torch.testing.assert_close(x.grad.to_torch(), 2 * torch.arange(8.0))


def test_factories_take_requires_grad(mesh1d):
    kw = dict(device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    made = [dtorch.zeros(4, 2, **kw), dtorch.ones(4, 2, **kw), dtorch.empty(4, 2, **kw),
            dtorch.full((4, 2), 3.0, **kw), dtorch.rand(4, 2, **kw), dtorch.randn(4, 2, **kw),
            dtorch.arange(4.0, **kw), dtorch.tensor(torch.ones(4, 2), **kw),
            dtorch.DTensor(torch.ones(4), mesh1d, [Shard(0)], requires_grad=True)]
    base = dtorch.zeros(4, 2, device_mesh=mesh1d, placements=[Shard(0)])
    made += [f(base, requires_grad=True) for f in (dtorch.zeros_like, dtorch.ones_like,
                                                   dtorch.empty_like, dtorch.rand_like,
                                                   dtorch.randn_like)]
    made.append(dtorch.full_like(base, 2.0, requires_grad=True))
    for t in made:
        assert t.requires_grad and t.is_leaf and t.grad is None and t.grad_fn is None
    assert not dtorch.zeros(4, device_mesh=mesh1d).requires_grad
    assert not base.requires_grad and base.is_leaf


def test_distribute_tensor_keeps_requires_grad(mesh1d):
    t = torch.randn(4, 3, requires_grad=True)
    d = dtorch.distribute_tensor(t, mesh1d, [Shard(0)])
    assert d.requires_grad and d.is_leaf
    assert not dtorch.distribute_tensor(t.detach(), mesh1d, [Shard(0)]).requires_grad
    (d * 3).sum().backward()
    assert t.grad is None  # a new leaf: the torch tensor's graph is not the DTensor's
    torch.testing.assert_close(d.grad.to_torch(), torch.full((4, 3), 3.0))


def test_requires_grad_on_integers_raises_like_torch(mesh1d):
    match = "only Tensors of floating point dtype can require gradients"
    refused(lambda: dtorch.randint(0, 5, (4,), device_mesh=mesh1d, requires_grad=True),
            match=match)
    refused(lambda: dtorch.arange(4, device_mesh=mesh1d, requires_grad=True), match=match)
    refused(lambda: dtorch.tensor(torch.arange(4), device_mesh=mesh1d, requires_grad=True),
            match=match)
    i = dtorch.arange(4, device_mesh=mesh1d)
    refused(lambda: i.requires_grad_(), match=match)
    with pytest.raises(RuntimeError, match=match):
        torch.arange(4).requires_grad_()  # the same words as torch
    assert not i.requires_grad
    usable(mesh1d)


def test_graph_attributes(mesh1d):
    x = dtorch.randn(8, 4, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    y = x * 2
    z = y.sum()
    assert y.grad_fn.name() == "MulBackward0" and z.grad_fn.name() == "SumBackward0"
    assert not y.is_leaf and y.requires_grad
    (fn, index), = z.grad_fn.next_functions
    assert fn is y.grad_fn and index == 0
    (acc, _), = y.grad_fn.next_functions
    assert acc.name() == "torch::autograd::AccumulateGrad" and acc.variable is x._ag
    assert (x > 0).requires_grad is False  # comparisons are not differentiable
    assert x.redistribute(placements=[R]).argmax().requires_grad is False
    d = y.detach()
    assert not d.requires_grad and d.is_leaf and d.grad_fn is None
    torch.testing.assert_close(d.to_torch(), y.to_torch())
    assert not x.data.requires_grad
    r = x.redistribute(placements=[R])
    assert r.grad_fn.name() == "RedistributeBackward"
    refused(lambda: y.requires_grad_(False), match="only change requires_grad flags of leaf")


def test_retain_grad_and_hooks(mesh1d):
    v = torch.randn(8, 4)
    t = v.clone().requires_grad_()
    x = dtorch.tensor(v, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    seen = []
    ty, y = t.exp(), x.exp()
    ty.retain_grad()
    y.retain_grad()
    assert y.retains_grad and not x.retains_grad
    y.register_hook(lambda g: seen.append(g.placements))
    handle = x.register_hook(lambda g: g * 10)
    t.register_hook(lambda g: g * 10)
    (ty * ty).sum().backward()
    (y * y).sum().backward()
    assert seen == [(Shard(0),)]
    torch.testing.assert_close(y.grad.to_torch(), ty.grad)
    torch.testing.assert_close(x.grad.to_torch(), t.grad)
    handle.remove()
    x.grad = None
    (x * 1).sum().backward()
    torch.testing.assert_close(x.grad.to_torch(), torch.ones(8, 4))
    plain = dtorch.ones(3, device_mesh=mesh1d)
    refused(lambda: plain.register_hook(print), match="doesn't require gradient")


def test_a_hook_on_an_activation_runs_after_its_handle_is_gone(mesh1d):
    """As torch's: a hook registered on an intermediate inside a forward lives with the node
    that made it, so it runs though nothing holds the activation any more."""
    v = torch.randn(8, 4)
    x = dtorch.tensor(v, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    seen = []

    def forward(x):
        h = x.exp()
        h.register_hook(lambda g: seen.append(g.placements) or g * 2)
        return h * 3

    forward(x).sum().backward()
    assert seen == [(Shard(0),)]
    torch.testing.assert_close(x.grad.to_torch(), 6 * v.exp())


def test_grad_modes_record_nothing(mesh1d):
    x = dtorch.randn(8, 4, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    with torch.no_grad():
        assert not (x * 2).requires_grad
        with torch.enable_grad():
            assert (x * 2).requires_grad
    with torch.inference_mode():
        assert not (x * 2).requires_grad
    with torch.set_grad_enabled(False):
        assert not x.exp().requires_grad
        assert not x.redistribute(placements=[R]).requires_grad
    assert (x * 2).requires_grad


def test_autograd_grad_and_backward_functions(mesh1d):
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    x = dtorch.tensor(a, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    y = dtorch.tensor(b, device_mesh=mesh1d, placements=[Shard(1)], requires_grad=True)
    unused = dtorch.ones(3, device_mesh=mesh1d, requires_grad=True)
    out = (x * 3).sum()
    gx, = dtorch.autograd.grad(out, x, retain_graph=True)
    torch.testing.assert_close(gx.to_torch(), torch.full((8, 4), 3.0))
    assert x.grad is None  # grad() leaves .grad alone
    refused(lambda: dtorch.autograd.grad(out, [x, unused], retain_graph=True),
            match="appears to not have been used")
    gx, gu = dtorch.autograd.grad(out, [x, unused], allow_unused=True, retain_graph=True)
    assert gu is None
    _, gu = dtorch.autograd.grad(out, [x, unused], materialize_grads=True, retain_graph=True)
    torch.testing.assert_close(gu.to_torch(), torch.zeros(3))
    plain = dtorch.ones(2, device_mesh=mesh1d)
    refused(lambda: dtorch.autograd.grad(out, [plain]), match="does not require grad")
    s1, s2 = x.sin().sum(), (y * y).sum()
    dtorch.autograd.backward([s1, s2])
    torch.testing.assert_close(x.grad.to_torch(), a.cos())
    torch.testing.assert_close(y.grad.to_torch(), 2 * b)
    v = x * y.redistribute(placements=[Shard(0)])
    dtorch.autograd.backward([v], [dtorch.ones(8, 4, device_mesh=mesh1d,
                                               placements=[Shard(0)])])
    torch.testing.assert_close(y.grad.to_torch(), 2 * b + a)


def test_create_graph_is_not_supported_yet(mesh1d):
    x = dtorch.ones(4, device_mesh=mesh1d, requires_grad=True)
    s = (x * x).sum()
    refused(lambda: s.backward(create_graph=True), NotImplementedError, "not supported yet")
    refused(lambda: dtorch.autograd.grad(s, x, create_graph=True), NotImplementedError,
            "not supported yet")


def test_backward_twice_without_retain_graph(mesh1d):
    x = dtorch.randn(8, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    s = (x.exp() * 2).sum()
    s.backward(retain_graph=True)
    s.backward()  # retained once: runs, and accumulates
    refused(lambda: s.backward(), match="backward through the graph a second time")
    torch.testing.assert_close(x.grad.to_torch(), 4 * x.to_torch().exp())
    usable(mesh1d)


def test_non_scalar_backward_needs_a_gradient(mesh1d):
    x = dtorch.randn(8, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    y = x * 2
    refused(lambda: y.backward(), match="grad can be implicitly created only for scalar")
    wrong, plain = dtorch.ones(4, device_mesh=mesh1d), dtorch.ones(3, device_mesh=mesh1d).sum()
    refused(lambda: y.backward(wrong), match="Mismatch in shape")
    refused(lambda: plain.backward(), match="does not require grad")
    y.backward(torch.ones(8))  # a plain torch gradient is sent with the placements needed
    torch.testing.assert_close(x.grad.to_torch(), torch.full((8,), 2.0))
    usable(mesh1d)


def test_inplace_on_a_leaf_that_requires_grad(mesh1d):
    x = dtorch.randn(8, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    refused(lambda: x.add_(1), match="leaf Variable that requires grad is being used in an "
                                     "in-place operation")
    xr = dtorch.randn(8, device_mesh=mesh1d, requires_grad=True)
    refused(lambda: xr.__setitem__(0, 5.0), match="in-place operation")
    with torch.no_grad():  # as optimizers do
        x.add_(1)
        x.mul_(0)
    torch.testing.assert_close(x.to_torch(), torch.zeros(8))
    usable(mesh1d)


def _torch_inplace_message(modify) -> str:
    """torch's own error for the same program on one device."""
    x = torch.randn(8, requires_grad=True)
    y = x.exp()
    modify(y)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as caught:
        y.sum().backward()
    return str(caught.value)


@pytest.mark.parametrize("how", ["itself", "detached", "zero_"])
def test_inplace_on_a_saved_tensor_is_refused_at_backward_on_the_controller(mesh1d, how):
    """torch refuses at backward, through the version counter; the controller knows the same
    from its plans (exp saved its output; an in-place op on it, or on a detached handle of
    it, bumped its version) and refuses before anything is sent."""
    modify = {"itself": lambda y: y.mul_(2),
              "detached": lambda y: y.detach().add_(1),
              "zero_": lambda y: y.detach().zero_()}[how]
    assert "is at version 1; expected version 0 instead" in _torch_inplace_message(modify)
    x = dtorch.randn(8, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    y = x.exp()          # ExpBackward saves its output
    modify(y)
    s = y.sum()
    refused(lambda: s.backward(), match=r"modified by an inplace operation: \[DTensor "
                                        r"torch.float32 \[8\]\], which is output 0 of "
                                        r"ExpBackward0, is at version 1; expected version 0")
    usable(mesh1d)


def test_an_inplace_op_that_saves_its_own_target_is_refused(mesh1d):
    """``x.mul_(x)`` saves x as it was read; the op itself leaves it at the next version, so
    backward refuses, as torch does."""
    v = torch.randn(8)
    a = torch.randn(8, requires_grad=True)
    t = a * 1
    t.mul_(t)
    with pytest.raises(RuntimeError, match="is at version 1; expected version 0"):
        t.sum().backward()
    x = dtorch.tensor(v, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    y = x * 1
    y.mul_(y)
    s = y.sum()
    refused(lambda: s.backward(), match=r"input \d of MulBackward0, is at version 1; expected "
                                        r"version 0")
    usable(mesh1d)


def test_no_refusal_when_what_was_modified_was_not_saved(mesh1d):
    """add saves neither input: modifying one afterwards is fine, as in torch."""
    v = torch.randn(8)
    x = dtorch.tensor(v, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    w = dtorch.ones(8, device_mesh=mesh1d, placements=[Shard(0)])
    s = (x + w).sum()
    w.add_(1)
    s.backward()
    torch.testing.assert_close(x.grad.to_torch(), torch.ones(8))


def test_inplace_through_a_view_fails_at_backward_on_the_ranks_like_torch(mesh1d):
    """Aliases made by view ops are not followed on the controller: torch's own version check
    on the ranks refuses, its error reaches the controller at the next read, and the cluster
    stays usable."""
    x = dtorch.randn(8, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    y = x.exp()
    y.detach().view(8).mul_(2)   # the same local memory as y, through a view
    y.sum().backward()
    with pytest.raises(dtorch.RemoteError, match="modified by an inplace operation"):
        x.grad.to_torch()
    with pytest.raises(dtorch.RemoteError):
        dtorch.synchronize()
    usable(mesh1d)


def test_grad_setter_checks(mesh1d):
    x = dtorch.zeros(4, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    wrong = dtorch.ones(3, device_mesh=mesh1d)
    refused(lambda: setattr(x, "grad", wrong), match="different size")
    refused(lambda: setattr(x, "grad", torch.ones(4)), TypeError, "must be a DTensor")
    x.grad = dtorch.ones(4, device_mesh=mesh1d, placements=[Shard(0)])
    (x * 2).sum().backward()
    torch.testing.assert_close(x.grad.to_torch(), torch.full((4,), 3.0))


def test_module_parameters_require_grad_buffers_do_not(mesh2d):
    lin = dtorch.nn.ColumnParallelLinear(4, 6, device_mesh=mesh2d)
    emb = dtorch.nn.Embedding(10, 4, padding_idx=0, device_mesh=mesh2d)
    for p in list(lin.parameters()) + list(emb.parameters()):
        assert p.requires_grad and p.is_leaf
    lin.register_buffer("steps", dtorch.zeros(2, device_mesh=mesh2d))
    assert not lin.steps.requires_grad
    lin.load_state_dict({"weight": torch.randn(6, 4), "bias": torch.randn(6),
                         "steps": torch.ones(2)})
    assert lin.weight.requires_grad and lin.bias.requires_grad and not lin.steps.requires_grad
    x = dtorch.randn(3, 4, device_mesh=mesh2d)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.placements == lin.weight.placements
    lin.zero_grad(set_to_none=False)
    torch.testing.assert_close(lin.weight.grad.to_torch(), torch.zeros(6, 4))
    lin.zero_grad()
    assert lin.weight.grad is None and lin.bias.grad is None
    lin.requires_grad_(False)
    assert not lin.weight.requires_grad and not lin(x).requires_grad
    lin.double()
    assert not lin.weight.requires_grad and lin.weight.dtype == torch.float64


def test_value_dependent_ops_are_recorded_too(mesh1d):
    """Ops that run eagerly (their output shapes depend on the values) keep their graph:
    torch's gradients, torch's requires_grad flags on their outputs."""
    v = torch.tensor([0.0, 1.5, 0.0, -2.0, 3.0, 0.0, 1.0, 1.5])
    t = v.clone().requires_grad_()
    x = dtorch.tensor(v, device_mesh=mesh1d, requires_grad=True)
    assert torch.allclose(x, x) is True
    assert torch.equal(torch.nonzero(x).to_torch(), torch.nonzero(v))
    assert torch.unique(x).requires_grad == torch.unique(t).requires_grad
    picked, want = torch.masked_select(x, x > 0), torch.masked_select(t, t > 0)
    assert picked.requires_grad and picked.grad_fn is not None
    (picked * picked).sum().backward()
    (want * want).sum().backward()
    torch.testing.assert_close(x.grad.to_torch(), t.grad)
    m = torch.randn(3, 5, dtype=torch.float64)
    tm = m.clone().requires_grad_()
    dm = dtorch.tensor(m, device_mesh=mesh1d, requires_grad=True)
    (torch.cov(dm) ** 2).sum().backward()
    (torch.cov(tm) ** 2).sum().backward()
    torch.testing.assert_close(dm.grad.to_torch(), tm.grad)
    usable(mesh1d)


def test_composites_say_no_backward_yet(live):
    """A composite without a backward plan (Ulysses before a ring dim) runs (an inference
    forward needs no torch.no_grad()); a backward that reaches it raises on the controller
    before anything is sent."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ulysses_cp", "ring_cp"))
    sp = [Shard(2), Shard(2)]
    q = dtorch.randn(1, 4, 8, 8, device_mesh=mesh, placements=sp, requires_grad=True)
    k = dtorch.randn(1, 4, 8, 8, device_mesh=mesh, placements=sp)
    v = dtorch.randn(1, 4, 8, 8, device_mesh=mesh, placements=sp)
    with dtorch.CommDebugMode() as mode:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert mode.get_comm_counts() == {"all_to_all": 4, "send_recv": 1} and out.requires_grad
    with torch.no_grad():
        plain = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out.to_torch(), plain.to_torch())
    loss = out.sum()
    refused(lambda: loss.backward(), dtorch.UnsupportedOpError, "no backward yet for")
    usable(init_device_mesh("cpu", 4))


def test_leaf_and_retained_grads_accumulate_as_torchs_through_a_local_move(mesh1d):
    """Two backwards through a redistribute that moves nothing in backward (Partial ->
    Replicate hands its gradient on as it is): the leaf's and the retained gradient each
    accumulate once, as torch's do."""
    x = dtorch.tensor(torch.arange(4.), device_mesh=mesh1d, placements=[R], requires_grad=True)
    y = x * 1.0
    y.retain_grad()
    z = y.redistribute(placements=[dtorch.Partial()])
    z.sum().backward(retain_graph=True)
    first = y.grad.to_torch()
    z.sum().backward()
    assert torch.equal(y.grad.to_torch(), first + first)  # torch accumulates retained grads too
    xt = torch.arange(4., requires_grad=True)
    yt = xt * 1.0
    yt.retain_grad()
    yt.sum().backward(retain_graph=True)
    yt.sum().backward()
    assert torch.equal(x.grad.to_torch(), xt.grad) and torch.equal(y.grad.to_torch(), yt.grad)


def test_grad_to_an_intermediate_ignores_the_spent_graph_below_it(mesh1d):
    """As torch: only the nodes a gradient goes through are checked, so ``grad(z, y)`` runs
    after a backward freed the graph below ``y``."""
    v = torch.randn(8)
    x = dtorch.tensor(v, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    y = x.exp()
    z = (y * y).sum()
    y.sum().backward()  # frees exp's graph
    refused(lambda: z.backward(), match="backward through the graph a second time")
    gy, = dtorch.autograd.grad(z, y)
    xt = v.clone().requires_grad_()
    yt = xt.exp()
    zt = (yt * yt).sum()
    yt.sum().backward()
    gyt, = torch.autograd.grad(zt, yt)
    torch.testing.assert_close(gy.to_torch(), gyt)
    assert gy.placements == (Shard(0),)
