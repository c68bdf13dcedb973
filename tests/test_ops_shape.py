"""Shape ops: the shard dim is tracked through views and reshapes; uneven splits raise."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.layout import chunk_sizes
from test_ops_support import PARTIALS, Batch, dt, illegal, make, no_comm, placements_1d

R = Replicate()
SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


def _check(mesh, x, fn, placement_list, oracle):
    expected = fn(x)
    batch = Batch()
    for pl in placement_list:
        d = make(x, mesh, pl, 1)
        want = oracle(pl)
        if want is None:
            illegal(lambda: fn(d))
        elif want == "any":  # a sharded dim of size 1: either is right
            try:
                batch.add(no_comm(lambda: fn(d)), expected)
            except dtorch.PlacementError:
                pass
        else:
            batch.add(no_comm(lambda: fn(d)), expected, want)
    batch.check()


def moved(dim_map):
    """Oracle for views: Shard(d) -> Shard(dim_map[d]) (missing: illegal), others kept."""
    def oracle(pl):
        out = []
        for p in pl:
            if isinstance(p, Shard):
                if dim_map.get(p.dim) is None:
                    return None
                out.append(Shard(dim_map[p.dim]))
            else:
                out.append(p)
        return tuple(out)
    return oracle


@st.composite
def view_case(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    n = len(shape)
    kind = draw(st.sampled_from(["transpose", "permute", "movedim", "unsqueeze", "squeeze",
                                 "squeeze_dim", "expand", "T", "contiguous", "t"]))
    if kind == "t" and n > 2:
        kind = "T"
    if kind == "transpose":
        a, b = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        m = {d: d for d in range(n)}
        m[a], m[b] = b, a
        return shape, (lambda x: x.transpose(a, b)), m
    if kind == "permute":
        perm = draw(st.permutations(range(n)))
        return shape, (lambda x: x.permute(*perm)), {d: perm.index(d) for d in range(n)}
    if kind == "movedim":
        s, t = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        order = [d for d in range(n) if d != s]
        order.insert(t, s)
        return shape, (lambda x: torch.movedim(x, s, t)), {d: order.index(d) for d in range(n)}
    if kind == "unsqueeze":
        k = draw(st.integers(0, n))
        return shape, (lambda x: x.unsqueeze(k)), {d: d + (d >= k) for d in range(n)}
    if kind in ("squeeze", "squeeze_dim"):
        k = draw(st.integers(0, n - 1))
        gone = [d for d in range(n) if shape[d] == 1 and (kind == "squeeze" or d == k)]
        fn = (lambda x: x.squeeze()) if kind == "squeeze" else (lambda x: torch.squeeze(x, k))
        return shape, fn, {d: d - sum(g < d for g in gone) for d in range(n) if d not in gone}
    if kind == "expand":
        lead = draw(st.integers(0, 1))
        target = (3,) * lead + tuple(s if s > 1 else draw(st.sampled_from([1, 4])) for s in shape)
        return shape, (lambda x: x.expand(*target)), {
            d: d + lead for d in range(n) if shape[d] == target[d + lead]}
    if kind in ("T", "t"):
        fn = (lambda x: x.T) if kind == "T" else (lambda x: x.t())
        return shape, fn, {d: n - 1 - d for d in range(n)}
    return shape, (lambda x: x.contiguous()), {d: d for d in range(n)}


@SETTINGS
@given(case=view_case())
def test_views_track_the_shard_dim(mesh1d, mesh2d, case):
    shape, fn, dim_map = case
    x = torch.randn(shape, dtype=torch.float64)
    oracle = moved(dim_map)
    _check(mesh1d, x, fn, placements_1d(len(shape)), oracle)
    pls = [(Shard(d), Shard(e)) for d in range(len(shape)) for e in range(len(shape))][:6]
    _check(mesh2d, x, fn, pls + [(PARTIALS[0], Shard(0)), (R, Shard(len(shape) - 1))], oracle)


@st.composite
def reshape_case(draw):
    shape = list(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    n = len(shape)
    if n > 1 and draw(st.booleans()):  # merge dims i, i+1
        i = draw(st.integers(0, n - 2))
        out = shape[:i] + [shape[i] * shape[i + 1]] + shape[i + 2:]
        return tuple(shape), tuple(out), ("merge", i)
    i = draw(st.integers(0, n - 1))
    f = draw(st.sampled_from([f for f in range(1, shape[i] + 1) if shape[i] % f == 0]))
    out = shape[:i] + [f, shape[i] // f] + shape[i + 1:]
    return tuple(shape), tuple(out), ("split", i, f)


def reshape_oracle(shape, out, how, n=4):
    """Legal iff the sharded dim leads its merged/split group and chunk layouts agree."""
    def oracle(pl):
        (p,) = pl
        if not isinstance(p, Shard):
            return pl
        d = p.dim
        if shape[d] == 1:
            return "any"
        if how[0] == "merge":
            i = how[1]
            if d < i:
                return (Shard(d),)
            if d > i + 1:
                return (Shard(d - 1),)
            lead = i if shape[i] > 1 else i + 1
            if d != lead or shape[d] == 1:
                return None
            inner = shape[i + 1] if d == i else 1
            ok = [c * inner for c in chunk_sizes(shape[d], n)] == list(
                chunk_sizes(out[i], n))
            return (Shard(i),) if ok else None
        i, f = how[1], how[2]
        if d != i:
            return (Shard(d if d < i else d + 1),)
        if shape[d] == 1:
            return None
        if f == 1:
            return (Shard(i + 1),)
        ok = [c * (shape[i] // f) for c in chunk_sizes(f, n)] == list(chunk_sizes(shape[i], n))
        return (Shard(i),) if ok else None
    return oracle


@SETTINGS
@given(case=reshape_case(), method=st.sampled_from(["reshape", "view", "flatten_unflatten"]))
def test_reshapes_keep_shards_or_raise(mesh1d, case, method):
    shape, out, how = case
    x = torch.randn(shape, dtype=torch.float64)
    if method == "flatten_unflatten":
        if how[0] == "merge":
            fn = lambda t: t.flatten(how[1], how[1] + 1)  # noqa: E731
        else:
            fn = lambda t: t.unflatten(how[1], (how[2], shape[how[1]] // how[2]))  # noqa: E731
    else:
        fn = lambda t: getattr(t, method)(out)  # noqa: E731
    _check(mesh1d, x, fn, placements_1d(len(shape)), reshape_oracle(shape, out, how))


def test_reshape_examples_and_messages(mesh1d, mesh2d):
    batch = Batch()
    x = torch.randn(8, 10)
    batch.add(no_comm(lambda: dt(x, mesh1d, [Shard(0)]).flatten()), x.flatten(), [Shard(0)])
    y = torch.randn(6, 8)
    batch.add(no_comm(lambda: dt(y, mesh1d, [Shard(1)]).view(6, 4, 2)), y.view(6, 4, 2),
              [Shard(1)])
    z = torch.randn(2, 3, 8, 4)  # [b, s, h*d] -> [b, s, h, d] with heads sharded on tp
    batch.add(no_comm(lambda: dt(z.flatten(2), mesh2d, [Shard(0), Shard(2)]).view(2, 3, 8, 4)),
              z, [Shard(0), Shard(2)])
    batch.add(no_comm(lambda: dt(z, mesh2d, [Shard(0), Shard(2)]).reshape(2, 3, 32)),
              z.reshape(2, 3, 32), [Shard(0), Shard(2)])
    batch.add(no_comm(lambda: dt(x, mesh1d, [Partial()]).view(80)), x.view(80), [Partial()])
    batch.check()
    u = dt(torch.randn(6, 10), mesh1d, [Shard(0)])
    err = illegal(lambda: u.flatten(), match="unevenly")
    assert "rank 0 holds elements [0, 20)" in str(err)
    v = dt(torch.randn(4, 6), mesh1d, [Shard(1)])
    illegal(lambda: v.reshape(24), match="mixes sharded dim 1")


def test_sharded_dim_cannot_be_cut(mesh1d):
    x = dt(torch.randn(8, 6), mesh1d, [Shard(0)])
    illegal(lambda: x.narrow(0, 1, 3))
    illegal(lambda: x.select(0, 2))
    illegal(lambda: x.split(4, 0))
    illegal(lambda: x.unbind(0))
    illegal(lambda: torch.chunk(x, 2, 0))
    s = dt(torch.randn(8, 1), mesh1d, [Shard(1)])
    illegal(lambda: s.expand(8, 5))


def test_position_ops_on_unsharded_dims(mesh1d, mesh2d):
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    batch = Batch()
    s0 = dt(x, mesh1d, [Shard(0)])
    batch.add(no_comm(lambda: torch.tril(s0)), torch.tril(x), [Shard(0)])
    batch.add(no_comm(lambda: s0.triu(1)), x.triu(1), [Shard(0)])
    batch.add(no_comm(lambda: s0.flip(2)), x.flip(2), [Shard(0)])
    batch.add(no_comm(lambda: torch.roll(s0, 2, 1)), torch.roll(x, 2, 1), [Shard(0)])
    batch.add(no_comm(lambda: s0.repeat_interleave(2, dim=2)), x.repeat_interleave(2, dim=2),
              [Shard(0)])
    batch.add(no_comm(lambda: s0.repeat(2, 1, 1, 3)), x.repeat(2, 1, 1, 3), [Shard(1)])
    batch.add(no_comm(lambda: torch.nn.functional.pad(s0, (1, 2))),
              torch.nn.functional.pad(x, (1, 2)), [Shard(0)])
    xf = x.float().reshape(4, 5, 3, 2)  # complex64: fetching complex128 crashes (runtime)
    c = torch.view_as_complex(xf)
    batch.add(no_comm(lambda: torch.view_as_complex(dt(xf, mesh2d, [Shard(0), Shard(1)]))),
              c, [Shard(0), Shard(1)])
    batch.add(no_comm(lambda: torch.view_as_real(dt(c, mesh1d, [Shard(2)]))),
              torch.view_as_real(c), [Shard(2)])
    p = make(x, mesh1d, [Partial()], 1)
    batch.add(no_comm(lambda: p.tril()), x.tril(), [Partial()])
    batch.check()
    s2 = dt(x, mesh1d, [Shard(2)])
    illegal(lambda: s2.tril())
    illegal(lambda: s2.flip(-1))
    illegal(lambda: s0.repeat(2, 1, 1))
    illegal(lambda: torch.nn.functional.pad(s2, (1, 0)))
    illegal(lambda: torch.nn.functional.pad(p, (1, 0), value=1.0))


def test_index_and_size_values_given_as_tensors(mesh1d):
    """tensor_split indices and repeat_interleave repeats as a plain tensor or a DTensor are
    read as ints on the controller; new values are not replayed from a cached plan."""
    x = torch.arange(48.).reshape(8, 6)
    idx, reps = torch.tensor([1, 4]), torch.tensor([1, 0, 2, 1, 3, 1, 1, 2])
    batch = Batch()
    for a, pl in ((dt(x, mesh1d, [Shard(1)]), [Shard(1)]), (dt(x, mesh1d, [R]), [R])):
        batch.add(list(no_comm(lambda: torch.tensor_split(a, idx))),
                  list(torch.tensor_split(x, idx)), pl)
        for values in ([1, 4], [2, 3, 7], [5]):
            d = dt(torch.tensor(values), mesh1d, [Shard(0)])
            batch.add(list(a.tensor_split(d, dim=0)), list(x.tensor_split(values, dim=0)), pl)
        batch.add(list(torch.tensor_split(a, tensor_indices_or_sections=dt(torch.tensor(3),
                                                                          mesh1d, [R]))),
                  list(torch.tensor_split(x, 3)), pl)
        batch.add(no_comm(lambda: torch.repeat_interleave(a, reps, dim=0)),
                  torch.repeat_interleave(x, reps, dim=0), pl)
        batch.add(a.repeat_interleave(repeats=dt(reps, mesh1d, [Shard(0)]), dim=0),
                  x.repeat_interleave(reps, dim=0), pl)
    r = dt(x, mesh1d, [R])
    batch.add(no_comm(lambda: r.repeat_interleave(torch.tensor(2))), x.repeat_interleave(2),
              [R])
    flat = torch.arange(48) % 3
    batch.add(torch.repeat_interleave(r, dt(flat, mesh1d, [R])), x.repeat_interleave(flat),
              [R])
    batch.check()
    s0 = dt(x, mesh1d, [Shard(0)])
    illegal(lambda: torch.tensor_split(s0, idx), match="cuts along dim 0")
    illegal(lambda: s0.repeat_interleave(reps, dim=0), match="repeats along dim 0")
    with pytest.raises(TypeError, match="integer tensor"):
        torch.tensor_split(r, torch.tensor([1.0, 2.0]))


def test_positions_given_as_0_dim_tensors_and_padding_empty_shards(mesh1d):
    x = torch.arange(30.).reshape(3, 10)  # Shard(0) on 4 ranks: rows 1, 1, 1, 0
    start = dt(torch.tensor(2), mesh1d, [R])
    s0 = dt(x, mesh1d, [Shard(0)])
    batch = Batch()
    batch.add(s0.narrow(1, start, 3), x.narrow(1, 2, 3), [Shard(0)])
    batch.add(torch.narrow(s0, 1, torch.tensor(4), 2), x.narrow(1, 4, 2), [Shard(0)])
    batch.add(s0.select(1, start), x.select(1, 2), [Shard(0)])
    for mode in ("reflect", "replicate", "circular"):
        batch.add(no_comm(lambda: torch.nn.functional.pad(s0, (2, 1), mode=mode)),
                  torch.nn.functional.pad(x, (2, 1), mode=mode), [Shard(0)])
    batch.check()
