"""PlacementExplorer: pick a source and a target placement per mesh dim and see the plan.

An anywidget whose state is traitlets, so it can be driven and read from Python (and tested
without a browser); the browser draws the two layouts side by side, the plan's steps with
their groups, bytes per rank and predicted time, and animates each step's transfers from
the ``frames`` data (see :mod:`dtorch_widgets.explorer_model`). Its "run it" button (or
:meth:`PlacementExplorer.run`) performs the redistribute on the live cluster and fills
``measured``. Example::

    >>> from dtorch import init_device_mesh, Shard
    >>> from dtorch.cost import LinkFit, LinkModel
    >>> links = LinkModel((LinkFit("all_gather", 4, 1, 1e-4, 1e-9),))
    >>> e = PlacementExplorer((4, 4), init_device_mesh("cpu", 4), [Shard(0)], ["R"], links=links)
    >>> [(s["kind"], s["groups"], s["bytes_per_rank"]) for s in e.steps]
    [('all_gather', [[0, 1, 2, 3]], 16)]
    >>> e.dst = ["S(1)"]                      # what the dst picker does
    >>> [s["kind"] for s in e.steps], e.error
    (['all_to_all'], '')
    >>> e.dst = ["S(2)"]
    >>> e.error.startswith("Shard(2) is out of range"), e.steps
    (True, [])
"""

from __future__ import annotations

import functools
import math
from html import escape
from pathlib import Path

import anywidget
import torch
import traitlets as T

from dtorch.errors import DTorchError, PlacementValueError
from dtorch.placement import Placement

from . import explorer_model as X
from .colors import rank_color
from .html import shard_html

HERE = Path(__file__).resolve().parent
NO_PREDICTION = ("no prediction: pass links=, or start a cluster (any DTensor op; not a dry run) "
                 "to predict from its measured links")


def view_module(name: str) -> str:
    """A view's ES module: the helpers both explorers share, then ``name``'s own code."""
    return (HERE / "explorer_common.js").read_text() + "\n" + (HERE / name).read_text()


def placement_texts(values) -> list[str]:
    """Picker values from placements or their text: ``[Shard(0), "R"]`` -> ``["S(0)", "R"]``.

    >>> from dtorch import Shard
    >>> placement_texts([Shard(0), " R"])
    ['S(0)', 'R']
    """
    if isinstance(values, (Placement, str)):
        values = [values]
    out = []
    for v in values:
        if not isinstance(v, (Placement, str)):
            raise T.TraitError(f"placements are Shard(d) / Replicate() / Partial(op) or their "
                               f"text ('S(0)', 'R', 'P(sum)'); got {v!r}")
        out.append(str(v) if isinstance(v, Placement) else v.strip())
    return out


def predictor(links):
    """How the explorers predict: ``steps -> dtorch.cost.Prediction`` from ``links`` (a
    ``dtorch.cost.LinkModel``) when given, else from the running cluster's fitted links
    (``dtorch.predict``, measured on first use; None where they cannot be measured, as on a
    dry-run cluster); None when neither is there (no cluster runs). Never starts a cluster.

    >>> from dtorch import init_device_mesh, Shard, Replicate, plan_redistribute
    >>> from dtorch.cost import LinkFit, LinkModel
    >>> steps = plan_redistribute(init_device_mesh("cpu", 4), (4, 4), [Shard(0)], [Replicate()])
    >>> predict = predictor(LinkModel((LinkFit("all_gather", 4, 1, 1e-3, 0.0),)))
    >>> predict(steps).total_s
    0.001
    """
    if links is not None:
        from dtorch.cost import predict
        return functools.partial(predict, model=links)
    import dtorch
    from dtorch.runtime import session
    if not session.is_running():
        return None

    def on_the_cluster(steps):
        try:
            return dtorch.predict(steps)
        except DTorchError:  # a dry-run cluster, a lost worker: no prediction, not an error
            return None
    return on_the_cluster


