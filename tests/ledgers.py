"""The three collective ledgers, checked against each other: the controller's records
(CommDebugMode), the steps each worker ran (``rank_stats()["counts"]``) and the
torch.distributed calls it issued (``rank_stats()["dist_calls"]``: one per step, the poison
flag inside). Used by the cluster tests as ``out, counts = counted(lambda: ...)``."""

import dtorch


def per_rank_counts(records) -> dict:
    """``{rank: {kind: n}}`` the controller's records imply for the workers: a record is one
    step on every rank in any of its groups (a send_recv's (source, destination) pairs can name
    a rank twice: it sends and receives in the one step)."""
    out: dict = {}
    for rec in records:
        for r in {r for group in rec.groups for r in group}:
            out.setdefault(r, {}).setdefault(rec.kind, 0)
            out[r][rec.kind] += 1
    return out


def worker_counts() -> dict:
    """``{rank: ({kind: steps run}, torch.distributed calls issued)}``, once every rank ran
    everything issued (``rank_stats`` alone answers while a rank may still be running
    earlier work: a collective in flight would land in the next count)."""
    dtorch.synchronize()
    return {s["rank"]: (dict(s["counts"]), s["dist_calls"]) for s in dtorch.rank_stats()}


def counted(fn):
    """Run ``fn`` (returning a DTensor) and check the ledgers agree (the controller's, the
    workers' steps, and their torch.distributed calls: one per step, the poison flag inside);
    returns (out, counts)."""
    before = worker_counts()
    with dtorch.CommDebugMode() as mode:
        out = fn()
    dtorch.synchronize()
    after = worker_counts()
    ran = {r: {k: n - before[r][0].get(k, 0) for k, n in after[r][0].items()
               if n != before[r][0].get(k, 0)} for r in after}
    expected = per_rank_counts(mode.get_comm_records())
    assert {r: c for r, c in ran.items() if c} == expected, (ran, expected)
    calls = {r: after[r][1] - before[r][1] for r in after}
    assert calls == {r: sum(ran[r].values()) for r in after}, (calls, ran)
    return out, mode.get_comm_counts()
