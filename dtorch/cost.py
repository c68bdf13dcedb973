"""The cost model: the predicted time of collectives from latency/bandwidth fits. Pure.

Each collective kind on a group of ``p`` ranks (with ``g`` such groups running at once, as a
mesh dim's groups do) gets the classic alpha-beta model, fitted on the cluster itself by
:func:`dtorch.measure_links`::

    t = alpha + beta * wire_bytes(kind, p, b)

``b`` is the step's ``bytes_per_rank`` (what each rank puts into the collective, padding
included) and ``wire_bytes`` what each rank sends by the ring algorithms gloo and NCCL use:

============== ================= ================================================
kind           wire_bytes        why
============== ================= ================================================
all_gather     (p - 1) * b       b is one shard; each rank passes on p - 1 shards
reduce_scatter (p - 1) / p * b   b is the whole buffer; p - 1 of its p chunks go
all_reduce     2 (p - 1) / p * b a reduce_scatter, then an all_gather
all_to_all     (p - 1) / p * b   every chunk but one's own
send_recv      b                 one shard, point to point
broadcast      b                 the whole buffer
============== ================= ================================================

``alpha`` is the fixed cost per call (seconds), ``beta`` the seconds per byte sent (1 / the
bandwidth the ranks got). Local steps (``slice``, ``to_partial``) cost no communication.
Example with a synthetic fit (1 ms per call, 1 GB/s)::

    >>> from dtorch import init_device_mesh, Shard, Replicate, plan_redistribute
    >>> m = init_device_mesh("cpu", 4)
    >>> model = LinkModel((LinkFit("all_gather", 4, 1, 1e-3, 1e-9),))
    >>> steps = plan_redistribute(m, (1024, 1024), [Shard(0)], [Replicate()])
    >>> p = predict(steps, model)
    >>> round(p.total_s * 1e3, 3)   # 1 ms + 3 shards of 1 MiB at 1 GB/s
    4.146
    >>> p.steps[0].wire_bytes
    3145728.0
"""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple, Sequence

FIT_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "send_recv")


def wire_bytes(kind: str, group_size: int, nbytes: int) -> float:
    """Bytes each rank sends for a ``kind`` collective putting in ``nbytes`` (see the table).

    >>> wire_bytes("all_reduce", 4, 1000), wire_bytes("all_gather", 2, 1000)
    (1500.0, 1000.0)
    """
    p = max(1, int(group_size))
    factor = {"all_gather": p - 1, "reduce_scatter": (p - 1) / p,
              "all_reduce": 2 * (p - 1) / p, "all_to_all": (p - 1) / p}.get(kind, 1.0)
    return float(factor * nbytes)


class LinkFit(NamedTuple):
    """One fitted line: ``seconds = alpha_s + beta_s_per_byte * wire bytes`` for ``kind`` on
    groups of ``group_size`` ranks, ``groups`` of them at once. ``points`` are the measured
    ``(bytes_per_rank, seconds)`` it was fitted on."""

    kind: str
    group_size: int
    groups: int
    alpha_s: float
    beta_s_per_byte: float
    points: tuple = ()

    def seconds(self, nbytes: int) -> float:
        """Predicted seconds for a collective putting ``nbytes`` per rank in."""
        return self.alpha_s + self.beta_s_per_byte * wire_bytes(self.kind, self.group_size,
                                                                nbytes)

    @property
    def bandwidth_gb_s(self) -> float:
        """1 / beta in GB/s (inf when beta is 0)."""
        return math.inf if self.beta_s_per_byte <= 0 else 1e-9 / self.beta_s_per_byte

    def row(self) -> dict:
        """The fit as a plain dict (what ``cluster_info()["links"]`` lists)."""
        return {"kind": self.kind, "group_size": self.group_size, "groups": self.groups,
                "alpha_us": round(self.alpha_s * 1e6, 2),
                "beta_ns_per_byte": round(self.beta_s_per_byte * 1e9, 5),
                "bandwidth_gb_s": round(self.bandwidth_gb_s, 3),
                "points": [list(p) for p in self.points]}


