"""Context-parallel scaled_dot_product_attention (Ulysses, ring, both) against torch on one
device, with exact collective counts on both ledgers (the controller's CommDebugMode and the
workers' own counts), the ring's memory bound, and failures that poison without hanging."""

import math

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import DeviceMesh, PlacementError, Replicate, Shard, init_device_mesh
from dtorch.ops import cp_attention
from dtorch.ops.composite import exchange_step, shift_step
from dtorch.runtime import messages as msg
from ledgers import counted
from test_ops_support import Batch, dt

R = Replicate()
S2 = Shard(2)


def qkv(n=2, hq=4, hk=None, lq=8, lk=8, e=8, ev=6, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hk = hk or hq
    return (torch.randn(n, hq, lq, e, generator=g, dtype=dtype),
            torch.randn(n, hk, lk, e, generator=g, dtype=dtype),
            torch.randn(n, hk, lk, ev, generator=g, dtype=dtype))


def attention(mesh, placements, q, k, v, **kw):
    dq, dk, dv = (dt(t, mesh, placements) for t in (q, k, v))
    return counted(lambda: F.scaled_dot_product_attention(dq, dk, dv, **kw))


def mesh_of(*names_sizes):
    names = [n for n, _ in names_sizes]
    return init_device_mesh("cpu", tuple(s for _, s in names_sizes), mesh_dim_names=names)


def with_balancing(counts: dict, causal: bool, q, k, ring_first: bool = True) -> dict:
    """A causal ring over one contiguous block per rank is zig-zag balanced: Q, K and V go
    into the zig-zag layout and the output comes back, 4 more all_to_alls."""
    if causal and ring_first and "send_recv" in counts and q.shape[2] == k.shape[2]:
        return {**counts, "all_to_all": counts.get("all_to_all", 0) + 4}
    return counts


SHAPES = {"even": {}, "uneven": {"lq": 7, "lk": 7}, "L!=S": {"lq": 5, "lk": 11},
          "gqa": {"hq": 8, "hk": 2}, "gqa-uneven": {"hq": 4, "hk": 2, "lq": 9, "lk": 6},
          "short": {"lq": 3, "lk": 2}}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind, counts", [("ring_cp", {"send_recv": 3}),
                                          ("ulysses_cp", {"all_to_all": 4}),
                                          ("ulysess_cp", {"all_to_all": 4})])
def test_cp_matches_torch_with_exact_counts(live, kind, counts, causal, shape):
    q, k, v = qkv(**SHAPES[shape])
    gqa = q.shape[1] != k.shape[1]
    out, got = attention(mesh_of((kind, 4)), [S2], q, k, v, is_causal=causal, enable_gqa=gqa)
    # ring: cp - 1 shifts and no all_gather; Ulysses: 3 in, 1 out
    assert got == with_balancing(counts, causal, q, k)
    batch = Batch()
    batch.add(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
              [S2], atol=1e-5)
    batch.check()


@pytest.mark.parametrize("names, placements, shape, counts", [
    (("ulysess_cp", "ring_cp"), [S2, S2], {"lq": 9, "lk": 13}, {"all_to_all": 4, "send_recv": 1}),
    (("ring_cp", "ulysses_cp"), [S2, S2], {"hq": 4, "hk": 2, "lq": 10},
     {"all_to_all": 4, "send_recv": 1}),
    (("dp", "ring_cp"), [Shard(0), S2], {"lq": 9, "lk": 5}, {"send_recv": 1}),
    (("dp", "ulysses_cp"), [Shard(0), S2], {"n": 3, "lq": 6}, {"all_to_all": 4}),
    (("tp", "ring_cp"), [Shard(1), S2], {"hq": 8, "hk": 4, "lq": 7}, {"send_recv": 1}),
    (("tp", "ulysses_cp"), [Shard(1), S2], {"hq": 8, "hk": 2, "lq": 7, "lk": 9},
     {"all_to_all": 4}),
    (("tp", "ulysses_cp"), [R, S2], {"hq": 5, "lq": 7}, {"all_to_all": 4}),
], ids=["ulysses+ring", "ring+ulysses-gqa", "dp+ring", "dp+ulysses", "tp+ring-gqa",
        "tp+ulysses-gqa-expanded", "R+ulysses-uneven-heads"])
@pytest.mark.parametrize("causal", [False, True])
def test_cp_combined_with_dp_tp_and_each_other(live, names, placements, shape, counts, causal):
    q, k, v = qkv(**shape)
    gqa = q.shape[1] != k.shape[1]
    mesh = mesh_of((names[0], 2), (names[1], 2))
    out, got = attention(mesh, placements, q, k, v, is_causal=causal, enable_gqa=gqa)
    ulysses = any(n in ("ulysses_cp", "ulysess_cp") for n in names)
    assert got == with_balancing(counts, causal, q, k, ring_first=not ulysses)
    batch = Batch()
    batch.add(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
              placements, atol=1e-5)
    batch.check()


