"""F.multi_head_attention_forward and an unmodified torch.nn.MultiheadAttention on batch-sharded
DTensors (dtorch/ops/mha.py) against torch: outputs and attention weights, masks, uneven and
empty shards, 1-D and 2x2 meshes, zero collectives, gradients, and the refusals."""

import copy

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Replicate, Shard
from ledgers import counted
from test_ops_support import dt, illegal

R = Replicate()
E, H = 8, 2


def _weights(seed=0, separate=False):
    g = torch.Generator().manual_seed(seed)
    w = {"in_proj_weight": torch.randn(3 * E, E, generator=g, dtype=torch.float64) / 3,
         "in_proj_bias": torch.randn(3 * E, generator=g, dtype=torch.float64),
         "out_proj_weight": torch.randn(E, E, generator=g, dtype=torch.float64) / 3,
         "out_proj_bias": torch.randn(E, generator=g, dtype=torch.float64)}
    if separate:
        for name, part in zip(("q", "k", "v"), w["in_proj_weight"].chunk(3)):
            w[f"{name}_proj_weight"] = part.clone()
        w["use_separate_proj_weight"] = True
    return w


def _call(q, k, v, w, **kwargs):
    return F.multi_head_attention_forward(
        q, k, v, E, H, w.get("in_proj_weight"), w["in_proj_bias"], None, None, False, 0.0,
        w["out_proj_weight"], w["out_proj_bias"], training=False,
        **{n: w[n] for n in ("use_separate_proj_weight", "q_proj_weight", "k_proj_weight",
                             "v_proj_weight") if n in w}, **kwargs)


def _masks(n, length, src, seed=1):
    g = torch.Generator().manual_seed(seed)
    padding = torch.rand(n, src, generator=g) > 0.7
    padding[:, 0] = False  # every row attends somewhere
    attn = torch.rand(length, src, generator=g) > 0.8
    attn[:, 0] = False
    return padding, attn, torch.randn(n * H, length, src, generator=g, dtype=torch.float64)


CASES = {  # name -> keyword arguments (masks named by key; "padding" is sharded like the batch)
    "weights": {}, "no-weights": {"need_weights": False},
    "per-head": {"average_attn_weights": False},
    "bool-masks": {"key_padding_mask": "padding", "attn_mask": "attn"},
    "float-3d-mask": {"attn_mask": "attn3"},
    "padding-sdpa": {"key_padding_mask": "padding", "need_weights": False},
    "causal": {"attn_mask": "causal", "is_causal": True, "need_weights": False},
    "separate-weights": {"separate": True},
}


@pytest.mark.parametrize("n", [5, 3])  # uneven; fewer samples than ranks (an empty block)
@pytest.mark.parametrize("name", sorted(CASES))
def test_batch_sharded_attention_matches_torch(mesh1d, name, n):
    kwargs = dict(CASES[name])
    w = _weights(separate=kwargs.pop("separate", False))
    length, src = 4, 6
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(s, n, E, generator=g, dtype=torch.float64)
               for s in (length, src, src))
    padding, attn, attn3 = _masks(n, length, src)
    masks = {"padding": padding, "attn": attn, "attn3": attn3,
             "causal": torch.triu(torch.ones(length, src, dtype=torch.bool), 1)}
    want_out, want_w = _call(q, k, v, w, **{a: masks.get(b, b) if isinstance(b, str) else b
                                             for a, b in kwargs.items()})
    dw = {a: dt(b, mesh1d, [R]) if isinstance(b, torch.Tensor) else b for a, b in w.items()}
    dmasks = {a: dt(m, mesh1d, [Shard(0)] if a == "padding" else [R]) for a, m in masks.items()}
    dq, dk, dv = (dt(t, mesh1d, [Shard(1)]) for t in (q, k, v))
    dtorch.synchronize()
    (out, weights), counts = counted(lambda: _call(dq, dk, dv, dw, **{
        a: dmasks.get(b, b) if isinstance(b, str) else b for a, b in kwargs.items()}))
    assert counts == {}
    assert out.placements == (Shard(1),)
    torch.testing.assert_close(out.to_torch(), want_out)
    if want_w is None:
        assert weights is None
    else:
        assert weights.placements == (Shard(0),)
        torch.testing.assert_close(weights.to_torch(), want_w)


