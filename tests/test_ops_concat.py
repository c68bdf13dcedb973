"""cat / stack (and the split family): all inputs alike, or Replicate beside Shard (narrowed);
never along a sharded dim."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtorch import Partial, Replicate, Shard
from test_ops_support import PARTIALS, Batch, dt, illegal, make, no_comm, placements_1d

R = Replicate()


def cat_oracle(pa, pb, dim, stack):
    """Alike placements, or a Replicate beside a Shard (narrowed to its blocks)."""
    if pa != pb and any(isinstance(p, Partial) for p in pa + pb):
        return None
    out = []
    for p, q in zip(pa, pb):
        if p != q and R in (p, q):
            p = q = p if isinstance(p, Shard) else q
        if p != q:
            return None
        if isinstance(p, Shard):
            if not stack and p.dim == dim:
                return None
            out.append(Shard(p.dim + 1) if stack and p.dim >= dim else p)
        else:
            out.append(p)
    return tuple(out)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple), data=st.data(),
       stack=st.booleans())
def test_every_placement_pair(mesh1d, mesh2d, shape, data, stack):
    n = len(shape)
    dim = data.draw(st.integers(0, n if stack else n - 1))
    extra = data.draw(st.integers(1, 3))
    other = shape if stack else shape[:dim] + (extra,) + shape[dim + 1:]
    a, b = torch.randn(shape, dtype=torch.float64), torch.randn(other, dtype=torch.float64)
    fn = (lambda x, y: torch.stack([x, y], dim)) if stack else (lambda x, y: torch.cat((x, y), dim))
    expected = fn(a, b)
    batch = Batch()
    pairs = [((p,), (q,)) for (p,) in placements_1d(n) for (q,) in placements_1d(n)]
    cases = [(mesh1d, pa, pb) for pa, pb in pairs]
    choices = [R] + [Shard(d) for d in range(n)] + PARTIALS[:1]
    for _ in range(4):
        pl = tuple(data.draw(st.sampled_from(choices)) for _ in range(2))
        cases.append((mesh2d, pl, pl))
    for mesh, pa, pb in cases:
        da, db = make(a, mesh, pa, 1), make(b, mesh, pb, 2)
        want = cat_oracle(pa, pb, dim, stack)
        if want is None:
            illegal(lambda: fn(da, db))
        else:
            batch.add(no_comm(lambda: fn(da, db)), expected, want)
    batch.check()


def test_split_chunk_narrow_unbind_on_unsharded_dims(mesh1d, mesh2d):
    x = torch.randn(5, 8, 3)
    batch = Batch()
    for mesh, pl in ((mesh1d, [Shard(0)]), (mesh2d, [Shard(0), Shard(2)]), (mesh1d, [Partial()])):
        d = make(x.double(), mesh, pl, 1)
        xd = x.double()
        batch.add(list(no_comm(lambda: d.split(3, 1))), list(xd.split(3, 1)), pl)
        batch.add(list(no_comm(lambda: torch.chunk(d, 3, dim=1))), list(torch.chunk(xd, 3, 1)),
                  pl)
        batch.add(no_comm(lambda: d.narrow(1, 2, 4)), xd.narrow(1, 2, 4), pl)
        batch.add(list(no_comm(lambda: d.unbind(1))),
                  list(xd.unbind(1)), [Shard(p.dim if p.dim < 1 else p.dim - 1)
                                       if isinstance(p, Shard) else p for p in pl])
        batch.add(list(no_comm(lambda: d.split([2, 6], dim=1))), list(xd.split([2, 6], 1)), pl)
    batch.check()


def test_cat_messages(mesh1d):
    a = dt(torch.randn(4, 3), mesh1d, [Shard(0)])
    b = dt(torch.randn(4, 3), mesh1d, [Shard(1)])
    err = illegal(lambda: torch.cat([a, b], 1))
    assert "tensors[0] [S(0)], tensors[1] [S(1)]" in str(err)
    assert "tensors[1].redistribute(placements=[Shard(0)])" in str(err)
    illegal(lambda: torch.cat([a, a], 0), match="along dim 0, which is sharded")


def test_a_replicate_input_beside_shards_is_narrowed(mesh1d, mesh2d):
    batch = Batch()
    for rows in (5, 3):  # uneven, and fewer rows than ranks (empty blocks)
        a, b = torch.randn(rows, 3, dtype=torch.float64), torch.randn(rows, 2, dtype=torch.float64)
        da, db = dt(a, mesh1d, [Shard(0)]), dt(b, mesh1d, [R])
        batch.add(no_comm(lambda: torch.cat([db, da, db], 1)), torch.cat([b, a, b], 1),
                  [Shard(0)])
        sa, sb = dt(a, mesh2d, [Shard(0), R]), dt(a * 2, mesh2d, [R, Shard(1)])
        batch.add(no_comm(lambda: torch.stack([sa, sb], 1)), torch.stack([a, a * 2], 1),
                  [Shard(0), Shard(2)])
    batch.check()
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    dx = dt(x.detach(), mesh1d, [Shard(0)]).requires_grad_()
    dy = dt(y.detach(), mesh1d, [R]).requires_grad_()
    (torch.cat([x, y], 1) ** 2).sum().backward()
    (torch.cat([dx, dy], 1) ** 2).sum().backward()
    torch.testing.assert_close(dx.grad.to_torch(), x.grad)
    torch.testing.assert_close(dy.grad.to_torch(), y.grad)