def fit_link(kind: str, group_size: int, groups: int,
             points: Sequence[tuple[int, float]]) -> LinkFit:
    """The line through the measured ``(bytes per rank, seconds)`` points: ``alpha`` is the
    time of the smallest size (latency-bound; the second smallest's when that is lower: jitter
    only ever adds time), ``beta`` the least-squares slope of the others through
    ``(0, alpha)``, so the largest sizes, which predictions extrapolate from, set the
    bandwidth. Both are kept non-negative.

    >>> f = fit_link("all_reduce", 2, 1, [(n, 2e-4 + n * 1e-9) for n in (1e3, 1e5, 1e6)])
    >>> round(f.alpha_s * 1e6, 1), round(f.beta_s_per_byte * 1e9, 3)
    (201.0, 0.999)
    """
    pts = sorted((int(n), float(t)) for n, t in points if t > 0)
    if not pts:
        raise ValueError(f"no measured points to fit {kind} on groups of {group_size}")
    alpha = min(t for _, t in pts[:2])
    rest = [(wire_bytes(kind, group_size, n), t - alpha) for n, t in pts[1:]]
    sxx = sum(x * x for x, _ in rest)
    beta = max(0.0, sum(x * y for x, y in rest) / sxx) if sxx > 0 else 0.0
    return LinkFit(kind, int(group_size), int(groups), alpha, beta, tuple(pts))


class LinkModel(NamedTuple):
    """The fits of one cluster, and the key (hosts, ranks, backend) they were measured on."""

    fits: tuple[LinkFit, ...]
    key: str = ""
    measured_at: float = 0.0

    def fit_for(self, kind: str, group_size: int, groups: int = 1) -> LinkFit | None:
        """The fit for ``kind`` on ``groups`` groups of ``group_size``; else the same kind and
        group size at the nearest number of groups; else the nearest group size; else None.

        >>> LinkModel((LinkFit("all_gather", 2, 2, 0.0, 1e-9),)).fit_for("all_gather", 2).groups
        2
        """
        same = [f for f in self.fits if f.kind == kind]
        if not same:
            return None
        return min(same, key=lambda f: (abs(f.group_size - group_size),
                                        abs(f.groups - groups)))

    def has(self, kind: str, group_size: int, groups: int) -> bool:
        return any((f.kind, f.group_size, f.groups) == (kind, group_size, groups)
                   for f in self.fits)

    def merged(self, fits: Iterable[LinkFit]) -> "LinkModel":
        """This model with ``fits`` added (replacing fits of the same kind and groups)."""
        new = {(f.kind, f.group_size, f.groups): f for f in self.fits}
        new.update({(f.kind, f.group_size, f.groups): f for f in fits})
        return self._replace(fits=tuple(new[k] for k in sorted(new)))

    def rows(self) -> list[dict]:
        return [f.row() for f in self.fits]

    def to_json(self) -> dict:
        return {"key": self.key, "measured_at": self.measured_at,
                "fits": [[f.kind, f.group_size, f.groups, f.alpha_s, f.beta_s_per_byte,
                          [list(p) for p in f.points]] for f in self.fits]}

    @classmethod
    def from_json(cls, data: dict) -> "LinkModel":
        fits = tuple(LinkFit(k, int(p), int(g), float(a), float(b), tuple(tuple(x) for x in pts))
                     for k, p, g, a, b, pts in data["fits"])
        return cls(fits, data.get("key", ""), float(data.get("measured_at", 0.0)))


class StepCost(NamedTuple):
    """The predicted time of one step (or one issued collective, a ``CommRecord``)."""

    kind: str
    mesh_dim_name: str | None
    mesh_dim: int
    group_size: int
    groups: int
    bytes_per_rank: int
    wire_bytes: float
    seconds: float
    fit: LinkFit | None

    @property
    def is_collective(self) -> bool:
        return self.kind in FIT_KINDS or self.kind == "broadcast"