@pytest.mark.parametrize("kind", ["ring_cp", "ulysses_cp"])
def test_cp_masks_scale_float64_and_nn_functional(live, kind):
    q, k, v = qkv(lq=6, lk=9)
    g = torch.Generator().manual_seed(1)
    bool_mask = torch.rand(2, 1, 6, 9, generator=g) > 0.4
    bool_mask[0, 0, 2] = False  # a fully masked row: 0, as torch gives
    float_mask = torch.randn(6, 9, generator=g)
    mesh = mesh_of((kind, 4))
    dq, dk, dv = (dt(t, mesh, [S2]) for t in (q, k, v))
    batch = Batch()
    for mask in (bool_mask, float_mask):
        dm = dt(mask, mesh, [R])
        out, _ = counted(lambda: F.scaled_dot_product_attention(dq, dk, dv, attn_mask=dm,
                                                                scale=0.3))
        batch.add(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3),
                  [S2], atol=1e-5)
    d64 = [dt(t.double(), mesh, [S2]) for t in (q, k, v)]
    batch.add(dtorch.nn.functional.scaled_dot_product_attention(*d64, is_causal=True),
              F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                             is_causal=True), [S2], atol=1e-10)
    batch.check()


def test_ring_rank_holds_its_block_and_the_one_in_flight_only(live):
    """Each rank reports the peak bytes of the K/V blocks it held during the composite: its
    current block plus the one arriving, never the whole K/V (4 blocks here)."""
    q, k, v = qkv(n=1, hq=2, lq=64, lk=64, e=16, ev=16)
    mesh = mesh_of(("ring_cp", 4))
    out, counts = attention(mesh, [S2], q, k, v, is_causal=True)
    assert counts == {"send_recv": 3, "all_to_all": 4}  # zig-zag in (Q, K, V) and out
    block = (k.numel() + v.numel()) * 4 // 4  # one rank's K and V blocks, in bytes
    peaks = [s["composite_peak_bytes"] for s in dtorch.rank_stats()]
    assert peaks == [2 * block] * 4, (peaks, block)
    whole = (k.numel() + v.numel()) * 4
    assert max(peaks) <= whole // 2
    assert torch.allclose(out.to_torch(), F.scaled_dot_product_attention(q, k, v,
                                                                         is_causal=True),
                          atol=1e-5)


def poisoned_key(mesh, n=2, h=4, s=8, e=8, bad_at=7):
    """A key whose block on the last rank comes from a failed op (index 99 out of range there)."""
    idx = torch.randint(0, 10, (n, h, s), generator=torch.Generator().manual_seed(2))
    idx[0, 0, bad_at] = 99
    table = dt(torch.randn(10, e), mesh, [R] * mesh.ndim)
    return F.embedding(dt(idx, mesh, [S2] * mesh.ndim), table)


