"""The cost model: formulas on synthetic fits (pure), and measure_links / predict /
time_comms on the real 4-rank cluster (fits per kind and group, kept out of every ledger,
cached on the controller and in a file, predictions beside measured times)."""

import json
import math

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard, init_device_mesh, plan_redistribute
from dtorch.cost import (FIT_KINDS, LinkFit, LinkModel, fit_link, needed_keys, predict,
                         wire_bytes)
from dtorch.errors import ClusterError

# pure -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, p, expected", [
    ("all_gather", 4, 3 * 1000), ("reduce_scatter", 4, 750), ("all_reduce", 4, 1500),
    ("all_to_all", 4, 750), ("send_recv", 2, 1000), ("all_gather", 2, 1000)])
def test_wire_bytes_follow_the_ring_algorithms(kind, p, expected):
    assert wire_bytes(kind, p, 1000) == expected


def test_fit_recovers_a_synthetic_line():
    alpha, beta = 3e-4, 2e-9
    pts = [(n, alpha + beta * wire_bytes("all_gather", 4, n)) for n in (1024, 2**16, 2**20,
                                                                        2**22)]
    f = fit_link("all_gather", 4, 1, pts)
    assert f.alpha_s == pts[0][1]  # the smallest size's time (latency-bound)
    assert f.beta_s_per_byte == pytest.approx(beta, rel=1e-2)
    assert f.seconds(2**24) == pytest.approx(alpha + beta * 3 * 2**24, rel=1e-2)


def test_fit_keeps_alpha_and_beta_non_negative():
    f = fit_link("all_reduce", 2, 1, [(1024, 1e-3), (2**20, 2e-3), (2**22, 0.5e-3)])
    assert f.alpha_s == 1e-3 and f.beta_s_per_byte == 0.0  # a falling line: latency only
    jitter = fit_link("all_reduce", 2, 1, [(1024, 5e-3), (16384, 1e-3), (2**22, 2e-3)])
    assert jitter.alpha_s == 1e-3  # a slow smallest size is jitter: the next one is alpha


def test_prediction_of_each_seed_transition(m4):
    model = LinkModel(tuple(LinkFit(k, 4, 1, 1e-4, 1e-9) for k in FIT_KINDS[:4]))
    shape = (1024, 1024)  # 4 MiB: a shard is 1 MiB
    for src, dst, kind, wire in [
            ([Shard(0)], [Replicate()], "all_gather", 3 * 2**20),
            ([Shard(0)], [Shard(1)], "all_to_all", 0.75 * 2**20),
            ([Partial()], [Replicate()], "all_reduce", 1.5 * 4 * 2**20),
            ([Partial()], [Shard(0)], "reduce_scatter", 0.75 * 4 * 2**20)]:
        p = predict(plan_redistribute(m4, shape, src, dst), model)
        assert [s.kind for s in p.steps] == [kind]
        assert p.steps[0].wire_bytes == wire
        assert p.total_s == pytest.approx(1e-4 + 1e-9 * wire)
    free = predict(plan_redistribute(m4, shape, [Replicate()], [Shard(0)]), model)
    assert free.total_s == 0.0 and [s.kind for s in free.steps] == ["slice"]


def test_a_2d_plan_uses_the_fit_of_its_groups(m22):
    model = LinkModel((LinkFit("all_gather", 2, 2, 1e-4, 1e-9),
                       LinkFit("all_gather", 4, 1, 9.0, 9.0)))
    steps = plan_redistribute(m22, (8, 8), [Shard(0), Shard(0)], [Replicate(), Replicate()])
    assert needed_keys(steps) == {("all_gather", 2, 2)}
    p = predict(steps, model)
    assert [(s.group_size, s.groups, s.fit.group_size) for s in p.steps] == [(2, 2, 2)] * 2
    assert p.total_s < 1.0


def test_without_a_fit_the_prediction_says_unknown(m4):
    p = predict(plan_redistribute(m4, (4, 4), [Shard(0)], [Replicate()]), LinkModel(()))
    assert math.isnan(p.total_s) and "?" in p.text()


def test_model_round_trips_through_json():
    model = LinkModel((LinkFit("all_reduce", 2, 2, 1e-4, 2e-9, ((1024, 1e-4),)),), "k", 5.0)
    assert LinkModel.from_json(json.loads(json.dumps(model.to_json()))) == model


# on the cluster -----------------------------------------------------------------------------


def _ledgers():
    dtorch.synchronize()
    return [(s["counts"], s["dist_calls"], s["comm_seconds"]) for s in dtorch.rank_stats()]


