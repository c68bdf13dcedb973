"""Single-device torch code, unchanged, on DTensors: a transformer block forward.

Data parallel (batch sharded, weights replicated) runs the code as written; tensor parallel
(Megatron layout) needs exactly the two ``redistribute`` calls a TP program makes, and nothing
else moves data.
"""

import torch
import torch.nn.functional as F

import dtorch
from dtorch import Partial, Replicate, Shard
from test_ops_support import Batch, dt, no_comm

R = Replicate()
B, T, D, H, FF = 3, 5, 16, 4, 24


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = {name: torch.randn(shape, generator=g) * 0.2 for name, shape in (
        ("wq", (D, D)), ("wk", (D, D)), ("wv", (D, D)), ("wo", (D, D)), ("w1", (FF, D)),
        ("w2", (D, FF)), ("w3", (FF, D)))}
    w["g1"], w["g2"] = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
    return w


def block(x, w, reduce=lambda t: t):
    """A Llama-style block written for one device; ``reduce`` is where TP all-reduces."""
    b, t, d = x.shape
    h = F.rms_norm(x, (d,), w["g1"], eps=1e-6)
    q = F.linear(h, w["wq"]).view(b, t, -1, d // H).transpose(1, 2)
    k = F.linear(h, w["wk"]).view(b, t, -1, d // H).transpose(1, 2)
    v = F.linear(h, w["wv"]).view(b, t, -1, d // H).transpose(1, 2)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    a = a.transpose(1, 2).reshape(b, t, -1)
    x = x + reduce(F.linear(a, w["wo"]))
    h = F.rms_norm(x, (d,), w["g2"], eps=1e-6)
    m = F.silu(F.linear(h, w["w1"])) * F.linear(h, w["w3"])
    return x + reduce(F.linear(m, w["w2"]))


def test_data_parallel_block_runs_unchanged(mesh1d):
    x, w = torch.randn(B, T, D), weights()
    expected = block(x, w)
    dw = {k: dt(v, mesh1d, [R]) for k, v in w.items()}
    out = no_comm(lambda: block(dt(x, mesh1d, [Shard(0)]), dw))
    batch = Batch()
    batch.add(out, expected, [Shard(0)], atol=1e-5)
    batch.check()


def test_tensor_parallel_block_with_explicit_reductions(mesh2d):
    x, w = torch.randn(B, T, D), weights(1)
    expected = block(x, w)
    col = [R, Shard(0)]  # output features split on tp (heads, hidden)
    row = [R, Shard(1)]  # input features split on tp
    dw = {"wq": col, "wk": col, "wv": col, "w1": col, "w3": col, "wo": row, "w2": row,
          "g1": [R, R], "g2": [R, R]}
    dw = {k: dt(w[k], mesh2d, p) for k, p in dw.items()}
    xd = dt(x, mesh2d, [Shard(0), R])

    def reduce(t):
        assert t.placements == (Shard(0), Partial())
        return t.redistribute(placements=[Shard(0), R])

    with dtorch.CommDebugMode() as mode:
        out = block(xd, dw, reduce)
    assert mode.get_comm_counts() == {"all_reduce": 2}
    batch = Batch()
    batch.add(out, expected, [Shard(0), R], atol=1e-5)
    batch.check()
