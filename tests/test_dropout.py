"""Dropout in training on a real 4-rank cluster, from dtorch's counter-based random stream.

For one ``dtorch.manual_seed`` the mask is the same on every mesh and placement, equal to
the one-device ``dtorch.random`` reference; each rank draws only its own block (the workers'
``random_values`` count); nothing is communicated (exact counts, both ledgers); gradients
match torch computing ``x * noise``; the stream's counter advances per call and reseeding
replays it; bad inputs raise on the controller before anything is sent.
"""

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Partial, Replicate, Shard, init_device_mesh
from dtorch import random as stream
from ledgers import counted

R = Replicate()
SHAPE = (10, 7)  # uneven on 4 ranks both ways: rows 3, 3, 3, 1 and columns 2, 2, 2, 1


# the stream itself: pure, no cluster --------------------------------------------------------
def _python_bits(index: int, seed: int, counter: int) -> int:
    """The hash in Python ints (exact): what the int64 torch ops must give."""
    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) % 2 ** 32
        x ^= x >> 15
        x = (x * 0x846CA68B) % 2 ** 32
        return x ^ (x >> 16)
    k0, k1 = stream._keys(seed, counter)
    return mix(mix((index % 2 ** 32) ^ k0) ^ (index >> 32) ^ k1)


def test_hash_is_exact_for_large_indices_and_seeds():
    index = torch.tensor([0, 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 40 + 7, 2 ** 62])
    for seed, counter in ((0, 0), (2 ** 64 - 1, 5), (123456789, 2 ** 40)):
        got = stream.hash_bits(index, seed, counter).tolist()
        assert got == [_python_bits(i, seed, counter) for i in index.tolist()]


def test_masks_drop_p_and_counters_are_independent():
    for p in (0.1, 0.5, 0.9):
        keep = stream.dropout_mask((400, 250), p, seed=0, counter=0)
        assert abs((~keep).float().mean().item() - p) < 0.01
    a, b = (stream.dropout_mask((400, 250), 0.5, seed=0, counter=c) for c in (0, 1))
    assert abs((a == b).float().mean().item() - 0.5) < 0.01
    c = stream.dropout_mask((400, 250), 0.5, seed=1, counter=0)
    assert abs((a == c).float().mean().item() - 0.5) < 0.01


def test_a_block_is_the_slice_of_the_whole():
    whole = stream.dropout_mask((5, 6, 7), 0.3, seed=4, counter=2)
    block = stream.dropout_mask((5, 6, 7), 0.3, seed=4, counter=2, offset=(1, 2, 3),
                                block=(3, 0, 4))
    assert torch.equal(block, whole[1:4, 2:2, 3:7])
    block = stream.dropout_mask((5, 6, 7), 0.3, seed=4, counter=2, offset=(4, 1, 0),
                                block=(1, 5, 7))
    assert torch.equal(block, whole[4:, 1:, :])


# on the cluster -------------------------------------------------------------------------------
def _layouts():
    m4 = init_device_mesh("cpu", 4)
    m22 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return [(m4, [Shard(0)]), (m4, [Shard(1)]), (m4, [R]), (m22, [Shard(0), Shard(1)]),
            (m22, [Shard(1), Shard(0)]), (m22, [Shard(0), Shard(0)]), (m22, [R, Shard(1)])]


def _drawn() -> dict:
    dtorch.synchronize()
    return {s["rank"]: s["random_values"] for s in dtorch.rank_stats()}


def test_same_mask_on_every_mesh_and_placement(live):
    x = torch.randn(SHAPE)
    ref = stream.dropout(x, 0.4, seed=11, counter=0)
    assert 0 < (ref == 0).sum() < ref.numel()
    for mesh, placements in _layouts():
        dtorch.manual_seed(11)
        d = dtorch.tensor(x, device_mesh=mesh, placements=placements)
        out, counts = counted(lambda: F.dropout(d, 0.4))
        assert counts == {}, placements
        assert out.placements == tuple(placements)
        assert torch.equal(out.to_torch(), ref), placements
    torch.testing.assert_close(ref, x * (ref != 0) / 0.6)  # kept values scaled by 1 / (1 - p)


def test_each_rank_draws_only_its_own_block(live):
    for mesh, placements in _layouts():
        d = dtorch.tensor(torch.randn(SHAPE), device_mesh=mesh, placements=placements)
        before = _drawn()
        F.dropout(d, 0.5)
        after = _drawn()
        local = {r: torch.Size(s).numel() for r, s in d.local_shapes().items()}
        assert {r: after[r] - before[r] for r in local} == local, placements


