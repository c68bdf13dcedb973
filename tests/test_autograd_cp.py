"""Backward through context-parallel attention (the ring; Ulysses beside tp) on a real 4-rank
cluster: dQ, dK, dV against torch's ``F.scaled_dot_product_attention`` backward on one device,
with exact collective counts of forward and backward on both ledgers (the controller's
CommDebugMode and the workers' own counts, tests/ledgers.py), and refusals that name the fix.

The ring's backward costs, on a ring of n: ``n - 1`` send_recv for K/V and ``n`` for dK/dV
(when key or value requires grad); under ``is_causal`` with equal lengths (zig-zag balanced)
2 all_to_all in (query rows with output, log-sum-exp and gradient; K/V) and one out per
gradient group (dQ; dK/dV)."""

import gc

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import DeviceMesh, Replicate, Shard, init_device_mesh
from dtorch.ops.cp_ring_backward import plan_ring_backward
from dtorch.spec import make_spec
from ledgers import counted

R = Replicate()
S2 = Shard(2)


def qkv(n=2, hq=4, hk=None, lq=8, lk=8, e=8, ev=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    hk = hk or hq
    return (torch.randn(n, hq, lq, e, generator=g, dtype=torch.float64),
            torch.randn(n, hk, lk, e, generator=g, dtype=torch.float64),
            torch.randn(n, hk, lk, ev, generator=g, dtype=torch.float64))


def run(fn):
    """``(result, counts, records)`` of ``fn``, the ledgers checked against each other."""
    dtorch.synchronize()
    with dtorch.CommDebugMode() as mode:
        out, counts = counted(fn)
    return out, counts, mode.get_comm_records()


def ring_backward_counts(n, causal, lq, lk, needs) -> dict:
    """What the ring's backward costs (the module doc)."""
    kv = needs[1] or needs[2]
    counts = {"send_recv": n - 1 + (n if kv else 0)}
    if causal and lq == lk:
        counts["all_to_all"] = 2 + needs[0] + kv
    return counts


def ring_forward_counts(n, causal, lq, lk) -> dict:
    return {"send_recv": n - 1, **({"all_to_all": 4} if causal and lq == lk else {})}


def check(mesh, placements, tensors, needs=(True, True, True), **kw):
    """Forward and backward of ``(out * w).sum()`` on ``mesh``: counts and gradients."""
    ring = mesh.mesh_dim_names.index("ring_cp")
    n, lq, lk = mesh.shape[ring], tensors[0].shape[2], tensors[1].shape[2]
    causal = kw.get("is_causal", False)
    ts = [t.clone().requires_grad_(need) for t, need in zip(tensors, needs)]
    ds = [dtorch.tensor(t, device_mesh=mesh, placements=placements, requires_grad=need)
          for t, need in zip(tensors, needs)]
    ref = F.scaled_dot_product_attention(*ts, **kw)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=ref.dtype)
    dw = dtorch.tensor(w, device_mesh=mesh, placements=placements)
    out, counts, _ = run(lambda: F.scaled_dot_product_attention(*ds, **kw))
    assert counts == ring_forward_counts(n, causal, lq, lk)
    assert out.grad_fn.name() == "RingAttentionBackward"
    loss = (out * dw).sum()
    _, counts, records = run(lambda: loss.backward())
    assert counts == ring_backward_counts(n, causal, lq, lk, needs)
    assert {(r.mesh_dim_name, r.phase) for r in records} == {("ring_cp", "backward")}
    (ref * w).sum().backward()
    torch.testing.assert_close(out.to_torch(), ref.detach())
    for d, t in zip(ds, ts):
        if t.requires_grad:
            assert d.grad.placements == tuple(placements)
            torch.testing.assert_close(d.grad.to_torch(), t.grad)
        else:
            assert d.grad is None


SHAPES = {"even": {}, "uneven": {"lq": 7, "lk": 7}, "L!=S": {"lq": 5, "lk": 11},
          "gqa": {"hq": 8, "hk": 2}, "gqa-uneven": {"hq": 4, "hk": 2, "lq": 9, "lk": 6}}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("ranks", [[1, 3], [0, 1, 2, 3]], ids=["ring2", "ring4"])
