"""The cost model measured on the running cluster: ``dtorch.measure_links``, ``dtorch.predict``,
``dtorch.time_comms``.

``measure_links()`` times each collective kind (``dtorch.cost.FIT_KINDS``) at sizes from 1 KiB
to 4 MiB on the groups of every mesh in use (and the whole world), on every rank at once, and
fits ``dtorch.cost``'s alpha-beta line per kind, group size and number of groups. The fits are
kept on the controller and in a file (``DTORCH_CACHE_DIR`` or ``~/.cache/dtorch``, keyed by the
cluster's hosts, ranks, backend and device), so a later session on the same cluster reads them
instead of measuring. Its collectives count in no ledger. ``predict(steps)`` measures what it
lacks on first use. Example (with a cluster)::

    >>> import dtorch                                                     # doctest: +SKIP
    >>> m = dtorch.init_device_mesh("cpu", 4)                             # doctest: +SKIP
    >>> steps = dtorch.plan_redistribute(m, (1024, 1024), [Shard(0)], [Replicate()])  # doctest: +SKIP
    >>> print(dtorch.predict(steps))                                      # doctest: +SKIP
    all_gather on 0: 1 group of 4, 1.0 MiB/rank -> 1.9 ms
    total 1.9 ms
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

from ..cost import (FIT_KINDS, LinkModel, Prediction, fit_key, fit_link, needed_keys,
                    predict as _predict)
from ..errors import ClusterError
from . import messages as m
from . import session

SIZES = (1024, 16 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)  # bytes per rank
REPEATS = 7
FORMAT = 1  # bumped when the file's meaning changes


def cache_dir() -> Path:
    """Where fitted links are kept across sessions: ``DTORCH_CACHE_DIR`` or ~/.cache/dtorch."""
    return Path(os.environ.get("DTORCH_CACHE_DIR") or Path.home() / ".cache" / "dtorch")


def cluster_key(c) -> str:
    """The hosts, ranks, backend and device type of controller ``c``: what a fit is valid for."""
    hosts = sorted({info.host for info in c.ranks})
    return f"v{FORMAT} {c.backend} {c.device_type} {c.world} ranks on " + ",".join(hosts)


def _cache_file(key: str) -> Path:
    return cache_dir() / "links" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


def _load(key: str) -> LinkModel:
    try:
        data = json.loads(_cache_file(key).read_text())
        model = LinkModel.from_json(data)
        if model.key == key:
            return model
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no file or an unreadable one: measure again
    return LinkModel((), key)


def _save(model: LinkModel) -> None:
    path = _cache_file(model.key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(model.to_json()))
        tmp.replace(path)
    except OSError:  # a read-only home: the fits live for this session only
        pass


def current_model(c=None) -> LinkModel | None:
    """The fits known for the running cluster (this session's, or the file's), measuring
    nothing; None when no cluster runs."""
    if c is None:
        if not session.is_running():
            return None
        c = session.get_controller()
    model = getattr(c, "link_model", None)
    if model is None and not _is_dry(c):
        model = c.link_model = _load(cluster_key(c))
    return model


def measure_links(force: bool = False, meshes: Iterable | None = None) -> LinkModel:
    """Fit the cost model on the running cluster (starting the default one if none runs).

    Measures each collective kind on the groups of ``meshes`` (default: every mesh used so
    far) and of the whole world, unless already measured for this cluster (``force=True``
    measures again). A few seconds at most; returns the :class:`dtorch.cost.LinkModel`,
    also listed by ``dtorch.cluster_info()["links"]``.
    """
    c = session.get_controller()
    _check_measurable(c)
    from ..mesh import DeviceMesh
    meshes = list(meshes) if meshes is not None else list(c._meshes_ready)
    meshes.append(DeviceMesh(c.device_type, list(range(c.world))))
    for mesh in meshes:  # a mesh this cluster cannot run is refused before anything is sent
        c.ensure_mesh(mesh)
    specs: dict = {}
    for mesh in meshes:
        for dim in range(mesh.ndim):
            groups = tuple(tuple(g) for g in mesh.groups(dim))
            if len(groups[0]) > 1:
                for kind in FIT_KINDS[:4]:
                    specs.setdefault((kind, len(groups[0]), len(groups)), groups)
    if c.world > 1:
        half = c.world // 2
        pairs = tuple((r, r + half) for r in range(half))
        specs[("send_recv", 2, len(pairs))] = pairs
    return _ensure(c, specs, force)


def model_for(steps) -> LinkModel:
    """The running cluster's fits, with whatever ``steps`` need measured first."""
    c = session.get_controller()
    _check_measurable(c)
    specs = {}
    for step in steps:  # the groups to time each needed fit on: the first step's that needs it
        key = fit_key(step)
        if key is not None:
            specs.setdefault(key, tuple(tuple(g) for g in step.groups))
    return _ensure(c, specs, False)