def test_measure_links_fits_every_kind_and_counts_in_no_ledger(live, mesh2d):
    live.link_model = None
    before = _ledgers()
    with dtorch.CommDebugMode() as mode:
        model = dtorch.measure_links(force=True, meshes=[mesh2d])
    assert mode.get_total_counts() == 0
    assert _ledgers() == before  # rank counts, torch.distributed calls, measured seconds
    keys = {(f.kind, f.group_size, f.groups) for f in model.fits}
    for kind in FIT_KINDS[:4]:
        assert {(kind, 4, 1), (kind, 2, 2)} <= keys
    assert ("send_recv", 2, 2) in keys
    for f in model.fits:
        assert f.alpha_s > 0 and f.beta_s_per_byte >= 0 and len(f.points) == 5
    rows = dtorch.cluster_info()["links"]
    assert {(r["kind"], r["group_size"], r["groups"]) for r in rows} == keys


def test_links_are_cached_on_the_controller_and_in_a_file(live, mesh1d):
    first = dtorch.measure_links(meshes=[mesh1d])
    assert dtorch.measure_links(meshes=[mesh1d]).measured_at == first.measured_at
    live.link_model = None  # a new session on the same cluster reads the file
    again = dtorch.measure_links(meshes=[mesh1d])
    assert again.measured_at == first.measured_at and again.fits == first.fits


def test_time_comms_measures_a_redistribute_beside_its_prediction(live, mesh1d):
    full = torch.randn(256, 256)
    x = dtorch.distribute_tensor(full, mesh1d, [Shard(0)])
    t = dtorch.time_comms(lambda: x.redistribute(mesh1d, [Replicate()]))
    assert torch.equal(t.value.to_torch(), full)
    assert t.counts == {"all_gather": 1}
    assert set(t.by_kind) == {"all_gather 0"} and t.comm_s > 0
    assert t.comm_s <= t.wall_s
    steps = plan_redistribute(mesh1d, (256, 256), [Shard(0)], [Replicate()])
    assert t.predicted.total_s == predict(steps, live.link_model).total_s > 0
    assert x.predict_redistribute(placements=[Replicate()]) == t.predicted


def test_comm_seconds_count_only_the_ranks_in_the_groups(live):
    sub = dtorch.DeviceMesh("cpu", [0, 1])
    x = dtorch.distribute_tensor(torch.randn(8, 8), sub, [Shard(0)])
    dtorch.synchronize()
    before = {s["rank"]: dict(s["comm_seconds"]) for s in dtorch.rank_stats()}
    x.redistribute(sub, [Replicate()])
    dtorch.synchronize()
    after = {s["rank"]: dict(s["comm_seconds"]) for s in dtorch.rank_stats()}
    grew = {r for r in after if after[r].get("all_gather 0", 0) > before[r].get("all_gather 0",
                                                                                  0)}
    assert grew == {0, 1}


def test_a_dry_run_cannot_measure_but_predicts_with_a_given_model(other_cluster):
    other_cluster(n_workers=4, dry_run=True)
    m = init_device_mesh("cpu", 4)
    x = dtorch.zeros(8, 8, device_mesh=m, placements=[Shard(0)])
    with pytest.raises(ClusterError, match="dry-run cluster runs no collectives"):
        x.predict_redistribute(placements=[Replicate()])
    model = LinkModel((LinkFit("all_gather", 4, 1, 1e-4, 0.0),))
    assert x.predict_redistribute(placements=[Replicate()], model=model).total_s == 1e-4


def test_a_plan_beyond_the_cluster_is_refused_before_anything_is_sent(live):
    big = init_device_mesh("cpu", 8)
    steps = plan_redistribute(big, (8, 8), [Shard(0)], [Replicate()])
    issued = live.issued
    with pytest.raises(ClusterError, match="names rank 7 but the cluster has 4 ranks"):
        dtorch.predict(steps)
    with pytest.raises(ClusterError, match="names rank 7"):
        dtorch.measure_links(meshes=[big])
    assert live.issued == issued
    model = LinkModel((LinkFit("all_gather", 8, 1, 1e-4, 0.0),))
    assert dtorch.predict(steps, model).total_s == 1e-4  # a given model needs no cluster


def test_records_name_what_issued_them(live, mesh1d):
    """A user's redistribute names its placements; the all_reduce a decomposed op (a 0-dim
    Partial compared) runs is named after the op, not after the redistribute inside it.
    Mutation: ``record_steps`` preferring ``issued_by`` over the enclosing ``origin``."""
    x = dtorch.distribute_tensor(torch.randn(8, 8), mesh1d, [Shard(0)])
    p = dtorch.from_local([torch.tensor(1.0)] * 4, mesh1d, [Partial()])
    with dtorch.CommDebugMode() as mode:
        x.redistribute(mesh1d, [Replicate()])
        p > 2.0
    origins = [r.origin for r in mode.get_comm_records()]
    assert origins[0] == "redistribute [S(0)] -> [R]"
    assert len(origins) == 2 and origins[1] is not None and "redistribute" not in origins[1], \
        origins
