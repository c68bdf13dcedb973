"""What each parallelism costs in backward, on a real 4-rank cluster: exact collective counts
per mesh dim from CommDebugMode, checked against the workers' own step counts and
torch.distributed calls (tests/ledgers.py), and every gradient against plain torch.

- DP linear: only the dp all_reduces of the Replicate weight and bias gradients;
- TP MLP (ColumnParallelLinear -> RowParallelLinear): no tp collective in backward when the
  input does not require grad (one all_reduce when it does: Megatron's ``f``);
- sequence parallel: all_gather forward / reduce_scatter backward (and the converse);
- FSDP-style Shard(0) weights brought to Replicate at use: reduce_scatter back, ``.grad``
  Shard(0);
- two pipeline stages: the gradient goes back point to point;
- a ``gradient=`` of other placements is redistributed (counted).
"""

import torch
import torch.nn.functional as F

import dtorch
from dtorch import DeviceMesh, Partial, Replicate, Shard, init_device_mesh
from ledgers import counted

R = Replicate()


def run(fn):
    """``(counts, records)`` of ``fn`` (a forward or a backward), the ledgers checked (the
    work issued before runs first, so the workers' counts hold only ``fn``'s)."""
    dtorch.synchronize()
    with dtorch.CommDebugMode() as mode:
        _, counts = counted(fn)
    return counts, mode.get_comm_records()


def _phase_dims(records):
    return sorted({(r.kind, r.mesh_dim_name, r.phase) for r in records})


def _load(module, state):
    module.load_state_dict({k: v.detach().clone() for k, v in state.items()})
    return module


def test_dp_linear_backward_is_only_dp_reductions(live):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("dp",))
    ref = torch.nn.Linear(4, 3)
    lin = _load(dtorch.nn.ReplicateParallelLinear(4, 3, device_mesh=mesh), ref.state_dict())
    x, t = torch.randn(8, 4), torch.randn(8, 3)
    dx = dtorch.tensor(x, device_mesh=mesh, placements=[Shard(0)])
    dt_ = dtorch.tensor(t, device_mesh=mesh, placements=[Shard(0)])
    counts, _ = run(lambda: ((lin(dx) - dt_) ** 2).mean())
    assert counts == {}
    loss = ((lin(dx) - dt_) ** 2).mean()
    counts, records = run(lambda: loss.backward())
    assert counts == {"all_reduce": 2}  # weight and bias: Partial -> Replicate on dp
    assert _phase_dims(records) == [("all_reduce", "dp", "backward")]
    ((ref(x) - t) ** 2).mean().backward()
    assert lin.weight.grad.placements == (R,) and lin.bias.grad.placements == (R,)
    torch.testing.assert_close(lin.weight.grad.to_torch(), ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad.to_torch(), ref.bias.grad)
    torch.testing.assert_close(loss.to_torch(), ((ref(x) - t) ** 2).mean())


def _mlp(mesh):
    col_ref, row_ref = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)
    col = _load(dtorch.nn.ColumnParallelLinear(4, 8, device_mesh=mesh), col_ref.state_dict())
    row = _load(dtorch.nn.RowParallelLinear(8, 4, device_mesh=mesh), row_ref.state_dict())
    return col, row, col_ref, row_ref


def _check_mlp_grads(col, row, col_ref, row_ref):
    for d, t in ((col.weight, col_ref.weight), (col.bias, col_ref.bias),
                 (row.weight, row_ref.weight), (row.bias, row_ref.bias)):
        assert d.grad.placements == d.placements
        torch.testing.assert_close(d.grad.to_torch(), t.grad)


def test_tp_mlp_backward_has_no_tp_collective(live):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("tp",))
    col, row, col_ref, row_ref = _mlp(mesh)
    x = torch.randn(6, 4)
    dx = dtorch.tensor(x, device_mesh=mesh)
    y = row(torch.relu(col(dx)))
    assert y.placements == (Partial(),)
    loss = (y.redistribute(placements=[R]) ** 2).sum()  # one all_reduce forward
    counts, _ = run(lambda: loss.backward())
    assert counts == {}
    (row_ref(torch.relu(col_ref(x))) ** 2).sum().backward()
    _check_mlp_grads(col, row, col_ref, row_ref)


def test_tp_mlp_input_that_requires_grad_costs_one_all_reduce(live):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("tp",))
    col, row, col_ref, row_ref = _mlp(mesh)
    x = torch.randn(6, 4, requires_grad=True)
    dx = dtorch.tensor(x.detach(), device_mesh=mesh, requires_grad=True)
    loss = (row(torch.relu(col(dx))).redistribute(placements=[R]) ** 2).sum()
    counts, records = run(lambda: loss.backward())
    assert counts == {"all_reduce": 1} and _phase_dims(records) == [
        ("all_reduce", "tp", "backward")]
    (row_ref(torch.relu(col_ref(x))) ** 2).sum().backward()
    _check_mlp_grads(col, row, col_ref, row_ref)
    torch.testing.assert_close(dx.grad.to_torch(), x.grad)


