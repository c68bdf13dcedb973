"""Layout math: chunk sizes, placement normalization, rank blocks, shard_of. Pure."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtorch import (DeviceMesh, Partial, PlacementValueError, Replicate, Shard,
                    init_device_mesh)
from dtorch.layout import (chunk_sizes, holds_value, local_offset, local_shape, local_shapes,
                           normalize_placements, rank_block, rank_blocks, shard_of)


# chunk sizes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("size", range(0, 21))
@pytest.mark.parametrize("n", range(1, 9))
def test_chunk_sizes_match_torch_chunk(size, n):
    torch_sizes = [c.shape[0] for c in torch.arange(size).chunk(n)] if size else []
    expected = tuple(torch_sizes) + (0,) * (n - len(torch_sizes))
    assert chunk_sizes(size, n) == expected
    assert len(chunk_sizes(size, n)) == n and sum(chunk_sizes(size, n)) == size


def test_chunk_sizes_seed_examples():
    assert chunk_sizes(11, 4) == (3, 3, 3, 2)
    assert chunk_sizes(3, 4) == (1, 1, 1, 0)
    assert chunk_sizes(5, 4) == (2, 2, 1, 0)  # torch.chunk gives 3 pieces; padded with a 0
    assert chunk_sizes(0, 3) == (0, 0, 0)


# seed 002 examples ---------------------------------------------------------------------------
def test_seed_block_of_rank_0_and_3(m22):
    big = torch.arange(16.).reshape(4, 4)
    pl = (Shard(0), Shard(1))
    expected = {0: [0, 1, 4, 5], 1: [2, 3, 6, 7], 2: [8, 9, 12, 13], 3: [10, 11, 14, 15]}
    for r, values in expected.items():
        coord = m22.get_coordinate(r)
        block = rank_block((4, 4), m22, pl, coord)
        assert block.shape == (2, 2)
        assert big[block.slices()].flatten().tolist() == values
        assert shard_of(big, m22, pl, coord).flatten().tolist() == values
    assert rank_blocks((4, 4), m22, pl)[3].offset == (2, 2)
    assert local_shapes((4, 4), m22, pl) == {r: (2, 2) for r in range(4)}


def test_seed_uneven_columns():
    m = init_device_mesh("cpu", 4)
    shapes = local_shapes((4, 11), m, (Shard(1),))
    assert [shapes[r] for r in range(4)] == [(4, 3), (4, 3), (4, 3), (4, 2)]
    assert [local_offset((4, 11), m, (Shard(1),), (c,)) for c in range(4)] == \
        [(0, 0), (0, 3), (0, 6), (0, 9)]


def test_seed_three_rows_on_four_ranks():
    m = init_device_mesh("cpu", 4)
    assert [local_shape((3,), m, (Shard(0),), (c,))[0] for c in range(4)] == [1, 1, 1, 0]
    assert [local_shape((3, 5), m, (Shard(-2),), (c,)) for c in range(4)] == \
        [(1, 5), (1, 5), (1, 5), (0, 5)]
    empty = shard_of(torch.ones(3, 5), m, (Shard(0),), (3,))
    assert empty.shape == (0, 5)


def test_replicate_keeps_whole(m22):
    t = torch.arange(12.).reshape(3, 4)
    for r in m22.ranks:
        c = m22.get_coordinate(r)
        assert torch.equal(shard_of(t, m22, (Replicate(), Replicate()), c), t)
    assert local_shapes((3, 4), m22, (Replicate(), Shard(1))) == {r: (3, 2) for r in range(4)}


def test_permuted_mesh_uses_coordinates():
    m = DeviceMesh("cpu", [3, 0, 2, 1])
    t = torch.arange(8.)
    blocks = {r: shard_of(t, m, (Shard(0),), m.get_coordinate(r)).tolist() for r in m.ranks}
    assert blocks == {3: [0, 1], 0: [2, 3], 2: [4, 5], 1: [6, 7]}


# normalize_placements ------------------------------------------------------------------------
def test_normalize_negative_dims(m22):
    assert normalize_placements([Shard(-1), Shard(-2)], m22, 2) == (Shard(1), Shard(0))
    assert normalize_placements((Shard(-3), Partial("max")), m22, 3) == (Shard(0), Partial("max"))
    assert normalize_placements([Replicate(), Shard(1)], m22, 2) == (Replicate(), Shard(1))
    assert isinstance(normalize_placements([Replicate(), Replicate()], m22, 0), tuple)


def test_normalize_single_placement_for_1d_mesh():
    m = DeviceMesh("cpu", [0, 1])
    assert normalize_placements(Shard(-1), m, 2) == (Shard(1),)


@pytest.mark.parametrize("dim", [2, -3, 5])
def test_normalize_out_of_range_dim(m22, dim):
    with pytest.raises(PlacementValueError, match=r"out of range for a 2-D tensor.*\[-2, 2\)"):
        normalize_placements([Shard(dim), Replicate()], m22, 2)


def test_normalize_zero_dim_tensor_cannot_shard(m22):
    with pytest.raises(PlacementValueError, match="Replicate or Partial"):
        normalize_placements([Shard(0), Replicate()], m22, 0)


@pytest.mark.parametrize("pl", [[Shard(0)], [Shard(0), Replicate(), Replicate()], []])
def test_normalize_wrong_count_says_what_to_pass(m22, pl):
    with pytest.raises(PlacementValueError) as e:
        normalize_placements(pl, m22, 2)
    msg = str(e.value)
    assert f"got {len(pl)} placements" in msg
    assert "one placement per mesh dim" in msg and "[R, R]" in msg


def test_normalize_rejects_non_placements(m22):
    with pytest.raises(PlacementValueError, match="not a placement"):
        normalize_placements([0, Replicate()], m22, 2)
    with pytest.raises(PlacementValueError, match="not a placement"):
        normalize_placements(["S(0)", Replicate()], m22, 2)


# nested sharding (several mesh dims on one tensor dim) ----------------------------------------
def test_nested_shard_same_dim_matches_chunk_twice(m22):
    t = torch.arange(5.)
    outer = list(t.chunk(2))
    for r in m22.ranks:
        a, b = m22.get_coordinate(r)
        inner = list(outer[a].chunk(2))
        expected = inner[b] if b < len(inner) else outer[a][:0]
        got = shard_of(t, m22, (Shard(0), Shard(0)), (a, b))
        assert torch.equal(got, expected), (r, got, expected)
    assert local_shapes((5,), m22, (Shard(0), Shard(0))) == {0: (2,), 1: (1,), 2: (1,), 3: (1,)}


def test_nested_shard_order_matters():
    # mesh dim 0 is outer: [S(0), S(0)] is chunk-of-chunk, not a flat 6-way chunk
    m = init_device_mesh("cpu", (2, 3))
    sizes = [local_shape((7,), m, (Shard(0), Shard(0)), c)[0]
             for c in itertools.product(range(2), range(3))]
    assert sizes == [2, 2, 0, 1, 1, 1]  # 7 -> 4,3 -> torch.chunk: (2,2,0),(1,1,1)


def _chunk_nested(t, mesh_shape, placements, coord):
    """Reference: apply torch.chunk per mesh dim, outermost first (empty piece if missing)."""
    for p, n, c in zip(placements, mesh_shape, coord):
        if isinstance(p, Shard):
            parts = list(t.chunk(n, dim=p.dim)) if t.shape[p.dim] else []
            if c < len(parts):
                t = parts[c]
            else:
                t = t.narrow(p.dim, t.shape[p.dim], 0)
    return t


_MESH_SHAPES = [(1,), (2,), (3,), (4,), (5,), (8,), (2, 2), (2, 3), (3, 2), (4, 2), (1, 4),
                (2, 2, 2), (2, 1, 3), (1, 1, 1)]


@st.composite
def _layouts(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    mesh_shape = draw(st.sampled_from(_MESH_SHAPES))
    pl = tuple(draw(st.one_of(st.builds(Shard, st.integers(-ndim, ndim - 1)),
                              st.just(Replicate()), st.just(Partial("sum")),
                              st.just(Partial("max")))) for _ in mesh_shape)
    return shape, mesh_shape, pl


@settings(max_examples=150, deadline=None)
@given(_layouts())
def test_blocks_match_nested_torch_chunk_and_tile(layout):
    shape, mesh_shape, pl = layout
    mesh = init_device_mesh("cpu", mesh_shape)
    norm = normalize_placements(pl, mesh, len(shape))
    t = torch.arange(float(max(1, torch.Size(shape).numel()))).narrow(
        0, 0, torch.Size(shape).numel()).reshape(shape)
    cover = torch.zeros(shape)
    for r in mesh.ranks:
        coord = mesh.get_coordinate(r)
        block = rank_block(shape, mesh, norm, coord)
        expected = _chunk_nested(t, mesh_shape, norm, coord)
        assert block.shape == tuple(expected.shape)
        assert torch.equal(t[block.slices()], expected)
        local = shard_of(t, mesh, norm, coord)
        assert local.shape == expected.shape
        if holds_value(mesh, norm, coord):
            assert torch.equal(local, expected)
        else:
            assert not local.any()
        cover[block.slices()] += 1
    # every element is held by exactly (product of non-Shard mesh dim sizes) ranks
    copies = 1
    for p, n in zip(norm, mesh_shape):
        if not isinstance(p, Shard):
            copies *= n
    assert bool((cover == copies).all())


# shard_of and holds_value ---------------------------------------------------------------------
def test_shard_of_partial(m22):
    t = torch.arange(4.).reshape(2, 2) + 1
    for op in ("avg", "max", "min"):
        for r in m22.ranks:
            assert torch.equal(shard_of(t, m22, (Partial(op), Replicate()),
                                        m22.get_coordinate(r)), t)
    got = {r: shard_of(t, m22, (Partial(), Shard(1)), m22.get_coordinate(r)) for r in m22.ranks}
    assert torch.equal(got[0], t[:, :1]) and torch.equal(got[1], t[:, 1:])
    assert not got[2].any() and not got[3].any() and got[2].shape == (2, 1)
    # sum of the partial shards is the value
    assert torch.equal(got[0] + got[2], t[:, :1])


def test_shard_of_returns_a_copy(m22):
    t = torch.zeros(4, 4)
    local = shard_of(t, m22, (Shard(0), Replicate()), (0, 0))
    local += 1
    assert not t.any()


def test_holds_value(m22):
    assert holds_value(m22, (Partial(), Partial()), (0, 0))
    assert not holds_value(m22, (Partial(), Partial()), (0, 1))
    assert not holds_value(m22, (Partial(), Replicate()), (1, 0))
    assert holds_value(m22, (Partial("max"), Partial("avg")), (1, 1))
    assert holds_value(m22, (Shard(0), Replicate()), (1, 1))