def test_ring_backward_matches_torch_with_exact_counts(live, ranks, causal, shape):
    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("ring_cp",))
    q, k, v = qkv(**SHAPES[shape])
    check(mesh, [S2], (q, k, v), is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("names, placements, shape", [
    (("dp", "ring_cp"), [Shard(0), S2], {"n": 3, "lq": 9, "lk": 9}),
    (("tp", "ring_cp"), [Shard(1), S2], {"hq": 8, "hk": 4, "lq": 7, "lk": 7}),
    (("ring_cp", "tp"), [S2, Shard(1)], {"hq": 4, "lq": 6, "lk": 10}),
    (("ring_cp", "dp"), [S2, R], {"lq": 8, "lk": 8}),
], ids=["dp2xring2", "tp2xring2-gqa", "ring2xtp2", "ring2xreplicate"])
def test_ring_backward_beside_dp_and_tp(live, names, placements, shape, causal):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    q, k, v = qkv(**shape)
    check(mesh, placements, (q, k, v), is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def test_ring_backward_with_masks_and_scale(live):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("ring_cp",))
    q, k, v = qkv(lq=6, lk=9)
    g = torch.Generator().manual_seed(3)
    bool_mask = torch.rand(2, 1, 6, 9, generator=g) > 0.4
    bool_mask[..., 0] = True  # every row keeps a key: torch's gradient is defined
    float_mask = torch.randn(6, 9, generator=g, dtype=torch.float64)
    for mask in (bool_mask, float_mask):
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        ds = [dtorch.tensor(t, device_mesh=mesh, placements=[S2], requires_grad=True)
              for t in (q, k, v)]
        dm = dtorch.tensor(mask, device_mesh=mesh, placements=[R])
        out = F.scaled_dot_product_attention(*ds, attn_mask=dm, scale=0.3)
        _, counts, _ = run(lambda: (out ** 2).sum().backward())
        assert counts == ring_backward_counts(4, False, 6, 9, (True, True, True))
        (F.scaled_dot_product_attention(*ts, attn_mask=mask, scale=0.3) ** 2).sum().backward()
        for d, t in zip(ds, ts):
            torch.testing.assert_close(d.grad.to_torch(), t.grad)


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True),
                                   (False, False, True)], ids=["q", "kv", "v"])
def test_ring_backward_moves_only_the_gradients_asked_for(live, needs):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("ring_cp",))
    check(mesh, [S2], qkv(), needs=needs, is_causal=True)


def test_ring_self_attention_sums_the_gradients_of_one_input(live):
    mesh = init_device_mesh("cpu", 2, mesh_dim_names=("ring_cp",))
    x, _, _ = qkv(e=6)
    t = x.clone().requires_grad_()
    d = dtorch.tensor(x, device_mesh=mesh, placements=[S2], requires_grad=True)
    (F.scaled_dot_product_attention(d, d, d, is_causal=True) ** 2).sum().backward()
    (F.scaled_dot_product_attention(t, t, t, is_causal=True) ** 2).sum().backward()
    assert d.grad.placements == (S2,)
    torch.testing.assert_close(d.grad.to_torch(), t.grad)


def test_ring_backward_twice_needs_retain_graph(live):
    mesh = init_device_mesh("cpu", 2, mesh_dim_names=("ring_cp",))
    q, k, v = qkv()
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    ds = [dtorch.tensor(t, device_mesh=mesh, placements=[S2], requires_grad=True)
          for t in (q, k, v)]
    loss = F.scaled_dot_product_attention(*ds, is_causal=True).sum()
    loss.backward(retain_graph=True)
    loss.backward()  # accumulates, as torch's
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    ref = F.scaled_dot_product_attention(*ts, is_causal=True).sum()
    ref.backward(retain_graph=True)
    ref.backward()
    for d, t in zip(ds, ts):
        torch.testing.assert_close(d.grad.to_torch(), t.grad)