@pytest.mark.parametrize("names", [("ring_cp",), ("ulysses_cp",), ("ulysess_cp", "ring_cp")])
def test_a_poisoned_key_on_one_rank_poisons_every_rank_and_the_cluster_goes_on(live, names):
    mesh = mesh_of(*[(n, 4 // len(names)) for n in names])
    q, _, v = qkv()
    dq, dv = dt(q, mesh, [S2] * mesh.ndim), dt(v, mesh, [S2] * mesh.ndim)
    out = F.scaled_dot_product_attention(dq, poisoned_key(mesh), dv, is_causal=True)
    for r in mesh.ranks:  # every rank's output is poisoned, none hangs
        with pytest.raises(dtorch.RemoteError, match="index|out of range|failed op"):
            out.to_local(r)
    with pytest.raises(dtorch.RemoteError, match="rank 3"):
        dtorch.synchronize()
    q, k, v = qkv(seed=3)
    good, _ = attention(mesh, [S2] * mesh.ndim, q, k, v, is_causal=True)
    assert torch.allclose(good.to_torch(), F.scaled_dot_product_attention(q, k, v,
                                                                          is_causal=True),
                          atol=1e-5)


def test_cp_refusals_name_the_fix(live):
    ring = mesh_of(("ring_cp", 4))
    q, k, v = qkv()
    dq, dk, dv = (dt(t, ring, [S2]) for t in (q, k, v))
    with pytest.raises(dtorch.ops.UnsupportedOpError, match="dropout_p.*context parallel"):
        F.scaled_dot_product_attention(dq, dk, dv, dropout_p=0.1)
    kr = dt(k, ring, [R])
    with pytest.raises(PlacementError, match=r"key.redistribute\(placements=\[Shard\(2\)\]\)"):
        F.scaled_dot_product_attention(dq, kr, dv)
    sharded_mask = dt(torch.ones(8, 8, dtype=torch.bool), ring, [Shard(0)])
    with pytest.raises(PlacementError, match="attn_mask must be Replicate"):
        F.scaled_dot_product_attention(dq, dk, dv, attn_mask=sharded_mask)
    tp_ring = mesh_of(("tp", 2), ("ring_cp", 2))
    q8, k2, v2 = qkv(hq=6, hk=3)  # tp rank 0: query heads 0-2 over kv heads 0-1: split
    a, b, c = (dt(t, tp_ring, [Shard(1), S2]) for t in (q8, k2, v2))
    with pytest.raises(PlacementError, match="kv heads"):
        F.scaled_dot_product_attention(a, b, c, enable_gqa=True)
    flat = dt(torch.randn(4, 8, 8), ring, [Shard(1)])
    with pytest.raises(PlacementError, match="4-D"):
        F.scaled_dot_product_attention(flat, flat, flat)
    unnamed = dt(q, init_device_mesh("cpu", 4), [S2])
    with pytest.raises(PlacementError, match="ring_cp"):
        F.scaled_dot_product_attention(unnamed, unnamed, unnamed)


# pure: the planner and the kernels (no cluster) ------------------------------------------------
def test_exchange_and_shift_tables_are_planned_from_the_layout():
    mesh = DeviceMesh("cpu", [0, 1, 2], mesh_dim_names=["ring_cp"])
    shapes = {0: (5, 3), 1: (5, 3), 2: (5, 2)}
    s = exchange_step(mesh, 0, 0, 1, shapes, 0, 1)
    assert s.kind == "all_to_all" and s.groups == ((0, 1, 2),)
    assert dict(s.table)[2] == ((5, 2), (2, 2, 1), ((1, 3), (1, 3), (1, 2)), (2, 3))
    assert s.bytes_per_rank == 3 * 2 * 3 * 4
    sh = shift_step(mesh, 0, (0,), (1,), [shapes])
    assert dict(sh.table)[0] == (1, 2, ((5, 3),), ((5, 2),))  # to 1, from 2 (the ring)
    assert sh.kind == "send_recv" and sh.bytes_per_rank == 15 * 4


def test_ring_plan_posts_each_shift_before_the_compute_and_drops_old_blocks():
    from dtorch.spec import TensorSpec
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("ring_cp",))
    spec = lambda shape: TensorSpec(shape, torch.float32, mesh, (S2,))  # noqa: E731
    plan = cp_attention.plan_cp_attention(spec((1, 2, 8, 4)), spec((1, 2, 8, 4)), spec((1, 2, 8, 4)),
                              False, False, None, None, 0)
    kinds = [type(s).__name__ for s in plan.steps]
    assert kinds.count("Shift") == 3 and kinds.count("Wait") == 3
    assert [s.kind for s in plan.collectives] == ["send_recv"] * 3
    for i, step in enumerate(plan.steps):  # shift, compute on the block in hand, wait, drop
        if type(step) is msg.Shift:
            assert kinds[i + 1:i + 4] == ["Local", "Wait", "Drop"]
            assert plan.steps[i + 3].slots == step.srcs
    assert set(plan.watch) == {s for st in plan.steps if type(st) is msg.Shift
                               for s in st.srcs + st.outs}


def test_ring_step_skips_a_block_entirely_in_the_future_of_the_queries():
    q, k, v = qkv(n=1, hq=2, lq=4, lk=4)
    acc, mx, den = cp_attention.ring_init(q, v)
    later = cp_attention.ring_step(q, k, v, acc, mx, den, ((0, 4),), ((4, 4),), None,
                                   None, True, None)
    assert later[0] is acc and later[1] is mx and later[2] is den
    merged = cp_attention.ring_step(q, k, v, acc, mx, den, ((0, 4),), ((0, 4),), None, None,
                                    True, None)
    out = cp_attention.ring_finish(*merged, torch.float32)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True),
                          atol=1e-6)
    assert math.isinf(mx.max().item())


def _live_pairs(plan) -> dict:
    """Per rank: the (query piece, key piece) pairs its ring steps compute under causal
    (a key piece all in a query piece's future is skipped)."""
    work = {}
    for step in plan.steps:
        if type(step) is not msg.Local or step.fn is not cp_attention.ring_step:
            continue
        qpos, kpos = dict(step.args[6].table), dict(step.args[7].table)
        for r in qpos:
            work[r] = work.get(r, 0) + sum(ks <= qs + qn - 1 for qs, qn in qpos[r] if qn
                                           for ks, kn in kpos[r] if kn)
    return work


def test_causal_ring_work_is_balanced_by_the_zig_zag_layout():
    """Contiguous blocks would give rank i of the ring i + 1 blocks (1, 2, 3, 4); in the
    zig-zag layout (rank i holds chunks i and 2n-1-i of 2n) every rank computes the same."""
    from dtorch.spec import TensorSpec
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("ring_cp",))
    spec = lambda shape: TensorSpec(shape, torch.float32, mesh, (S2,))  # noqa: E731
    plan = cp_attention.plan_cp_attention(spec((1, 2, 64, 4)), spec((1, 2, 64, 4)),
                                          spec((1, 2, 64, 4)), False, True, None, None, 0)
    assert [s.kind for s in plan.collectives] == ["all_to_all"] * 3 + ["send_recv"] * 3 + [
        "all_to_all"]
    work = _live_pairs(plan)
    assert len(set(work.values())) == 1, work  # 10 piece pairs on every rank
    assert cp_attention._zigzag_chunks(64, 4)[::7] == [(0, 8, 0), (56, 8, 0)]