class Prediction(NamedTuple):
    """Predicted seconds of each step and their sum (steps run one after another)."""

    steps: tuple[StepCost, ...]
    total_s: float

    def text(self) -> str:
        """One line per step: kind, mesh dim, groups, bytes per rank, predicted time.

        >>> model = LinkModel((LinkFit("all_reduce", 2, 2, 1e-4, 1e-9),))
        >>> from dtorch import init_device_mesh, Partial, Replicate, plan_redistribute
        >>> m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> s = plan_redistribute(m, (256, 256), [Replicate(), Partial()], [Replicate()] * 2)
        >>> print(predict(s, model).text())
        all_reduce on tp: 2 groups of 2, 256.0 KiB/rank -> 362 us
        total 362 us
        """
        lines = []
        for s in self.steps:
            dim = s.mesh_dim_name if s.mesh_dim_name is not None else s.mesh_dim
            where = f"{s.groups} group{'s' if s.groups != 1 else ''} of {s.group_size}"
            lines.append(f"{s.kind} on {dim}: {where}, {fmt_bytes(s.bytes_per_rank)}/rank -> "
                         f"{fmt_seconds(s.seconds)}")
        lines.append(f"total {fmt_seconds(self.total_s)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def fit_key(step) -> tuple[str, int, int] | None:
    """``(kind, group size, groups)`` whose fit predicts ``step`` (``send_recv``: pairs, each a
    group of 2); None for a local step or a group of one.

    >>> from dtorch.comm_debug import CommRecord
    >>> fit_key(CommRecord("all_reduce", 1, "tp", ((0, 1), (2, 3)), 8))
    ('all_reduce', 2, 2)
    """
    if step.kind not in FIT_KINDS:
        return None
    groups = tuple(step.groups)
    p = 2 if step.kind == "send_recv" else max((len(g) for g in groups), default=1)
    return (step.kind, p, len(groups)) if p > 1 else None


def step_cost(step, model: LinkModel) -> StepCost:
    """Predicted cost of one planned ``Step`` or issued ``CommRecord`` (anything with
    ``kind``, ``groups``, ``bytes_per_rank``, ``mesh_dim``, ``mesh_dim_name``)."""
    groups = tuple(step.groups)
    p = max((len(g) for g in groups), default=1)
    kind = step.kind
    nbytes = int(step.bytes_per_rank)
    name = getattr(step, "mesh_dim_name", None)
    dim = getattr(step, "mesh_dim", -1)
    if kind not in FIT_KINDS and kind != "broadcast":
        return StepCost(kind, name, dim, p, len(groups), nbytes, 0.0, 0.0, None)
    wire = wire_bytes(kind, p, nbytes)
    if kind == "send_recv":  # pairs run at once: one "group" of 2 per pair
        p = 2
    n_groups = len(groups)
    fit = model.fit_for(kind if kind != "broadcast" else "all_gather", p, n_groups)
    seconds = fit.alpha_s + fit.beta_s_per_byte * wire if fit is not None else math.nan
    return StepCost(kind, name, dim, p, n_groups, nbytes, wire, seconds, fit)


def predict(steps: Iterable, model: LinkModel) -> Prediction:
    """Predicted time of each step of a plan (or each record of a ledger) and their total."""
    costs = tuple(step_cost(s, model) for s in steps)
    return Prediction(costs, float(sum(c.seconds for c in costs)))


def needed_keys(steps: Iterable) -> set[tuple[str, int, int]]:
    """``{(kind, group size, groups)}`` a prediction of ``steps`` needs fits for.

    >>> from dtorch import init_device_mesh, Shard, Replicate, plan_redistribute
    >>> m = init_device_mesh("cpu", (2, 2))
    >>> sorted(needed_keys(plan_redistribute(m, (4, 4), [Shard(0), Shard(1)], [Replicate()] * 2)))
    [('all_gather', 2, 2)]
    """
    return {key for key in map(fit_key, steps) if key is not None}


def fmt_seconds(s: float) -> str:
    """Seconds as us / ms / s.

    >>> fmt_seconds(3.2e-5), fmt_seconds(0.0123), fmt_seconds(2.5)
    ('32 us', '12.3 ms', '2.50 s')
    """
    if s != s:  # nan: not measured
        return "?"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1.0:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def fmt_bytes(n: float) -> str:
    """Bytes in B / KiB / MiB / GiB.

    >>> fmt_bytes(16), fmt_bytes(1536)
    ('16 B', '1.5 KiB')
    """
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