def test_cp_backward_refusals_say_why_and_the_cluster_goes_on(live):
    ring = init_device_mesh("cpu", 4, mesh_dim_names=("ring_cp",))
    q, k, v = qkv()
    ds = [dtorch.tensor(t, device_mesh=ring, placements=[S2], requires_grad=True)
          for t in (q, k, v)]
    mask = dtorch.tensor(torch.randn(8, 8, dtype=torch.float64), device_mesh=ring,
                         requires_grad=True)
    out = F.scaled_dot_product_attention(*ds, attn_mask=mask)  # the forward runs
    torch.testing.assert_close(out.to_torch(), F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.to_torch()))
    with pytest.raises(dtorch.UnsupportedOpError, match="attn_mask that requires grad.*"
                       "detach the mask"):
        out.sum().backward()
    both = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ulysses_cp", "ring_cp"))
    ds = [dtorch.tensor(t, device_mesh=both, placements=[S2, S2], requires_grad=True)
          for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ds)  # the composite runs
    torch.testing.assert_close(out.to_torch(), F.scaled_dot_product_attention(q, k, v))
    with pytest.raises(dtorch.UnsupportedOpError, match="list 'ring_cp' before ulysses_cp"):
        out.sum().backward()
    check(ring, [S2], (q, k, v), is_causal=True)  # the cluster goes on


def test_ring_backward_plan_shifts_and_exchanges_in_order():
    """ring4, causal: the zig-zag all_to_alls in, then per step the K/V shift posted before
    the compute and the dK/dV shift after it, then dQ's and dK/dV's all_to_alls out."""
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("ring_cp",))
    spec = make_spec((1, 2, 16, 4), torch.float32, mesh, [S2])
    plan = plan_ring_backward(spec, spec, spec, False, True, None, 0, (True, True, True))
    kinds = [s.kind for s in plan.collectives]
    assert kinds == ["all_to_all"] * 2 + ["send_recv"] * 7 + ["all_to_all"] * 2
    names = [type(s).__name__ for s in plan.steps]
    steps = [getattr(s.fn, "__name__", "") if type(s).__name__ == "Local" else
             type(s).__name__ for s in plan.steps]
    first = steps.index("ring_grad_step")
    assert steps[first - 1] == "Shift" and steps[first + 1] == "Shift"
    assert len(plan.outputs) == 3 and "Exchange" in names


@pytest.mark.parametrize("names", [("tp", "ulysses_cp"), ("ulysses_cp", "tp")],
                         ids=["tp-first", "ulysses-first"])
@pytest.mark.parametrize("tp, hq, hk", [(Shard(1), 8, 4), (Shard(1), 8, 2), (Shard(1), 4, 4),
                                        (R, 6, 3)],
                         ids=["heads-gqa", "heads-gqa-repeated", "heads", "replicate-gqa"])
def test_ulysses_backward_with_heads_on_tp(live, tp, hq, hk, names):
    """tp x ulysses: the heads split on tp, then on ulysses_cp inside (with tp listed after
    ulysses_cp, through the heads viewed as [tp blocks, heads per block]); forward the four
    all_to_alls of the composite, backward their transposes, all on ulysses_cp (grouped
    key/value heads that would not stay over their query heads are repeated locally)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    placements = [tp, S2] if names[0] == "tp" else [S2, tp]
    q, k, v = qkv(hq=hq, hk=hk, lq=7, lk=7)
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    ds = [dtorch.tensor(t, device_mesh=mesh, placements=placements, requires_grad=True)
          for t in (q, k, v)]
    kw = dict(is_causal=True, enable_gqa=hq != hk)
    out, counts, _ = run(lambda: F.scaled_dot_product_attention(*ds, **kw))
    assert counts == {"all_to_all": 4}
    assert out.placements == tuple(placements)
    loss = (out ** 2).sum()
    _, counts, records = run(lambda: loss.backward())
    assert counts == {"all_to_all": 4}
    assert {(r.mesh_dim_name, r.phase) for r in records} == {("ulysses_cp", "backward")}
    (F.scaled_dot_product_attention(*ts, **kw) ** 2).sum().backward()
    for d, t in zip(ds, ts):
        assert d.grad.placements == tuple(placements)
        torch.testing.assert_close(d.grad.to_torch(), t.grad)



@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ulysses_then_ring_backward(live, causal):
    """ring_cp x ulysses_cp: Ulysses' all_to_alls on ulysses_cp (recorded), the ring on the
    head-sharded blocks with its own backward (zig-zag balanced when causal)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring_cp", "ulysses_cp"))
    q, k, v = qkv(hq=4, hk=2, lq=10, lk=10)
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    ds = [dtorch.tensor(t, device_mesh=mesh, placements=[S2, S2], requires_grad=True)
          for t in (q, k, v)]
    kw = dict(is_causal=causal, enable_gqa=True)
    out, _, records = run(lambda: F.scaled_dot_product_attention(*ds, **kw))
    ring = ring_forward_counts(2, causal, 10, 10)
    assert _by_dim(records) == {("all_to_all", "ulysses_cp"): 4, **_on_ring(ring)}
    loss = (out ** 2).sum()
    _, _, records = run(lambda: loss.backward())
    ring = ring_backward_counts(2, causal, 10, 10, (True, True, True))
    assert _by_dim(records) == {("all_to_all", "ulysses_cp"): 4, **_on_ring(ring)}
    (F.scaled_dot_product_attention(*ts, **kw) ** 2).sum().backward()
    for d, t in zip(ds, ts):
        assert d.grad.placements == (S2, S2)
        torch.testing.assert_close(d.grad.to_torch(), t.grad)