def test_module_and_torch_spellings_follow_the_stream(live):
    mesh = init_device_mesh("cpu", 4)
    x = torch.randn(8, 6)
    d = dtorch.tensor(x, device_mesh=mesh, placements=[Shard(0)])
    dtorch.manual_seed(5)
    outs = [dtorch.nn.Dropout(0.3)(d), torch.nn.Dropout(0.3)(d), torch.dropout(d, 0.3, True),
            dtorch.nn.functional.dropout(d, 0.3)]
    for i, out in enumerate(outs):
        assert torch.equal(out.to_torch(), stream.dropout(x, 0.3, seed=5, counter=i)), i
    drop = dtorch.nn.Dropout(0.3).eval()
    assert drop(d) is d


def test_counter_advances_and_reseeding_replays(live):
    mesh = init_device_mesh("cpu", 4)
    d = dtorch.tensor(torch.ones(64, 8), device_mesh=mesh, placements=[Shard(0)])
    dtorch.manual_seed(2)
    assert stream.state() == (2, 0)
    a, b = F.dropout(d, 0.5).to_torch(), F.dropout(d, 0.5).to_torch()
    assert stream.state() == (2, 2)
    assert not torch.equal(a, b)
    dtorch.manual_seed(2)
    assert torch.equal(F.dropout(d, 0.5).to_torch(), a)
    dtorch.manual_seed(3)
    assert not torch.equal(F.dropout(d, 0.5).to_torch(), a)


def test_eval_and_p_zero_are_the_identity_and_p_one_zeros(live):
    mesh = init_device_mesh("cpu", 4)
    x = torch.randn(SHAPE)
    d = dtorch.tensor(x, device_mesh=mesh, placements=[Shard(1)])
    dtorch.manual_seed(0)
    for out in (F.dropout(d, 0.5, training=False), F.dropout(d, 0.0),
                dtorch.nn.Dropout(0.0)(d)):
        assert torch.equal(out.to_torch(), x)
    assert stream.state() == (0, 0)  # no mask drawn
    assert torch.equal(F.dropout(d, 1.0).to_torch(), torch.zeros(SHAPE))
    assert torch.equal(F.dropout(d, 1.0).to_torch(), F.dropout(x, 1.0))