class PlacementExplorer(anywidget.AnyWidget):
    """``PlacementExplorer(shape, mesh, src=None, dst=None, dtype=torch.float32, links=None)``:
    ``src``/``dst`` are one placement per mesh dim (objects or text; default all Replicate),
    ``links`` a ``dtorch.cost.LinkModel`` (default: the cluster's fitted links)."""

    _esm = view_module("placement_explorer.js")
    _css = (HERE / "explorer.css").read_text()

    shape = T.List(T.Int()).tag(sync=True)
    dtype = T.Unicode("float32").tag(sync=True)
    mesh_shape = T.List(T.Int()).tag(sync=True)
    mesh_grid = T.List().tag(sync=True)
    ranks = T.List(T.Int()).tag(sync=True)
    dim_names = T.List(T.Unicode()).tag(sync=True)
    choices = T.List(T.Unicode()).tag(sync=True)
    colors = T.List(T.Unicode()).tag(sync=True)
    src = T.List().tag(sync=True)
    dst = T.List().tag(sync=True)
    layouts = T.Dict().tag(sync=True)
    steps = T.List(T.Dict()).tag(sync=True)
    frames = T.List(T.List(T.Dict())).tag(sync=True)
    step_index = T.Int(0).tag(sync=True)
    predicted_s = T.Float(None, allow_none=True).tag(sync=True)
    prediction_note = T.Unicode("").tag(sync=True)
    measured = T.Dict().tag(sync=True)
    running = T.Bool(False).tag(sync=True)
    error = T.Unicode("").tag(sync=True)

    def __init__(self, shape, mesh, src=None, dst=None, dtype: torch.dtype = torch.float32,
                 links=None, **kwargs):
        self.mesh, self.torch_dtype, self.links = mesh, dtype, links
        replicate = ["R"] * mesh.ndim
        super().__init__(
            shape=[int(n) for n in shape], dtype=str(dtype).replace("torch.", ""),
            mesh_shape=list(mesh.shape), mesh_grid=mesh.mesh_list, ranks=list(mesh.ranks),
            dim_names=[mesh.mesh_dim_names[d] if mesh.mesh_dim_names else f"dim{d}"
                       for d in range(mesh.ndim)],
            choices=X.placement_choices(len(shape)),
            colors=[rank_color(i) for i in range(len(mesh.ranks))],
            src=placement_texts(replicate if src is None else src),
            dst=placement_texts(replicate if dst is None else dst), **kwargs)
        self.observe(self._replan, names=["src", "dst"])
        self.on_msg(self._on_message)
        self._replan()

    @T.validate("src", "dst")
    def _placements(self, proposal):
        return placement_texts(proposal["value"])

    # the plan --------------------------------------------------------------------------------
    def _replan(self, change=None) -> None:
        """Plan again from ``src``/``dst``; a placement that does not fit becomes ``error``
        (never an exception: this runs from the pickers)."""
        self.measured = {}
        try:
            e = X.explore(self.shape, self.mesh, self.src, self.dst, self.torch_dtype,
                          self._predict)
        except PlacementValueError as err:
            self._show_error(str(err))
            return
        with self.hold_sync():
            self.layouts = {"src": X.layout_rows(e.src_layout),
                            "dst": X.layout_rows(e.dst_layout)}
            self.steps = [X.step_row(s) for s in e.steps]
            self.frames = [X.frame_rows(s.frames) for s in e.steps]
            self.step_index = 0
            self.predicted_s = e.predicted_s
            self.error = ""

    def _show_error(self, text: str) -> None:
        with self.hold_sync():
            self.layouts = {side: self._layout_or_empty(getattr(self, side))
                            for side in ("src", "dst")}
            self.steps, self.frames, self.step_index = [], [], 0
            self.predicted_s = None
            self.error = text

    def _layout_or_empty(self, placements) -> list:
        try:
            parsed = X.parse_placements(placements, self.mesh, len(self.shape))
        except PlacementValueError:
            return []
        return X.layout_rows(X.layouts(tuple(self.shape), self.mesh, parsed))

    def _predict(self, steps):
        """The cost model's prediction of ``steps``, or None (``prediction_note`` says so)."""
        predict = predictor(self.links)
        p = None if predict is None else predict(steps)
        self.prediction_note = "" if p is not None else NO_PREDICTION
        return p

    # running it ------------------------------------------------------------------------------
    def run(self) -> dict:
        """Redistribute a tensor with these placements on the live cluster, check its value
        against torch's and fill ``measured``: ``seconds`` (the redistribute and the wait for
        it), ``comm_s`` and ``by_kind`` (time inside collectives on the ranks, where dtorch
        measures it), ``counts``, ``predicted_s`` and ``matches_torch``."""
        if self.error:
            raise PlacementValueError(f"fix the placements first: {self.error}")
        import dtorch
        self.running = True
        try:
            full = _sample(tuple(self.shape), self.torch_dtype)
            src = X.parse_placements(self.src, self.mesh, len(self.shape))
            dst = X.parse_placements(self.dst, self.mesh, len(self.shape))
            x = dtorch.distribute_tensor(full, self.mesh, list(src))
            dtorch.synchronize()
            y, timing = timed(lambda: x.redistribute(self.mesh, list(dst)))
            same = bool(torch.equal(y.to_torch(), full))
            self.measured = {**timing, "predicted_s": self.predicted_s, "matches_torch": same}
        finally:
            self.running = False
        return self.measured

    def _on_message(self, widget, content, buffers) -> None:
        if isinstance(content, dict) and content.get("type") == "run":
            try:
                self.run()
            except Exception as err:  # noqa: BLE001 - shown in the widget, not lost in a log
                self.measured = {"error": f"{type(err).__name__}: {err}"}

    # display ---------------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs):
        data, metadata = super()._repr_mimebundle_(**kwargs)
        data["text/html"] = self.static_html()
        return data, metadata

    def static_html(self) -> str:
        """Both layouts and the plan as static HTML (what a saved notebook shows without
        widgets)."""
        if self.error:
            return f"<pre>{escape(self.error)}</pre>"
        src = X.parse_placements(self.src, self.mesh, len(self.shape))
        dst = X.parse_placements(self.dst, self.mesh, len(self.shape))
        from dtorch.cost import fmt_bytes
        lines = [f"{i + 1}. {s['kind']} on {s['mesh_dim_name'] or s['mesh_dim']}: groups "
                 f"{s['groups']}, {fmt_bytes(s['bytes_per_rank'])}/rank"
                 for i, s in enumerate(self.steps)] or ["no step: nothing moves"]
        return ("<div>" + shard_html(self.shape, self.mesh, src, title="source") +
                shard_html(self.shape, self.mesh, dst, title="target") +
                "<pre>" + escape("\n".join(lines)) + "</pre></div>")


def _sample(shape, dtype) -> torch.Tensor:
    """A tensor whose values every placement keeps exactly (small integers)."""
    return (torch.arange(math.prod(shape)) % 97).reshape(shape).to(dtype)


def timed(fn) -> tuple:
    """``(value, {"seconds", "counts", "comm_s", "by_kind"})`` of ``fn()`` and the wait for its
    work (``dtorch.time_comms``: wall time, and the time inside collectives on the ranks)."""
    import dtorch
    t = dtorch.time_comms(fn)
    return t.value, {"seconds": t.wall_s, "comm_s": t.comm_s, "by_kind": dict(t.by_kind),
                     "counts": dict(t.counts)}