def _by_dim(records) -> dict:
    out: dict = {}
    for r in records:
        out[(r.kind, r.mesh_dim_name)] = out.get((r.kind, r.mesh_dim_name), 0) + 1
    return out


def _on_ring(counts) -> dict:
    return {(kind, "ring_cp"): n for kind, n in counts.items()}


def _held():
    """Per rank: (tensors stored, their bytes, local graphs kept)."""
    gc.collect()
    dtorch.synchronize()
    return [(s["tensors"], s["bytes"], s["graphs"]) for s in dtorch.rank_stats()]


def test_ring_keeps_its_saved_tensors_only_until_backward(live):
    """The output and log-sum-exp the ring keeps for backward are freed by a backward
    without retain_graph, or with the output's handle; a training loop does not grow."""
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("ring_cp",))
    ds = [dtorch.tensor(t, device_mesh=mesh, placements=[S2], requires_grad=True)
          for t in qkv()]

    def step():
        F.scaled_dot_product_attention(*ds, is_causal=True).sum().backward()
        for d in ds:
            d.grad = None
    step()
    first = _held()
    for _ in range(20):
        step()
    assert _held() == first
    out = F.scaled_dot_product_attention(*ds, is_causal=True)  # no backward
    assert _held() != first
    del out
    assert _held() == first


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_backward_in_bfloat16_is_about_as_close_as_torchs(live, causal):
    """bfloat16 on ring4: each gradient within 2.5x of torch's own bfloat16 error, both
    measured against float64 on the same (rounded) inputs. The log-sum-exp is kept as a
    rounded value plus its rounding error (a plain bfloat16 one is 3-5x off here)."""
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("ring_cp",))
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(2, 4, 32, 16, generator=g, dtype=torch.float64).mul(2).bfloat16()
                  for _ in range(4))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    (F.scaled_dot_product_attention(*exact, is_causal=causal) * w.double()).sum().backward()
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    (F.scaled_dot_product_attention(*ts, is_causal=causal) * w).sum().backward()
    ds = [dtorch.tensor(t, device_mesh=mesh, placements=[S2], requires_grad=True)
          for t in (q, k, v)]
    dw = dtorch.tensor(w, device_mesh=mesh, placements=[S2])
    (F.scaled_dot_product_attention(*ds, is_causal=causal) * dw).sum().backward()
    for d, t, e in zip(ds, ts, exact):
        assert d.grad.dtype == torch.bfloat16
        ours = (d.grad.to_torch().double() - e.grad).abs().max()
        torchs = (t.grad.double() - e.grad).abs().max()
        assert ours <= 2.5 * torchs, (ours, torchs)


def test_ring_backward_after_an_in_place_change_of_its_input_raises_torchs_error(live):
    mesh = init_device_mesh("cpu", 2, mesh_dim_names=("ring_cp",))
    q, k, v = qkv()
    dq = dtorch.tensor(q, device_mesh=mesh, placements=[S2], requires_grad=True)
    dk, dv = (dtorch.tensor(t, device_mesh=mesh, placements=[S2]) for t in (k, v))
    loss = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True).sum()
    with torch.no_grad():
        dk.mul_(2)  # the ring's backward would read the new key
    loss.backward()
    with pytest.raises(dtorch.RemoteError, match="modified by an inplace operation"):
        dq.grad.to_torch()
    with pytest.raises(dtorch.RemoteError, match="the key of ring attention is at version"):
        dtorch.synchronize()  # the failure itself, reported once
    check(mesh, [S2], (q, k, v), is_causal=True)  # the cluster goes on
