"""The collective ledger (dtorch.comm_debug), fed with planned steps: no cluster needed.

The runtime tests compare this ledger with what the workers ran.
"""

import pytest

from dtorch import CommDebugMode, DeviceMesh, Partial, Replicate, Shard, plan_redistribute
from dtorch.comm_debug import CommLedger, CommRecord, listen, record_steps, unlisten

R = Replicate()


def test_comm_debug_mode_counts_plan_steps(m22):
    steps = plan_redistribute(m22, (4, 4), [Partial(), Shard(1)], [Shard(0), R])
    with CommDebugMode() as mode:
        record_steps(steps)
        record_steps(plan_redistribute(m22, (4, 4), [R, R], [Shard(0), Partial()]))  # local only
    assert mode.get_comm_counts() == {"reduce_scatter": 1, "all_gather": 1}
    assert mode.get_total_counts() == 2
    recs = mode.get_comm_records()
    assert [r.kind for r in recs] == ["reduce_scatter", "all_gather"]
    assert recs[0].mesh_dim_name == "dp" and recs[0].reduce_op == "sum"
    assert recs[1].mesh_dim_name == "tp" and recs[1].reduce_op is None
    assert recs[0].groups == ((0, 2), (1, 3))
    assert recs[1].bytes_per_rank == steps[1].bytes_per_rank
    assert recs[1].total_bytes == recs[1].bytes_per_rank * 4


def test_comm_debug_mode_records_reduce_op(m4):
    with CommDebugMode() as mode:
        record_steps(plan_redistribute(m4, (4,), [Partial("max")], [R]))
    assert mode.get_comm_records()[0].reduce_op == "max"


def test_comm_debug_mode_nested_and_closed(m4):
    gather = plan_redistribute(m4, (4,), [Shard(0)], [R])
    with CommDebugMode() as outer:
        record_steps(gather)
        with CommDebugMode() as inner:
            record_steps(gather)
        record_steps(gather)
    record_steps(gather)  # nobody listening: nothing recorded, no error
    assert outer.get_comm_counts() == {"all_gather": 3}
    assert inner.get_comm_counts() == {"all_gather": 1}


def test_comm_debug_mode_unlistens_on_error(m4):
    gather = plan_redistribute(m4, (4,), [Shard(0)], [R])
    with pytest.raises(RuntimeError):
        with CommDebugMode() as mode:
            raise RuntimeError("boom")
    record_steps(gather)
    assert mode.get_total_counts() == 0


def test_ledger_summary_and_clear(m22):
    ledger = CommLedger()
    listen(ledger)
    try:
        record_steps(plan_redistribute(m22, (4, 4), [Shard(0), Shard(1)], [R, R], itemsize=4))
        record_steps(plan_redistribute(m22, (4, 4), [Shard(0), R], [R, R], itemsize=4))
        record_steps(plan_redistribute(DeviceMesh("cpu", [0, 1]), (4,), [R], [R],
                                       dst_mesh=DeviceMesh("cpu", [2, 3])))
    finally:
        unlisten(ledger)
    unlisten(ledger)  # twice is harmless
    rows = {(k, d): (c, b) for k, d, c, b in ledger.summary()}
    # [S0,S1]->[R,R] gathers dp (2x2 blocks, 16 B) then tp (4x2, 32 B); [S0,R]->[R,R] dp 32 B
    assert rows[("all_gather", "dp")] == (2, 16 + 32)
    assert rows[("all_gather", "tp")] == (1, 32)
    assert rows[("send_recv", None)] == (1, 16)
    assert ledger.get_total_counts() == 4
    ledger.clear()
    assert ledger.get_total_counts() == 0 and ledger.get_comm_counts() == {}


def test_comm_record_unnamed_mesh_summary_uses_index():
    ledger = CommLedger()
    ledger.add(CommRecord("all_reduce", 1, None, ((0, 1),), 8, "sum"))
    assert ledger.summary() == [("all_reduce", "1", 1, 8)]
