"""Fan-out through relays: the controller writes to at most DTORCH_FANOUT ranks per flush;
every rank still receives exactly its own batches, in order."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.runtime.batches import RankBatch
from dtorch.runtime.fanout import (block_of, parent_of, plan_flush, relay_for, sub_blocks,
                                   top_blocks)
from dtorch.runtime.session import get_controller
from ledgers import counted

pytestmark = pytest.mark.timeout(240)


def _delivered(world, fanout, batches, seqs):
    """Walk the relays as the ranks do: ``{rank: (seq, batch)}`` each rank would take."""
    got = {}

    def visit(head, relay, depth):
        assert depth <= 64
        routes = list(relay.routes)
        for block in sub_blocks(block_of(head, world, fanout), fanout):
            part = relay_for(block, routes, relay.batches, relay.ack)
            if part.routes:
                visit(block.start, part, depth + 1)
        for start, stop, seq, index, _, _ in routes:
            if start <= head < stop:
                assert head not in got
                got[head] = (seq, relay.batches[index])
    for head, relay in plan_flush(batches, seqs, {}, world, fanout):
        visit(head, relay, 0)
    return got


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 300), fanout=st.integers(2, 40), data=st.data())
def test_every_rank_gets_exactly_its_batch_through_the_relays(world, fanout, data):
    ranks = data.draw(st.sets(st.integers(0, world - 1)))
    shared, other = RankBatch(None, ((b"a", ()),), False, 1), RankBatch(None, ((b"b", ()),),
                                                                           True, 1)
    batches = {r: shared if r % 3 else other for r in ranks}
    seqs = {r: r // 5 for r in ranks}  # runs of ranks with the same seq: ranges
    got = _delivered(world, fanout, batches, seqs)
    assert got == {r: (seqs[r], (batches[r].definitions, batches[r].segments)) for r in ranks}
    assert len(plan_flush(batches, seqs, {}, world, fanout)) <= fanout


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 2000), fanout=st.integers(2, 40))
def test_the_tree_reaches_each_rank_once_and_parents_agree(world, fanout):
    seen = []

    def walk(block, parent):
        seen.append(block.start)
        assert parent_of(block.start, world, fanout) == parent
        assert block_of(block.start, world, fanout) == block
        children = sub_blocks(block, fanout)
        assert len(children) <= fanout
        for child in children:
            walk(child, block.start)
    for block in top_blocks(world, fanout):
        walk(block, None)
    assert sorted(seen) == list(range(world))


def test_a_bad_fanout_setting_is_refused_before_anything_starts(other_cluster, monkeypatch):
    monkeypatch.setenv("DTORCH_FANOUT", "1")
    with pytest.raises(ValueError, match="DTORCH_FANOUT"):
        other_cluster(n_workers=4, dry_run=True)


def test_controller_sends_per_flush_stay_flat_from_the_fanout_up(other_cluster, monkeypatch):
    """Dry run: what the controller itself writes per flush of ops (staged shards left
    out) at 4, 64 and 1,024 ranks; from 32 ranks up the messages stay at the fan-out and the
    bytes within 2x."""
    monkeypatch.setenv("DTORCH_FANOUT", "32")
    figures = {}
    for world in (4, 32, 64, 1024):
        c = other_cluster(n_workers=world, dry_run=True)
        mesh = dtorch.init_device_mesh("cpu", world)
        x = dtorch.ones(world, 8, device_mesh=mesh, placements=[Shard(0)])
        dtorch.synchronize()
        messages, nbytes, flushes = c.sent_messages, c.sent_bytes, c.flushes
        for _ in range(5):
            y = x
            for _ in range(20):
                y = torch.relu(y * 2.0 - 1.0)
            dtorch.synchronize()
        n = c.flushes - flushes
        figures[world] = ((c.sent_messages - messages) / n, (c.sent_bytes - nbytes) / n)
    assert figures[4][0] == 4 and figures[32][0] == 32
    assert figures[64][0] == 32 and figures[1024][0] == 32
    assert figures[1024][1] <= 2 * figures[32][1], figures


def test_a_world_beyond_the_fanout_runs_through_relays(other_cluster, monkeypatch):
    monkeypatch.setenv("DTORCH_FANOUT", "2")
    other_cluster(n_workers=4)
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 6, generator=g), torch.randn(6, 4, generator=g)
    da = dtorch.tensor(a, device_mesh=mesh, placements=[Shard(0), Shard(1)])
    db = dtorch.tensor(b, device_mesh=mesh, placements=[Replicate(), Shard(0)])
    for _ in range(3):  # plain and replayed instances
        out, counts = counted(lambda: (da @ db).redistribute(placements=[Shard(0),
                                                                         Replicate()]))
        torch.testing.assert_close(out.to_torch(), a @ b)
        assert sum(counts.values()) == 1
    p = dtorch.tensor(torch.ones(4), device_mesh=mesh, placements=[Partial(), Replicate()])
    assert p.sum().item() == 4.0  # its all_reduce over dp, read through the relays
    stats = dtorch.rank_stats()
    assert [s["relayed"] > 0 for s in stats] == [True, False, True, False]
    sent = get_controller().channels.sent  # the controller wrote batches to 0 and 2 only
    assert sent[0] > 10 and sent[2] > 10 and sent[1] + sent[3] < sent[0] // 2, sent


def test_two_levels_of_relays_a_head_without_work_and_acks(other_cluster, monkeypatch):
    """8 ranks, DTORCH_FANOUT=2: heads 0 and 4 relay to 1, 3 and 5, 7; 1 and 5 relay on to
    2 and 6. Work on ranks 5-7 passes through rank 4, which runs none of it; a flush that
    waits for delivery hears back from every rank through the relays."""
    assert [parent_of(r, 8, 2) for r in range(8)] == [None, 0, 1, 0, None, 4, 5, 4]
    monkeypatch.setenv("DTORCH_FANOUT", "2")
    c = other_cluster(n_workers=8)
    stage = dtorch.DeviceMesh("cpu", [5, 6, 7])
    x0 = torch.arange(12.0).reshape(6, 2)
    x = dtorch.tensor(x0, device_mesh=stage, placements=[Shard(0)])
    dtorch.synchronize()
    before = {s["rank"]: s["instructions"] for s in dtorch.rank_stats()}
    y = (x * 2 + 1).redistribute(placements=[Replicate()])
    torch.testing.assert_close(y.to_torch(), x0 * 2 + 1)
    dtorch.synchronize()
    ran = {s["rank"]: s["instructions"] - before[s["rank"]] for s in dtorch.rank_stats()}
    assert ran[5] >= ran[6] == ran[7] > 0 and ran[4] <= 1, ran  # 5 also read; 4: the Sync
    assert [s["relayed"] > 0 for s in dtorch.rank_stats()] == \
        [True, True, False, False, True, True, False, False]
    x.redistribute(placements=[Replicate()])
    acks = c.flush(delivered=True)
    assert sorted(acks) == [5, 6, 7]
    c.wait(acks, timeout=60)
    dtorch.synchronize()
