"""scaled_dot_product_attention without context parallelism: batch and head sharding."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtorch
from dtorch import Partial, Replicate, Shard
from test_ops_support import Batch, dt, illegal, make, no_comm

R = Replicate()
g = torch.Generator().manual_seed(0)
Q = torch.randn(3, 5, 6, 8, generator=g)
K = torch.randn(3, 5, 7, 8, generator=g)
V = torch.randn(3, 5, 7, 4, generator=g)


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sizes=st.tuples(*[st.integers(1, 5)] * 5), causal=st.booleans(), data=st.data())
def test_batch_and_head_sharding(mesh1d, mesh2d, sizes, causal, data):
    b, h, lq, lk, e = sizes
    q, k, v = torch.randn(b, h, lq, e), torch.randn(b, h, lk, e), torch.randn(b, h, lk, 3)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    batch = Batch()
    legal = [R, Shard(0), Shard(1)]
    cases = [(mesh1d, (p,)) for p in legal] + [
        (mesh2d, (data.draw(st.sampled_from(legal)), data.draw(st.sampled_from(legal))))
        for _ in range(3)]
    for mesh, pl in cases:
        dq, dk, dv = dt(q, mesh, pl), dt(k, mesh, pl), dt(v, mesh, pl)
        out = no_comm(lambda: F.scaled_dot_product_attention(dq, dk, dv, is_causal=causal))
        batch.add(out, expected, pl, atol=1e-5)
        for bad in (Shard(2), Shard(3)):
            wrong = dt(q, mesh, (bad,) + tuple(pl[1:]))
            illegal(lambda: F.scaled_dot_product_attention(wrong, dk, dv, is_causal=causal))
    batch.check()


def test_masks_gqa_and_partial_value(mesh1d, mesh2d):
    mask = torch.randn(3, 1, 6, 7, generator=g)
    batch = Batch()
    q, k, v = (dt(t, mesh2d, [Shard(0), Shard(1)]) for t in (Q, K, V))
    for m, want_mask in ((dt(mask, mesh2d, [R, R]), None), (dt(mask, mesh2d, [Shard(0), R]),
                                                            None)):
        out = no_comm(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m))
        batch.add(out, F.scaled_dot_product_attention(Q, K, V, attn_mask=mask),
                  [Shard(0), Shard(1)], atol=1e-5)
    kq = torch.randn(3, 8, 6, 8, generator=g)  # 8 query heads, 4 kv heads (grouped)
    kk, kv = torch.randn(3, 4, 7, 8, generator=g), torch.randn(3, 4, 7, 8, generator=g)
    out = no_comm(lambda: F.scaled_dot_product_attention(
        dt(kq, mesh1d, [Shard(1)]), dt(kk, mesh1d, [Shard(1)]), dt(kv, mesh1d, [Shard(1)]),
        enable_gqa=True))
    batch.add(out, F.scaled_dot_product_attention(kq, kk, kv, enable_gqa=True), [Shard(1)],
              atol=1e-5)
    vp = make(V.double(), mesh1d, [Partial()], 1)
    out = no_comm(lambda: F.scaled_dot_product_attention(dt(Q.double(), mesh1d, [R]),
                                                         dt(K.double(), mesh1d, [R]), vp))
    batch.add(out, F.scaled_dot_product_attention(Q.double(), K.double(), V.double()),
              [Partial()])
    batch.check()


def test_illegal_attention(mesh1d):
    qs, ks, vs = (dt(t, mesh1d, [Shard(2)]) for t in (Q, K, V))
    illegal(lambda: F.scaled_dot_product_attention(qs, ks, vs), match="context parallelism")
    q0, k1 = dt(Q, mesh1d, [Shard(0)]), dt(K, mesh1d, [Shard(1)])
    v0 = dt(V, mesh1d, [Shard(0)])
    illegal(lambda: F.scaled_dot_product_attention(q0, k1, v0))
    qp = make(Q.double(), mesh1d, [Partial()], 1)
    kr, vr = dt(K.double(), mesh1d, [R]), dt(V.double(), mesh1d, [R])
    illegal(lambda: F.scaled_dot_product_attention(qp, kr, vr))
    kq = torch.randn(2, 8, 4, 8)  # 8 query heads over 2 kv heads on 4 ranks: groups split
    kk = torch.randn(2, 2, 4, 8)
    a, b, c = dt(kq, mesh1d, [Shard(1)]), dt(kk, mesh1d, [Shard(1)]), dt(kk, mesh1d, [Shard(1)])
    illegal(lambda: F.scaled_dot_product_attention(a, b, c, enable_gqa=True), match="kv heads")
    # a plain key is a Replicate constant (dtorch.ops.constants): dropout runs as with a
    # Replicate DTensor key, the same masks under the same seed
    dtorch.manual_seed(3)
    got = F.scaled_dot_product_attention(q0, K, v0, dropout_p=0.1)
    dtorch.manual_seed(3)
    want = F.scaled_dot_product_attention(q0, dt(K, mesh1d, [R]), v0, dropout_p=0.1)
    assert got.placements == (Shard(0),) and torch.equal(got.to_torch(), want.to_torch())


def test_a_replicate_query_key_or_value_beside_shards_is_narrowed(mesh1d, mesh2d):
    batch = Batch()
    want = F.scaled_dot_product_attention(Q, K, V, is_causal=True)
    for mesh, pls in ((mesh1d, ([Shard(0)], [R], [R])), (mesh1d, ([R], [Shard(1)], [R])),
                      (mesh2d, ([Shard(0), Shard(1)], [R, Shard(1)], [Shard(0), R]))):
        q, k, v = (dt(t, mesh, p) for t, p in zip((Q, K, V), pls))
        out = no_comm(lambda: F.scaled_dot_product_attention(q, key=k, value=v, is_causal=True))
        batch.add(out, want, [p for p in pls[0]] if pls[0][0] != R else pls[1], atol=1e-5)
    batch.check()
    qt, kt, vt = (t.double().requires_grad_() for t in (Q, K, V))
    F.scaled_dot_product_attention(qt, kt, vt).sum().backward()
    q, k, v = (dt(t.detach(), mesh1d, p).requires_grad_()
               for t, p in zip((qt, kt, vt), ([Shard(0)], [R], [R])))
    F.scaled_dot_product_attention(q, k, v).sum().backward()
    for d, t in ((q, qt), (k, kt), (v, vt)):
        torch.testing.assert_close(d.grad.to_torch(), t.grad)
    kk = torch.randn(3, 4, 7, 8, generator=g)  # a kv-head count unlike the query's: refused
    q8, kr = dt(torch.randn(3, 8, 6, 8), mesh1d, [Shard(1)]), dt(kk, mesh1d, [R])
    illegal(lambda: F.scaled_dot_product_attention(q8, kr, kr, enable_gqa=True),
            match="Replicate at the same size")