def test_partial_stays_partial(live):
    """Dropout is linear: ``sum(noise * share) == noise * sum(share)``, the noise being the
    same on every rank for an element (Replicate on the Partial dim)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    shares = [torch.randn(6, 5) for _ in mesh.ranks]
    for placement in (Partial("sum"), Partial("avg")):
        locals_ = dict(zip(mesh.ranks, (s[:, :3] if mesh.get_coordinate(r)[1] == 0 else
                                        s[:, 3:] for r, s in zip(mesh.ranks, shares))))
        d = dtorch.from_local(locals_, mesh, [placement, Shard(1)], shape=(6, 5))
        dtorch.manual_seed(9)
        out, counts = counted(lambda: F.dropout(d, 0.5))
        assert counts == {}
        assert out.placements == (placement, Shard(1))
        torch.testing.assert_close(out.to_torch(),
                                   stream.dropout(d.to_torch(), 0.5, seed=9, counter=0))
        d.requires_grad_()  # the gradient of a Partial input: noise * grad (Replicate)
        dtorch.manual_seed(9)
        g = torch.randn(6, 5)
        F.dropout(d, 0.5).backward(dtorch.tensor(g, device_mesh=mesh, placements=[R, R]))
        noise = stream.dropout(torch.ones(6, 5), 0.5, seed=9, counter=0)
        torch.testing.assert_close(d.grad.to_torch(), g * noise)


def test_gradients_match_torch(live):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x, g = torch.randn(SHAPE), torch.randn(SHAPE)
    for placements in ([Shard(0), Shard(1)], [R, R], [Shard(1), R]):
        dtorch.manual_seed(4)
        d = dtorch.tensor(x, device_mesh=mesh, placements=placements, requires_grad=True)
        out = F.dropout(d.tanh(), 0.3)
        _, counts = counted(lambda: out.backward(dtorch.tensor(
            g, device_mesh=mesh, placements=placements)) or d.grad)
        assert counts == {}
        xt = x.clone().requires_grad_()
        stream.dropout(xt.tanh(), 0.3, seed=4, counter=0).backward(g)
        torch.testing.assert_close(out.to_torch(), stream.dropout(x.tanh(), 0.3, seed=4,
                                                                  counter=0))
        torch.testing.assert_close(d.grad.to_torch(), xt.grad)


def test_feature_dropout_masks_whole_channels(live):
    mesh = init_device_mesh("cpu", 4)
    x = torch.randn(3, 8, 5, 2)
    for placements in ([Shard(1)], [Shard(2)], [R]):
        d = dtorch.tensor(x, device_mesh=mesh, placements=placements)
        dtorch.manual_seed(1)
        out, counts = counted(lambda: F.dropout2d(d, 0.5))
        assert counts == {}
        ref = stream.dropout(x, 0.5, seed=1, counter=0, kind="dropout2d")
        assert torch.equal(out.to_torch(), ref), placements
        kept = (ref != 0).flatten(2).any(-1)
        assert torch.equal((ref != 0).flatten(2).all(-1), kept)  # whole channels
    d = dtorch.tensor(torch.randn(8, 5), device_mesh=mesh, placements=[Shard(0)])
    dtorch.manual_seed(1)
    ref = stream.dropout(d.to_torch(), 0.5, seed=1, counter=0, kind="dropout1d")
    assert torch.equal(F.dropout1d(d, 0.5).to_torch(), ref)  # unbatched (C, L)


def test_alpha_dropouts_match_reference(live):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.randn(4, 6, 3)
    for placements in ([Shard(0), Shard(1)], [R, Shard(2)], [Partial("avg"), R]):
        d = dtorch.tensor(x, device_mesh=mesh, placements=placements)
        for i, (call, kind) in enumerate([(F.alpha_dropout, "alpha_dropout"),
                                          (F.feature_alpha_dropout, "feature_alpha_dropout")]):
            dtorch.manual_seed(3)
            out, counts = counted(lambda: call(d, 0.2, training=True))
            assert counts == {} and out.placements == tuple(placements)
            torch.testing.assert_close(out.to_torch(), stream.dropout(x, 0.2, seed=3,
                                                                      counter=0, kind=kind))
    d = dtorch.tensor(x, device_mesh=mesh, placements=[Shard(0), Shard(1)])
    assert torch.equal(F.alpha_dropout(d, 0.2).to_torch(), x)  # F's default: training=False
    assert torch.equal(F.alpha_dropout(d, 1.0, training=True).to_torch(), x * 0)


def test_in_place_spellings(live):
    mesh = init_device_mesh("cpu", 4)
    x = torch.randn(SHAPE)
    for i, call in enumerate([lambda t: F.dropout(t, 0.5, inplace=True),
                              lambda t: torch.dropout_(t, 0.5, True),
                              lambda t: torch.feature_alpha_dropout_(t, 0.5, True)]):
        d = dtorch.tensor(x, device_mesh=mesh, placements=[Shard(0)])
        dtorch.manual_seed(0)
        assert call(d) is d
        kind = "feature_alpha_dropout" if i == 2 else "dropout"
        torch.testing.assert_close(d.to_torch(), stream.dropout(x, 0.5, seed=0, counter=0,
                                                                kind=kind))
    d = dtorch.tensor(x, device_mesh=mesh, placements=[Shard(1)], requires_grad=True)
    dtorch.manual_seed(1)
    y = d * 2
    F.dropout(y, 0.5, inplace=True).sum().backward()  # in place on a non-leaf: recorded
    torch.testing.assert_close(d.grad.to_torch(),
                               2 * stream.dropout(torch.ones(SHAPE), 0.5, seed=1, counter=0))


def _attention_inputs(gqa=False):
    """(N, H, L, E) query, (N, H, S, E) key and value; 3 heads (uneven on 2 and 4 ranks),
    or 4 query heads over 2 kv heads."""
    torch.manual_seed(0)
    h, hk = (4, 2) if gqa else (3, 3)
    return torch.randn(2, h, 6, 8), torch.randn(2, hk, 5, 8), torch.randn(2, hk, 5, 8)


@pytest.mark.parametrize("case", ["plain", "causal", "gqa", "mask"])
def test_attention_dropout_matches_reference(live, case):
    q, k, v = _attention_inputs(gqa=case == "gqa")
    kwargs = {"is_causal": case == "causal", "enable_gqa": case == "gqa"}
    attn_mask = torch.rand(2, 1, 6, 5) > 0.2 if case == "mask" else None
    ref = stream.scaled_dot_product_attention(q, k, v, attn_mask, 0.3, seed=6, counter=0,
                                              **kwargs)
    m4 = init_device_mesh("cpu", 4)
    m22 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layouts = [(m4, [R]), (m22, [Shard(0), Shard(1)]), (m22, [Shard(1), Shard(0)])]
    if case != "gqa":
        layouts.append((m4, [Shard(1)]))
    for mesh, placements in layouts:
        dq, dk, dv = (dtorch.tensor(t, device_mesh=mesh, placements=placements)
                      for t in (q, k, v))
        dm = None if attn_mask is None else dtorch.tensor(attn_mask, device_mesh=mesh)
        dtorch.manual_seed(6)
        out, counts = counted(lambda: F.scaled_dot_product_attention(dq, dk, dv, dm, 0.3,
                                                                     **kwargs))
        assert counts == {}
        assert out.placements == tuple(placements)
        torch.testing.assert_close(out.to_torch(), ref)
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask, **kwargs)
    assert not torch.allclose(ref, plain)  # the mask did something


def test_attention_dropout_with_a_partial_value(live):
    """Attention is linear in the value: a Partial value gives a Partial output, the mask
    (over the weights, which are Replicate) the same on every rank."""
    q, k, v = _attention_inputs()
    mesh = init_device_mesh("cpu", 4)
    shares = [torch.randn(v.shape) for _ in mesh.ranks]
    dv = dtorch.from_local(shares, mesh, [Partial()])
    dq, dk = (dtorch.tensor(t, device_mesh=mesh) for t in (q, k))
    dtorch.manual_seed(2)
    out, counts = counted(lambda: F.scaled_dot_product_attention(dq, dk, dv, dropout_p=0.5))
    assert counts == {} and out.placements == (Partial(),)
    ref = stream.scaled_dot_product_attention(q, k, sum(shares), dropout_p=0.5, seed=2,
                                              counter=0)
    torch.testing.assert_close(out.to_torch(), ref)


def test_attention_dropout_gradients(live):
    q, k, v = _attention_inputs()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dq, dk, dv = (dtorch.tensor(t, device_mesh=mesh, placements=[Shard(0), Shard(1)],
                                requires_grad=True) for t in (q, k, v))
    dtorch.manual_seed(8)
    before = _drawn()
    out = F.scaled_dot_product_attention(dq, dk, dv, dropout_p=0.25, is_causal=True)
    after = _drawn()  # each rank's block of the weights (2, 3, 6, 5): (1, 2 or 1, 6, 5)
    assert {r: after[r] - before[r] for r in mesh.ranks} == {0: 60, 1: 30, 2: 60, 3: 30}
    _, counts = counted(lambda: out.sum().backward() or dq.grad)
    assert counts == {}
    tq, tk, tv = (t.clone().requires_grad_() for t in (q, k, v))
    stream.scaled_dot_product_attention(tq, tk, tv, dropout_p=0.25, is_causal=True, seed=8,
                                        counter=0).sum().backward()
    for d, t in ((dq, tq), (dk, tk), (dv, tv)):
        torch.testing.assert_close(d.grad.to_torch(), t.grad)


def test_bad_inputs_raise_before_anything_is_sent(live):
    c = live
    mesh = init_device_mesh("cpu", 4)
    d = dtorch.tensor(torch.randn(SHAPE), device_mesh=mesh, placements=[Shard(0)])
    ints = dtorch.tensor(torch.arange(8), device_mesh=mesh, placements=[Shard(0)])
    mx = dtorch.tensor(torch.randn(SHAPE), device_mesh=mesh, placements=[Partial("max")])
    psum = dtorch.tensor(torch.randn(SHAPE), device_mesh=mesh, placements=[Partial()])
    q = dtorch.tensor(torch.randn(2, 4, 8, 8), device_mesh=mesh, placements=[Shard(2)])
    four_d = dtorch.tensor(torch.randn(2, 3, 4, 5), device_mesh=mesh)
    ring = init_device_mesh("cpu", 4, mesh_dim_names=("ring_cp",))
    rq = dtorch.tensor(torch.randn(1, 2, 8, 4), device_mesh=ring, placements=[Shard(2)])
    dtorch.synchronize()
    state = stream.state()
    cases = [
        (lambda: F.dropout(d, 1.5), ValueError, "between 0 and 1"),
        (lambda: F.dropout(d, -0.1), ValueError, "between 0 and 1"),
        (lambda: F.dropout(ints, 0.5), RuntimeError, "can't be cast"),
        (lambda: F.dropout1d(four_d, 0.5), RuntimeError, "Expected 2D or 3D input"),
        (lambda: F.dropout(mx, 0.5), dtorch.PlacementError, "redistribute"),
        (lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=2.0), ValueError,
         "between 0 and 1"),
        (lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5),
         dtorch.PlacementError, "sequence"),
        (lambda: F.scaled_dot_product_attention(rq, rq, rq, dropout_p=0.5),
         dtorch.UnsupportedOpError, "context parallelism"),
        (lambda: F.alpha_dropout(psum, 0.5, training=True), dtorch.PlacementError,
         "commutes with a pending avg"),
    ]
    for call, error, text in cases:
        before = c.issued
        with pytest.raises(error, match=text):
            call()
        assert c.issued == before  # refused on the controller
    assert stream.state() == state  # no counter spent on a refused call
    assert torch.equal(F.dropout(d, 0.5, training=False).to_torch(), d.to_torch())  # usable
