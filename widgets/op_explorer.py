"""OpExplorer: which output placements a torch function's rule gives for input layouts, or
why it refuses and what each suggested fix costs. No data, no cluster needed.

An anywidget whose state is traitlets (see :mod:`dtorch_widgets.op_model` for the logic):
``placements`` holds one picker value per input per mesh dim; setting it (a picker in the
browser, or Python) runs the rule again. Example::

    >>> import torch
    >>> from dtorch import init_device_mesh, Shard, Partial
    >>> m = init_device_mesh("cpu", 4)
    >>> v = OpExplorer(torch.matmul, ((4, 8), m, [Shard(1)]), ((8, 4), m, [Shard(0)]))
    >>> v.outputs, v.error
    ([{'shape': [4, 4], 'placements': ['P(sum)']}], '')
    >>> v.placements = [["S(0)"], ["S(0)"]]          # what the pickers do
    >>> v.outputs, [f["changes"][0]["placements"] for f in v.fixes]
    ([], [['R']])
"""

from __future__ import annotations

from html import escape
from pathlib import Path

import anywidget
import traitlets as T

from dtorch.errors import DTorchError

from . import op_model as O
from .explorer_model import placement_choices
from .placement_explorer import placement_texts, predictor, view_module

HERE = Path(__file__).resolve().parent


class OpExplorer(anywidget.AnyWidget):
    """``OpExplorer(fn, *specs, kwargs=None, links=None)``: each spec a ``TensorSpec``, a
    DTensor or ``(shape, mesh, placements[, dtype])``; ``kwargs`` the call's non-tensor keyword
    arguments; ``links`` a ``dtorch.cost.LinkModel`` (default: the cluster's fitted links)."""

    _esm = view_module("op_explorer.js")
    _css = (HERE / "explorer.css").read_text()

    op = T.Unicode().tag(sync=True)
    inputs = T.List(T.Dict()).tag(sync=True)
    dim_names = T.List(T.Unicode()).tag(sync=True)
    choices = T.List(T.List(T.Unicode())).tag(sync=True)
    placements = T.List().tag(sync=True)
    outputs = T.List(T.Dict()).tag(sync=True)
    error = T.Unicode("").tag(sync=True)
    fixes = T.List(T.Dict()).tag(sync=True)

    def __init__(self, fn, *specs, kwargs: dict | None = None, links=None, **widget_kwargs):
        if not specs:
            raise TypeError(f"OpExplorer needs the inputs' layouts: {O.USAGE}")
        self.fn, self.call_kwargs, self.links = fn, dict(kwargs or {}), links
        self.specs = [O.as_spec(s) for s in specs]
        mesh = self.specs[0].mesh
        super().__init__(
            op=O.display_name(fn),
            inputs=[{"shape": list(s.shape), "dtype": str(s.dtype).replace("torch.", "")}
                    for s in self.specs],
            dim_names=[mesh.mesh_dim_names[d] if mesh.mesh_dim_names else f"dim{d}"
                       for d in range(mesh.ndim)],
            choices=[placement_choices(len(s.shape)) for s in self.specs],
            placements=[placement_texts(s.placements) for s in self.specs], **widget_kwargs)
        self.observe(self._explain, names=["placements"])
        self._explain()

    @T.validate("placements")
    def _texts(self, proposal):
        value = proposal["value"]
        if len(value) != len(self.specs):
            raise T.TraitError(f"give placements for each of the {len(self.specs)} inputs; "
                               f"got {len(value)}")
        return [placement_texts(p) for p in value]

    def _explain(self, change=None) -> None:
        """Run the rule on the pickers' placements; what does not fit becomes ``error`` and
        ``fixes`` (never an exception: this runs from the pickers)."""
        try:
            specs = [O.as_spec((s.shape, s.mesh, p, s.dtype))
                     for s, p in zip(self.specs, self.placements)]
            outcome = O.explain_op(self.fn, specs, self.call_kwargs, predictor(self.links))
        except (DTorchError, TypeError, ValueError) as err:  # a placement that does not parse
            outcome = O.OpOutcome(self.op, (), str(err), ())
        with self.hold_sync():
            self.outputs = [{"shape": list(s.shape), "placements": [str(p) for p in s.placements]}
                            for s in outcome.outputs]
            self.fixes = [fix_row(f) for f in outcome.fixes]
            self.error = outcome.error

    def _repr_mimebundle_(self, **kwargs):
        data, metadata = super()._repr_mimebundle_(**kwargs)
        data["text/html"] = self.static_html()
        return data, metadata

    def static_html(self) -> str:
        """The outputs, or the error and its fixes, as static HTML (what a saved notebook
        shows without widgets)."""
        lines = [f"{self.op} on inputs " + ", ".join("[" + ", ".join(p) + "]"
                                                     for p in self.placements)]
        lines += [f"output {tuple(o['shape'])}: [{', '.join(o['placements'])}]"
                  for o in self.outputs]
        if self.error:
            lines.append(self.error)
        return "<pre>" + escape("\n".join(lines)) + "</pre>"


def fix_row(fix: O.Fix) -> dict:
    """One fix as JSON: its redistributes (input, placements, the planner's steps), bytes per
    rank, collective kinds, predicted seconds and the op's output placements after it."""
    return {"changes": [{"input": c.index, "label": c.label,
                         "placements": [str(p) for p in c.placements],
                         "steps": [{"kind": s.kind, "mesh_dim": s.mesh_dim,
                                    "mesh_dim_name": s.mesh_dim_name,
                                    "groups": [list(g) for g in s.groups],
                                    "bytes_per_rank": s.bytes_per_rank} for s in c.steps]}
                        for c in fix.changes],
            "bytes_per_rank": fix.bytes_per_rank, "kinds": list(fix.kinds),
            "predicted_s": fix.seconds,
            "outputs": None if fix.outputs is None else [[str(p) for p in o]
                                                         for o in fix.outputs]}