def test_sequence_parallel_all_gather_forward_reduce_scatter_backward(live):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("tp",))
    col, row, col_ref, row_ref = _mlp(mesh)
    x = torch.randn(8, 4, requires_grad=True)  # 8 tokens, sequence-sharded on tp
    dx = dtorch.tensor(x.detach(), device_mesh=mesh, placements=[Shard(0)], requires_grad=True)

    def forward():
        h = dx.redistribute(placements=[R])                   # all_gather
        y = row(torch.relu(col(h)))                          # Partial on tp
        return (y.redistribute(placements=[Shard(0)]).tanh() ** 2).sum()  # reduce_scatter
    counts, _ = run(forward)
    assert counts == {"all_gather": 1, "reduce_scatter": 1}
    loss = forward()
    counts, records = run(lambda: loss.backward())
    assert counts == {"all_gather": 1, "reduce_scatter": 1}
    assert {r.phase for r in records} == {"backward"}
    (row_ref(torch.relu(col_ref(x))).tanh() ** 2).sum().backward()
    _check_mlp_grads(col, row, col_ref, row_ref)
    assert dx.grad.placements == (Shard(0),)
    torch.testing.assert_close(dx.grad.to_torch(), x.grad)


def test_fsdp_style_weight_reduce_scatters_back(live):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("dp",))
    w_ref = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(12, 4)
    w = dtorch.tensor(w_ref.detach(), device_mesh=mesh, placements=[Shard(0)],
                      requires_grad=True)
    dx = dtorch.tensor(x, device_mesh=mesh, placements=[Shard(0)])
    counts, _ = run(lambda: (F.linear(dx, w.redistribute(placements=[R])) ** 2).mean())
    assert counts == {"all_gather": 1}
    loss = (F.linear(dx, w.redistribute(placements=[R])) ** 2).mean()
    counts, records = run(lambda: loss.backward())
    assert counts == {"reduce_scatter": 1}
    assert _phase_dims(records) == [("reduce_scatter", "dp", "backward")]
    (F.linear(x, w_ref) ** 2).mean().backward()
    assert w.grad.placements == (Shard(0),)
    torch.testing.assert_close(w.grad.to_torch(), w_ref.grad)


def test_pipeline_stages_send_the_gradient_back_point_to_point(live):
    stage0, stage1 = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])
    a, b = torch.randn(4, 4, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    x = torch.randn(3, 4)
    w0 = dtorch.tensor(a.detach(), device_mesh=stage0, requires_grad=True)
    w1 = dtorch.tensor(b.detach(), device_mesh=stage1, requires_grad=True)
    dx = dtorch.tensor(x, device_mesh=stage0)
    h = torch.tanh(dx @ w0)
    dtorch.synchronize()
    moved, forward_counts = counted(lambda: h.redistribute(device_mesh=stage1))
    assert forward_counts == {"send_recv": 1}
    loss = ((moved @ w1) ** 2).sum()
    counts, records = run(lambda: loss.backward())
    assert counts == {"send_recv": 1} and {r.phase for r in records} == {"backward"}
    ((torch.tanh(x @ a) @ b) ** 2).sum().backward()
    assert w0.grad.device_mesh == stage0 and w1.grad.device_mesh == stage1
    torch.testing.assert_close(w0.grad.to_torch(), a.grad)
    torch.testing.assert_close(w1.grad.to_torch(), b.grad)


def test_gradient_of_other_placements_is_redistributed_and_counted(mesh1d):
    v = torch.randn(8, 4)
    x = dtorch.tensor(v, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    y = x * 2
    g = torch.randn(8, 4)
    counts, _ = run(lambda: y.backward(dtorch.tensor(g, device_mesh=mesh1d), retain_graph=True))
    assert counts == {}  # Replicate -> Shard(0): each rank keeps its slice
    torch.testing.assert_close(x.grad.to_torch(), 2 * g)
    partial = dtorch.tensor(g, device_mesh=mesh1d, placements=[Partial()])
    counts, _ = run(lambda: y.backward(partial))
    assert counts == {"reduce_scatter": 1}
    torch.testing.assert_close(x.grad.to_torch(), 4 * g)


def test_between_mesh_dims_all_to_all_back(mesh1d):
    v = torch.randn(8, 8, requires_grad=True)
    x = dtorch.tensor(v.detach(), device_mesh=mesh1d, placements=[Shard(0)],
                      requires_grad=True)
    loss = (x.redistribute(placements=[Shard(1)]).exp()).sum()
    counts, _ = run(lambda: loss.backward())
    assert counts == {"all_to_all": 1}
    v.exp().sum().backward()
    torch.testing.assert_close(x.grad.to_torch(), v.grad)


def test_no_sync_defers_the_dp_reduction_to_the_first_backward_outside(live):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("dp",))
    ref = torch.nn.Linear(4, 3)
    lin = _load(dtorch.nn.ReplicateParallelLinear(4, 3, device_mesh=mesh), ref.state_dict())
    batches = [(torch.randn(8, 4), torch.randn(8, 3)) for _ in range(4)]

    def loss_of(x, t):
        dx = dtorch.tensor(x, device_mesh=mesh, placements=[Shard(0)])
        dt_ = dtorch.tensor(t, device_mesh=mesh, placements=[Shard(0)])
        return ((lin(dx) - dt_) ** 2).mean()
    with lin.no_sync():
        for x, t in batches[:3]:
            loss = loss_of(x, t)
            counts, _ = run(lambda: loss.backward())
            assert counts == {}
            assert lin.weight.grad.placements == (Partial(),)
    loss = loss_of(*batches[3])
    counts, _ = run(lambda: loss.backward())
    assert counts == {"all_reduce": 2}  # once per parameter, for all four micro-batches
    for x, t in batches:
        ((ref(x) - t) ** 2).mean().backward()
    assert lin.weight.grad.placements == (R,) and lin.bias.grad.placements == (R,)
    torch.testing.assert_close(lin.weight.grad.to_torch(), ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad.to_torch(), ref.bias.grad)


class _FSDPLinear(dtorch.nn.Module):
    """A Shard(0) weight gathered at use (all_gather forward, reduce_scatter back)."""

    def __init__(self, weight, mesh):
        super().__init__()
        self.weight = dtorch.tensor(weight, device_mesh=mesh, placements=[Shard(0)])

    def forward(self, x):
        return F.linear(x, self.weight.redistribute(placements=[R]))


def test_no_sync_defers_fsdps_reduce_scatter_too(live):
    """Inside no_sync a gathered Shard(0) weight's gradient stays Partial (no reduce_scatter
    per micro-batch); the first backward outside reduce_scatters once, for all of them."""
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("dp",))
    w_ref = torch.randn(8, 4, requires_grad=True)
    lin = _FSDPLinear(w_ref.detach(), mesh)
    batches = [torch.randn(12, 4) for _ in range(3)]

    def loss_of(x):
        return (lin(dtorch.tensor(x, device_mesh=mesh, placements=[Shard(0)])) ** 2).mean()
    with lin.no_sync():
        for x in batches[:2]:
            loss = loss_of(x)
            counts, _ = run(lambda: loss.backward())
            assert counts == {}
            assert lin.weight.grad.placements == (Partial(),)
    loss = loss_of(batches[2])
    counts, records = run(lambda: loss.backward())
    assert counts == {"reduce_scatter": 1}
    assert [r.gradient_of for r in records] == ["weight"]
    for x in batches:
        (F.linear(x, w_ref) ** 2).mean().backward()
    assert lin.weight.grad.placements == (Shard(0),)
    torch.testing.assert_close(lin.weight.grad.to_torch(), w_ref.grad)