def test_on_a_2x2_mesh_and_gradients(mesh2d):
    w = _weights()
    q = torch.randn(4, 6, E, dtype=torch.float64, requires_grad=True)
    out, weights = _call(q, q, q, w)
    (out.pow(2).sum() + weights.sum()).backward()
    dw = {a: dt(b, mesh2d, [R, R]).requires_grad_() for a, b in w.items()}
    dq = dt(q.detach(), mesh2d, [Shard(1), R]).requires_grad_()
    dout, dweights = _call(dq, dq, dq, dw)
    assert dout.placements == (Shard(1), R)
    torch.testing.assert_close(dout.to_torch(), out.detach())
    (dout.pow(2).sum() + dweights.sum()).backward()  # Partial + Partial: one sum
    torch.testing.assert_close(dq.grad.to_torch(), q.grad)


@pytest.mark.parametrize("batch_first", [False, True])
def test_an_unmodified_multihead_attention_module(mesh1d, batch_first):
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(E, H, batch_first=batch_first).double()
    reference = copy.deepcopy(module)
    dtorch.distribute_module(module, mesh1d)
    x = torch.randn(3, 5, E, dtype=torch.float64, requires_grad=True)  # batch 3 or 5
    dx = dt(x.detach(), mesh1d, [Shard(0 if batch_first else 1)]).requires_grad_()
    dtorch.synchronize()
    (out, weights), counts = counted(lambda: module(dx, dx, dx))
    assert counts == {}
    want, want_w = reference(x, x, x)
    torch.testing.assert_close(out.to_torch(), want)
    torch.testing.assert_close(weights.to_torch(), want_w)
    (out.redistribute(placements=[R]) ** 2).sum().backward()
    (want ** 2).sum().backward()
    torch.testing.assert_close(dx.grad.to_torch(), x.grad)
    torch.testing.assert_close(module.in_proj_weight.grad.to_torch(),
                               reference.in_proj_weight.grad)


def test_refusals(mesh1d):
    w = {a: dt(b, mesh1d, [R]) for a, b in _weights().items()}
    x = dt(torch.randn(4, 3, E, dtype=torch.float64), mesh1d, [Shard(1)])
    bias_k = dt(torch.randn(1, 1, E, dtype=torch.float64), mesh1d, [R])
    with pytest.raises(dtorch.UnsupportedOpError, match="bias_k, bias_v"):
        F.multi_head_attention_forward(x, x, x, E, H, w["in_proj_weight"], w["in_proj_bias"],
                                       bias_k, bias_k, False, 0.0, w["out_proj_weight"],
                                       w["out_proj_bias"], training=False)
    with pytest.raises(NotImplementedError, match="random"):
        F.multi_head_attention_forward(x, x, x, E, H, w["in_proj_weight"], w["in_proj_bias"],
                                       None, None, False, 0.5, w["out_proj_weight"],
                                       w["out_proj_bias"], training=True)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        _call(x, x, x, w, is_causal=True)
    unbatched = dt(torch.randn(4, E, dtype=torch.float64), mesh1d, [Shard(0)])  # sequence
    illegal(lambda: _call(unbatched, unbatched, unbatched, w), match="query.redistribute")
    sequence = dt(torch.randn(4, 3, E, dtype=torch.float64), mesh1d, [Shard(0)])
    illegal(lambda: _call(sequence, x, x, w), match=r"only the batch dim.*\n.*# all_gather")
    tp = dict(w, out_proj_weight=dt(torch.randn(E, E, dtype=torch.float64), mesh1d, [Shard(0)]))
    illegal(lambda: _call(x, x, x, tp), match="out_proj_weight.redistribute")