def predict(steps_or_plan, model: LinkModel | None = None) -> Prediction:
    """Predicted time of each step of a plan (``dtorch.plan_redistribute``) or of each record
    of a ledger (``CommDebugMode().get_comm_records()``) on this cluster; ``model`` defaults
    to the running cluster's fits, measured on first use (``measure_links``)."""
    steps = list(steps_or_plan)
    if model is None:
        model = model_for(steps) if needed_keys(steps) else LinkModel(())
    return _predict(steps, model)


def _check_measurable(c) -> None:
    if _is_dry(c):
        raise ClusterError("a dry-run cluster runs no collectives, so links cannot be measured; "
                           "pass model=dtorch.cost.LinkModel(...) to predict, or "
                           "dtorch.init() a real cluster")


def _is_dry(c) -> bool:
    return type(c).__name__ == "DryRunController"


def _ensure(c, specs: dict, force: bool) -> LinkModel:
    top = max((r for groups in specs.values() for g in groups for r in g), default=0)
    if top >= c.world:
        raise ClusterError(f"the plan names rank {top} but the cluster has {c.world} ranks "
                           f"(0..{c.world - 1}); predict plans of meshes within the cluster, "
                           f"or pass model= to predict without it")
    model = current_model(c)
    todo = {k: g for k, g in specs.items() if force or not model.has(*k)}
    if todo:
        c.ensure_groups([g for (kind, _, _), groups in todo.items() if kind != "send_recv"
                         for g in groups])
        fits = [fit_link(kind, p, n, _timed(c, kind, groups))
                for (kind, p, n), groups in sorted(todo.items())]
        model = model.merged(fits)._replace(key=cluster_key(c), measured_at=time.time())
        _save(model)
    c.link_model = model
    return model


def _timed(c, kind: str, groups) -> list[tuple[int, float]]:
    """``[(bytes per rank, seconds)]``: per size the median over repeats of the slowest rank."""
    answers = c.wait(c.request(lambda req: m.MeasureLinks(req, kind, groups, SIZES, REPEATS),
                               range(c.world)))
    per_size: dict[int, list[list[float]]] = {}
    for rank, (status, value) in sorted(answers.items()):
        if status != "ok":
            raise c.error_for(value)
        for size, times in value.items():
            per_size.setdefault(int(size), []).append(times)
    return [(size, statistics.median(max(col) for col in zip(*runs)))
            for size, runs in sorted(per_size.items())]


class CommTiming(NamedTuple):
    """What :func:`time_comms` measured: ``value`` (what ``fn`` returned), ``wall_s`` (``fn``
    and the wait for its work, on the controller), ``comm_s`` (the slowest rank's seconds inside
    collectives), ``by_kind`` (``{"kind dim": seconds}``, slowest rank per key), ``counts``
    (``{kind: n}`` issued) and ``predicted`` (the cost model's :class:`Prediction`)."""

    value: Any
    wall_s: float
    comm_s: float
    by_kind: dict
    counts: dict
    predicted: Prediction


def comm_seconds_by_rank(c=None) -> dict[int, dict]:
    """``{rank: {"kind dim": seconds}}`` each rank spent in collectives so far (cumulative)."""
    c = c or session.get_controller()
    return {s["rank"]: dict(s.get("comm_seconds", {})) for s in c.stats()}


def comm_delta(before: dict, after: dict) -> tuple[float, dict]:
    """``(slowest rank's total, {key: slowest rank's seconds})`` between two snapshots of
    :func:`comm_seconds_by_rank`.

    >>> comm_delta({0: {"all_gather 0": 1.0}, 1: {}}, {0: {"all_gather 0": 1.5}, 1: {"all_gather 0": 0.7}})
    (0.7, {'all_gather 0': 0.7})
    """
    total, by_key = 0.0, {}
    for rank, now in after.items():
        was = before.get(rank, {})
        deltas = {k: v - was.get(k, 0.0) for k, v in now.items() if v - was.get(k, 0.0) > 0}
        total = max(total, sum(deltas.values()))
        for k, v in deltas.items():
            by_key[k] = max(by_key.get(k, 0.0), v)
    return total, by_key


def time_comms(fn: Callable[[], Any]) -> CommTiming:
    """Run ``fn`` (issuing DTensor work), wait for it, and measure its collectives beside the
    cost model's prediction of them.

    >>> t = dtorch.time_comms(lambda: x.redistribute(m, [Replicate()]))   # doctest: +SKIP
    >>> t.comm_s, t.predicted.total_s, t.counts                          # doctest: +SKIP
    (0.0019, 0.0017, {'all_gather': 1})
    """
    from ..comm_debug import CommDebugMode
    c = session.get_controller()
    c.synchronize()
    before = comm_seconds_by_rank(c)
    with CommDebugMode() as mode:
        start = time.perf_counter()
        value = fn()
        c.synchronize()
        wall = time.perf_counter() - start
    comm_s, by_kind = comm_delta(before, comm_seconds_by_rank(c))
    records = mode.get_comm_records()
    return CommTiming(value, wall, comm_s, by_kind, mode.get_comm_counts(), predict(records))