def _qkv(n, hq, hk, length, e=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, length, e, generator=g, dtype=torch.float64)
            for h in (hq, hk, hk)]


def test_ulysses_backward_is_the_transposed_all_to_alls(live):
    """Forward: the composite's four all_to_alls; backward: one for the output's gradient
    and one per input that requires grad, all on ulysses_cp; gradients as torch's."""
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("ulysses_cp",))
    for (hq, hk, length, causal, grads) in ((4, 4, 8, False, 3), (8, 4, 10, True, 3),
                                            (4, 4, 8, True, 1)):
        q, k, v = _qkv(2, hq, hk, length)
        kw = dict(is_causal=causal, enable_gqa=hq != hk)
        ts = [t.clone().requires_grad_(i < grads) for i, t in enumerate((q, k, v))]
        ds = [dtorch.tensor(t, device_mesh=mesh, placements=[Shard(2)],
                            requires_grad=i < grads) for i, t in enumerate((q, k, v))]
        counts, _ = run(lambda: F.scaled_dot_product_attention(*ds, **kw))
        assert counts == {"all_to_all": 4}
        loss = (F.scaled_dot_product_attention(*ds, **kw) ** 2).sum()
        counts, records = run(lambda: loss.backward())
        assert counts == {"all_to_all": 1 + grads}
        assert _phase_dims(records) == [("all_to_all", "ulysses_cp", "backward")]
        (F.scaled_dot_product_attention(*ts, **kw) ** 2).sum().backward()
        for d, t in zip(ds[:grads], ts):
            assert d.grad.placements == (Shard(2),)
            torch.testing.assert_close(d.grad.to_torch(), t.grad)


def test_ulysses_backward_beside_dp(live):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ulysses_cp"))
    q, k, v = _qkv(2, 4, 4, 6, seed=1)
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    ds = [dtorch.tensor(t, device_mesh=mesh, placements=[Shard(0), Shard(2)],
                        requires_grad=True) for t in (q, k, v)]
    loss = F.scaled_dot_product_attention(*ds, is_causal=True).sum()
    counts, _ = run(lambda: loss.backward())
    assert counts == {"all_to_all": 4}
    F.scaled_dot_product_attention(*ts, is_causal=True).sum().backward()
    for d, t in zip(ds, ts):
        torch.testing.assert_close(d.grad.to_torch(), t.grad)
