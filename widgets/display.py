"""Rich display glue: the mime bundles DeviceMesh and DTensor return to IPython.

A bundle always has ``text/html`` (static, renders on GitHub and in nbconvert output) and,
inside a Jupyter kernel, the widget view too, which frontends with ipywidgets show instead.
``text/plain`` is left to IPython (the object's own ``repr``). Example::

    >>> from dtorch import init_device_mesh
    >>> sorted(mesh_mimebundle(init_device_mesh("cpu", 2)))   # no kernel here: HTML only
    ['text/html']
"""

from __future__ import annotations

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def in_kernel() -> bool:
    """True when running inside a Jupyter (ipykernel) kernel, where widgets can be shown.

    >>> in_kernel()
    False
    """
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def bundle(html: str, make_widget=None, include=None, exclude=None) -> dict:
    """``{"text/html": html}`` plus the widget view of ``make_widget()`` inside a kernel,
    filtered by IPython's ``include``/``exclude`` mime-type sets.

    >>> bundle("<b>x</b>", exclude={"text/html"})
    {}
    """
    data = {"text/html": html}
    wanted = ((include is None or WIDGET_MIME in include)
              and not (exclude and WIDGET_MIME in exclude))
    if make_widget is not None and wanted and in_kernel():
        try:
            view = make_widget()._repr_mimebundle_().get(WIDGET_MIME)
        except Exception:  # no comm support in this kernel: the HTML still shows
            view = None
        if view is not None:
            data[WIDGET_MIME] = view
    return {k: v for k, v in data.items()
            if (include is None or k in include) and not (exclude and k in exclude)}


def mesh_mimebundle(mesh, include=None, exclude=None) -> dict:
    """``DeviceMesh._repr_mimebundle_``: static grid, plus a MeshView in a kernel."""
    from .html import mesh_html
    from .mesh_view import MeshView
    return bundle(mesh_html(mesh), lambda: MeshView(mesh), include, exclude)


def dtensor_mimebundle(dtensor, include=None, exclude=None) -> dict:
    """``DTensor._repr_mimebundle_``: static layout, plus a ShardView in a kernel. Never
    fetches values."""
    from .html import dtensor_html
    from .shard_view import ShardView
    return bundle(dtensor_html(dtensor), lambda: ShardView.of(dtensor), include, exclude)


def comm_mimebundle(records, title=None, include=None, exclude=None) -> dict:
    """Bundle for a cell's or block's collectives: static table, plus a CommView in a kernel.

    >>> from dtorch.comm_debug import CommRecord
    >>> "text/html" in comm_mimebundle([CommRecord("all_gather", 0, None, ((0, 1),), 8)])
    True
    """
    from .comm_view import CommView
    from .comm_picture import comm_html
    return bundle(comm_html(records, title), lambda: CommView(records, title), include, exclude)


def type_name(x) -> str:
    """The type of ``x`` as an error message names it: ``tuple``, ``torch.Tensor``.

    >>> type_name((4, 4)), type_name(1.5)
    ('tuple', 'float')
    """
    mod = type(x).__module__.split(".")[0]
    return type(x).__qualname__ if mod == "builtins" else f"{mod}.{type(x).__qualname__}"


class StaticFallback:
    """Mixin for the views: their mime bundle carries their static picture as ``text/html``
    too, so a saved notebook still shows it where widgets do not render (GitHub, nbconvert).
    By default the picture is the view's ``picture`` HTML widget; a view may override
    ``static_html()`` and ``html``."""

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        data["text/html"] = self.static_html()
        return data

    def static_html(self) -> str:
        """The picture as static HTML (also put in the widget's mime bundle)."""
        return self.picture.value

    @property
    def html(self) -> str:
        """The static picture currently shown."""
        return self.picture.value
