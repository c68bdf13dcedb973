"""Static HTML/SVG pictures of meshes and shard layouts. Pure: no widgets.

(Collectives are drawn by :mod:`dtorch_widgets.comm_picture`.)

These are the ``_repr_html_`` of DeviceMesh and DTensor, so they must render anywhere static
HTML does (GitHub, nbconvert) and stay small: every picture caps what it draws and says
``(N more ... not drawn)``; no result is longer than ``svg.MAX_HTML_CHARS``. Example::

    >>> from dtorch import init_device_mesh, Shard, Replicate
    >>> m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    >>> "DeviceMesh" in mesh_html(m, highlight_dim="tp")
    True
    >>> "S(0)" in shard_html((4, 6), m, [Shard(0), Replicate()])
    True
"""

from __future__ import annotations

import itertools
from html import escape

from . import svg as S
from .colors import blend, rank_color, text_color
from .tiles import Tiling

CELL_W, CELL_H = 40, 26  # one rank in a mesh picture
EL_W, EL_H = 36, 22  # one element at most, in a shard picture
PANEL_W, PANEL_H = 420, 300  # one 2-D panel of a shard picture at most
MIN_TILE = 8  # pixels: the smallest block drawn, so tiny uneven remainders stay visible
LAYER_DX = 4  # pixels between the stacked partial values of a block
MAX_LAYERS = 4  # partial values drawn per block


# ---------------------------------------------------------------------------------------------
# mesh
# ---------------------------------------------------------------------------------------------
def dim_label(mesh, dim: int) -> str:
    """A mesh dim's name, or ``dim{i}`` when the mesh has no names.

    >>> from dtorch import init_device_mesh
    >>> dim_label(init_device_mesh("cpu", (2, 2)), 1)
    'dim1'
    """
    names = mesh.mesh_dim_names
    return names[dim] if names else f"dim{dim}"


def mesh_header(mesh) -> str:
    """One line: device type, shape, rank count and dim names.

    >>> from dtorch import init_device_mesh
    >>> mesh_header(init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp")))
    '<b>DeviceMesh</b> cpu · 2×3 = 6 ranks · dims dp × tp'
    """
    dims = " × ".join(escape(dim_label(mesh, d)) for d in range(mesh.ndim))
    n = len(mesh.ranks)
    return (f"<b>DeviceMesh</b> {escape(mesh.device_type)} · {S.fmt_shape(mesh.shape)} = {n} "
            f"rank{'s' if n != 1 else ''} · dims {dims}")


def _grid_dims(shape):
    """Split a mesh or tensor shape into (panel shape, rows, cols) for drawing."""
    if len(shape) == 1:
        return (), 1, shape[0]
    return tuple(shape[:-2]), shape[-2], shape[-1]


def mesh_html(mesh, highlight_dim=None) -> str:
    """The rank grid of ``mesh`` as static SVG; ``highlight_dim`` colours the groups along it.

    Without a highlight each cell has its rank's colour; with one, every group of
    ``mesh.groups(highlight_dim)`` gets one colour, listed in a legend. Meshes of 3 or more
    dims are drawn as a row of 2-D grids, one per index of the leading dims.

    >>> from dtorch import init_device_mesh
    >>> h = mesh_html(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), "dp")
    >>> "groups along dp" in h, "(0, 2)" in h
    (True, True)
    """
    dim = None if highlight_dim is None else mesh.dim_index(highlight_dim)
    groups = mesh.groups(dim) if dim is not None else ()
    group_of = {r: i for i, g in enumerate(groups) for r in g}
    panel_shape, nrows, ncols = _grid_dims(mesh.shape)
    panels = list(itertools.product(*(range(n) for n in panel_shape)))
    cols = min(ncols, 32)
    rows = min(nrows, max(1, S.MAX_MESH_CELLS // cols))
    npan = min(len(panels), S.MAX_PANELS, max(1, S.MAX_MESH_CELLS // (rows * cols)))
    pictures = [_mesh_panel(mesh, p, rows, cols, group_of) for p in panels[:npan]]
    drawn = npan * rows * cols
    parts = [mesh_header(mesh), S.row_of(*pictures), S.not_drawn(len(mesh.ranks) - drawn, "ranks")]
    if dim is not None:
        parts.append(_groups_legend(mesh, dim, groups))
    fallback = S.box(mesh_header(mesh), S.note("(mesh too large to draw)"))
    return S.cap_html(S.box(*parts), fallback)


def _mesh_panel(mesh, panel, rows, cols, group_of) -> str:
    """One 2-D grid of a mesh picture (all of a 1-D or 2-D mesh)."""
    nd = mesh.ndim
    left = 34 if nd > 1 else 4
    top = 44 if panel else 32
    body = []
    if panel:
        caption = ", ".join(f"{dim_label(mesh, d)}={i}" for d, i in enumerate(panel))
        body.append(S.text(left, 11, caption, anchor="start", extra='font-weight="bold"'))
    body.append(S.text(left + cols * CELL_W / 2, top - 18,
                       f"{dim_label(mesh, nd - 1)} →", size=10, fill="#555"))
    for c in range(cols):
        body.append(S.text(left + (c + 0.5) * CELL_W, top - 3, c, size=9, fill="#777"))
    if nd > 1:
        mid = top + rows * CELL_H / 2
        body.append(S.text(10, mid, f"← {dim_label(mesh, nd - 2)}", size=10, fill="#555",
                           extra=f'transform="rotate(-90 10 {S._n(mid)})"'))
        for r in range(rows):
            body.append(S.text(left - 4, top + (r + 0.5) * CELL_H + 3, r, size=9,
                               anchor="end", fill="#777"))
    for r in range(rows):
        for c in range(cols):
            coord = panel + ((r, c) if nd > 1 else (c,))
            rank = mesh.rank_at(coord)
            fill = rank_color(group_of[rank]) if group_of else rank_color(rank)
            where = ", ".join(f"{dim_label(mesh, d)}={i}" for d, i in enumerate(coord))
            x, y = left + c * CELL_W, top + r * CELL_H
            body.append(f"<g><title>rank {rank} · {escape(where)}</title>"
                        + S.rect(x, y, CELL_W, CELL_H, fill, stroke="#fff")
                        + S.text(x + CELL_W / 2, y + CELL_H / 2 + 4, rank, fill=_txt(fill))
                        + "</g>")
    return S.svg(left + cols * CELL_W + 2, top + rows * CELL_H + 2, "".join(body))


def _txt(fill):
    """Text colour on ``fill``, or None (the default, black) when black reads best."""
    c = text_color(fill)
    return None if c == "#000000" else c


def _groups_legend(mesh, dim, groups) -> str:
    """Colour chips naming the rank groups along ``dim`` (capped)."""
    shown = groups[:S.MAX_TABLE_ROWS]
    chips = "".join(S.chip(rank_color(i), str(g)) for i, g in enumerate(shown))
    return (f'<div style="font-size:11px">{len(groups)} groups along '
            f"{escape(dim_label(mesh, dim))}: {chips}</div>"
            + S.not_drawn(len(groups) - len(shown), "groups"))


# ---------------------------------------------------------------------------------------------
# shard layout
# ---------------------------------------------------------------------------------------------
def shard_html(shape, mesh, placements, values=None, highlight_rank=None, title=None) -> str:
    """The global tensor as blocks coloured by the rank(s) that hold them.

    A block held by one rank has that rank's colour; a block several ranks share (Replicate)
    has a light tint of the first owner's colour and a band of all their colours on top; a
    Partial block is drawn as a stack of its partial values, one layer per partial rank.
    Block sizes are drawn to scale (with a minimum size), so uneven shards show. ``values``
    (``{rank: local tensor}``) adds per-rank values: written into the cells when the tensor
    is small, summarized in the table.
    1-D tensors are one row, 3-D tensors a row of 2-D slices along dim 0.

    >>> from dtorch import init_device_mesh, Shard
    >>> h = shard_html((5,), init_device_mesh("cpu", 2), [Shard(0)])
    >>> "uneven" in h, "r1" in h
    (True, True)
    """
    return tiling_html(Tiling(shape, mesh, placements), values, highlight_rank, title)


def placements_text(placements) -> str:
    """``[S(0), R]``-style text of a placement list."""
    return "[" + ", ".join(str(p) for p in placements) + "]"


def shard_header(t: Tiling, title=None) -> str:
    """One line: shape, mesh, placements, and whether shards are uneven."""
    mesh = t.mesh
    dims = "×".join(escape(dim_label(mesh, d)) for d in range(mesh.ndim))
    uneven = ' · <span style="color:#a33">uneven shards</span>' if t.uneven else ""
    return (f"<b>{escape(title or 'DTensor')}</b> shape {S.fmt_shape(t.shape)} · mesh "
            f"{S.fmt_shape(mesh.shape)} ({dims}) · placements "
            f"{escape(placements_text(t.placements))}{uneven}")


def tiling_html(t: Tiling, values=None, highlight_rank=None, title=None) -> str:
    """``shard_html`` for an already computed :class:`Tiling` (what ShardView uses)."""
    header = shard_header(t, title)
    nd = len(t.shape)
    if nd > 3:
        body = S.note(f"{nd}-D tensors are not drawn (1-D to 3-D are); see the table below")
    elif not t.owners:
        body = S.note("empty tensor: no elements to draw")
    else:
        body = _tiles_drawing(t, values, highlight_rank)
    parts = [header, body, _shard_legend(t), rank_table(t, values)]
    fallback = S.box(header, S.note("(layout too large to draw)"))
    return S.cap_html(S.box(*parts), fallback)


def _axis(intervals, extent, max_px, cell_px):
    """Pixel (start, size) per interval and pixels per element, for one drawing axis."""
    ppe = min(cell_px, max_px / max(extent, 1))
    out, x = [], 0
    for a, b in intervals:
        size = max(MIN_TILE, round((b - a) * ppe))
        out.append((x, size))
        x += size
    return out, ppe


def _pairs(cuts):
    return list(zip(cuts[:-1], cuts[1:]))


def _panel_plan(t: Tiling):
    """(panel intervals, row dim, col dim) for a 0-D to 3-D tensor; dims None mean size 1."""
    nd = len(t.shape)
    if nd <= 2:
        return [None], (0 if nd == 2 else None), (nd - 1 if nd else None)
    if t.shape[0] <= S.MAX_PANELS:
        return [(i, i + 1) for i in range(t.shape[0])], 1, 2
    return _pairs(t.cuts[0]), 1, 2


def _tiles_drawing(t: Tiling, values, highlight_rank) -> str:
    """The panels of a shard picture plus the ``not drawn`` line."""
    panels, rdim, cdim = _panel_plan(t)
    rint = _pairs(t.cuts[rdim]) if rdim is not None else [(0, 1)]
    cint = _pairs(t.cuts[cdim]) if cdim is not None else [(0, 1)]
    cols = min(len(cint), 24)
    rows = min(len(rint), 24, max(1, S.MAX_TILES // cols))
    npan = min(len(panels), S.MAX_PANELS, max(1, S.MAX_TILES // (rows * cols)))
    rext = t.shape[rdim] if rdim is not None else 1
    cext = t.shape[cdim] if cdim is not None else 1
    shrink = 0.6 if npan > 1 else 1.0  # several slices side by side: smaller each
    rpix, rppe = _axis(rint[:rows], rext, PANEL_H * shrink, EL_H)
    cpix, cppe = _axis(cint[:cols], cext, PANEL_W * shrink, EL_W)
    per_index = panels[0] is None or all(b - a == 1 for a, b in panels)
    n_elem = npan * min(rext, rint[rows - 1][1]) * min(cext, cint[cols - 1][1])
    show_values = (values is not None and per_index and cppe >= 28 and rppe >= 16
                   and n_elem <= S.MAX_VALUE_CELLS)
    geom = dict(rint=rint[:rows], cint=cint[:cols], rpix=rpix, cpix=cpix, rppe=rppe, cppe=cppe,
                rdim=rdim, cdim=cdim)
    pictures = [_shard_panel(t, p, geom, values if show_values else None, highlight_rank)
                for p in panels[:npan]]
    missing = len(panels) * len(rint) * len(cint) - npan * rows * cols
    return S.row_of(*pictures) + S.not_drawn(missing, "blocks")


def _index(t: Tiling, panel, i, j) -> tuple:
    """Global element index of row ``i``, col ``j`` of ``panel``."""
    nd = len(t.shape)
    if nd == 0:
        return ()
    if nd == 1:
        return (j,)
    if nd == 2:
        return (i, j)
    return (panel[0], i, j)


def _tile_for(t: Tiling, panel, r, c):
    """The tile drawn at panel ``panel``, row interval ``r``, col interval ``c``."""
    return t.tile_of(_index(t, panel, r[0], c[0])) if t.shape else ()


def _layer_fill(ranks) -> str:
    """Solid rank colour for a sole owner; a light tint of the first owner's when shared."""
    return rank_color(ranks[0]) if len(ranks) == 1 else blend([rank_color(ranks[0])], 0.55)


def _owner_label(layers) -> str:
    """``r3``, ``r0,1`` (shared) or ``r0+r2`` (partial) for a block's owners."""
    def one(ranks):
        if len(ranks) > 4:
            return f"r{ranks[0]}…{ranks[-1]}"
        return "r" + ",".join(str(r) for r in ranks)
    if len(layers) > 2:
        return f"{one(layers[0])}+…({len(layers)})"
    return "+".join(one(layer) for layer in layers)


def _shard_panel(t: Tiling, panel, g, values, highlight_rank) -> str:
    """One 2-D panel of blocks (and values) of a shard picture.

    Partial stacks are drawn depth by depth (all back layers first) so that the layers of
    one block never cover the front of its neighbour.
    """
    depth = min(max(len(v) for v in t.layers.values()), MAX_LAYERS)
    pad = LAYER_DX * (depth - 1)
    left, top = 26 if g["rdim"] is not None else 4, 16 + pad + (14 if panel else 0)
    body = []
    if panel:
        a, b = panel
        cap = f"[{a}]" if b - a == 1 else f"[{a}:{b}]"
        body.append(S.text(left, 11, cap, anchor="start", extra='font-weight="bold"'))
    # boundary labels: the element index where each drawn block starts
    for (a, _), (x, _) in zip(g["cint"], g["cpix"]):
        body.append(S.text(left + x + 2, top - pad - 4, a, size=9, anchor="start", fill="#777"))
    if g["rdim"] is not None:
        for (a, _), (y, _) in zip(g["rint"], g["rpix"]):
            body.append(S.text(left - 3, top + y + 10, a, size=9, anchor="end", fill="#777"))
    cells = [(_tile_for(t, panel, r, c), r, c, left + x, top + y, w, h)
             for r, (y, h) in zip(g["rint"], g["rpix"]) for c, (x, w) in zip(g["cint"], g["cpix"])]
    for j in reversed(range(1, depth)):
        for tile, r, c, x, y, w, h in cells:
            layers = t.layers[tile]
            if len(layers) > j:
                fade = _fade(t, tile, highlight_rank)
                body.append(f"<g{fade}>" + _layer_svg(layers[j], x + j * LAYER_DX,
                                                      y - j * LAYER_DX, w, h) + "</g>")
    for tile, r, c, x, y, w, h in cells:
        body.append(_tile_svg(t, tile, r, c, x, y, w, h, g, panel, values, highlight_rank))
    width = left + sum(w for _, w in g["cpix"]) + pad + 2
    height = top + sum(h for _, h in g["rpix"]) + 2
    return S.svg(width, height, "".join(body))


def _fade(t: Tiling, tile, highlight_rank) -> str:
    """The opacity attribute of a block the highlighted rank does not hold."""
    if highlight_rank is None or highlight_rank in t.owners[tile]:
        return ""
    return ' opacity="0.2"'


def _layer_svg(ranks, x, y, w, h) -> str:
    """One layer of a block: a rectangle, plus a band of colours when ranks share it."""
    out = S.rect(x, y, w, h, _layer_fill(ranks))
    return out + (_shared_band(ranks, x, y, w, h) if len(ranks) > 1 else "")


def _tile_svg(t, tile, r, c, x, y, w, h, g, panel, values, highlight_rank) -> str:
    """The front of a block: tooltip, front layer, grid lines, and a label or values."""
    layers = t.layers[tile]
    owners = t.owners[tile]
    where = ", ".join(f"{a}:{b}" for a, b in tile) or "scalar"
    tip = f"[{where}] held by rank{'s' if len(owners) > 1 else ''} " + ", ".join(map(str, owners))
    if len(layers) > 1:
        tip += f" ({len(layers)} partial values)"
    out = [f"<g{_fade(t, tile, highlight_rank)}><title>{escape(tip)}</title>",
           _layer_svg(layers[0], x, y, w, h)]
    front = _layer_fill(layers[0])
    out.append(_grid_lines(r, c, x, y, w, h, g))
    if values is not None:
        out.append(_values_svg(t, tile, r, c, x, y, w, h, panel, values, _txt(front), g))
    elif w >= 22 and h >= 14:
        label = _owner_label(layers)
        label = label if len(label) * 6.5 <= w else label[:max(1, int(w / 6.5) - 1)] + "…"
        two_lines = h >= 32 and w >= 30
        out.append(S.text(x + w / 2, y + 17 if two_lines else y + h / 2 + 4, label,
                          fill=_txt(front)))
        if two_lines:
            shp = S.fmt_shape(tuple(b - a for a, b in tile))
            out.append(S.text(x + w / 2, y + 29, shp, size=9, fill=_txt(front)))
    out.append("</g>")
    return "".join(out)


def _shared_band(ranks, x, y, w, h) -> str:
    """A band of the owners' colours along the top of a shared block (at most 8 drawn)."""
    shown = ranks[:8]
    bh = max(2, min(5, h / 4))
    step = w / len(shown)
    return "".join(S.rect(x + i * step, y, step, bh, rank_color(r), stroke="none")
                   for i, r in enumerate(shown))


def _grid_lines(r, c, x, y, w, h, g) -> str:
    """Thin lines between elements when elements are at least MIN_TILE pixels."""
    d = []
    if g["cdim"] is not None and g["cppe"] >= MIN_TILE and c[1] - c[0] > 1:
        step = w / (c[1] - c[0])
        d += [f"M{S._n(x + k * step)} {S._n(y)}v{S._n(h)}" for k in range(1, c[1] - c[0])]
    if g["rdim"] is not None and g["rppe"] >= MIN_TILE and r[1] - r[0] > 1:
        step = h / (r[1] - r[0])
        d += [f"M{S._n(x)} {S._n(y + k * step)}h{S._n(w)}" for k in range(1, r[1] - r[0])]
    if not d:
        return ""
    return f'<path d="{"".join(d)}" stroke="#000" stroke-opacity="0.2" fill="none"/>'


def _values_svg(t, tile, r, c, x, y, w, h, panel, values, color, g) -> str:
    """Element values written into a block's cells (partial values joined by ``+``)."""
    layers = t.layers[tile]
    sep = "+" if all(t.placements[d].reduce_op == "sum" for d in t.partial_dims) else "|"
    cw, ch = w / (c[1] - c[0]), h / (r[1] - r[0])
    out = []
    for i in range(r[0], r[1]):
        for j in range(c[0], c[1]):
            index = _index(t, panel, i, j)
            parts = [_local_value(t, values, layer[0], index) for layer in layers[:2]]
            s = sep.join(parts) + (sep + "…" if len(layers) > 2 else "")
            out.append(S.text(x + (j - c[0] + 0.5) * cw, y + (i - r[0] + 0.5) * ch + 4, s,
                              size=10 if len(s) <= 6 else 8, fill=color))
    return "".join(out)


def _local_value(t: Tiling, values, rank, index) -> str:
    """Element ``index`` (global) as stored by ``rank``, formatted; ``?`` if not available."""
    local = values.get(rank)
    if local is None:
        return "?"
    off = t.blocks[rank].offset
    try:
        return S.fmt_value(local[tuple(i - o for i, o in zip(index, off))])
    except Exception:  # a local tensor of an unexpected shape: show that, do not fail
        return "?"


def _shard_legend(t: Tiling) -> str:
    """Rank colour chips and one line per placement kind present."""
    ranks = t.mesh.ranks
    chips = "".join(S.chip(rank_color(r), f"r{r}") for r in ranks[:S.MAX_TABLE_ROWS])
    lines = [f'<div style="font-size:11px;margin-top:2px">{chips}</div>',
             S.not_drawn(len(ranks) - min(len(ranks), S.MAX_TABLE_ROWS), "ranks")]
    for d in t.replicate_dims:
        lines.append(S.note(f"Replicate on {dim_label(t.mesh, d)}: blocks are shared by the "
                            f"ranks of each {dim_label(t.mesh, d)} group (band of their colours)"))
    for d in t.partial_dims:
        n = t.mesh.shape[d]
        lines.append(S.note(f"Partial({t.placements[d].reduce_op}) on {dim_label(t.mesh, d)}: "
                            f"each block is a stack of {n} partial values that reduce "
                            f"({t.placements[d].reduce_op}) to the value"))
    if t.uneven:
        lines.append(S.note("uneven shards: ranks hold blocks of different shapes", "#a33"))
    if t.empty_ranks:
        lines.append(S.note("empty blocks on ranks " + ", ".join(map(str, t.empty_ranks))))
    return "".join(lines)


def rank_table(t: Tiling, values=None) -> str:
    """Rows ``rank · mesh coordinate · local shape · offset`` (+ first values), capped."""
    ranks = t.mesh.ranks
    rows = []
    for r in ranks[:S.MAX_TABLE_ROWS]:
        b = t.blocks[r]
        row = [S.chip(rank_color(r), f"r{r}"), escape(str(t.mesh.get_coordinate(r))),
               escape(str(b.shape)), escape(str(b.offset))]
        if values is not None:
            row.append(escape(_value_summary(values.get(r))))
        rows.append(row)
    header = ["rank", "mesh coord", "local shape", "offset"]
    if values is not None:
        header.append("local values")
    return S.table(header, rows, total_rows=len(ranks))


def _value_summary(local) -> str:
    """The first 8 values of a local tensor: ``[1, 2, 3, …]``."""
    if local is None:
        return "(not given)"
    try:
        flat = local.reshape(-1)
        n = flat.shape[0]
        head = [S.fmt_value(v) for v in flat[:8].tolist()]
    except Exception:
        return str(local)[:80]
    return "[" + ", ".join(head) + (", …" if n > 8 else "") + "]"


def dtensor_html(dtensor) -> str:
    """``_repr_html_`` of a DTensor-like object (``shape``, ``device_mesh``, ``placements``).

    Metadata only: it never fetches values. Never raises: a failure is shown as a note.

    >>> from types import SimpleNamespace
    >>> from dtorch import init_device_mesh, Shard
    >>> x = SimpleNamespace(shape=(4,), device_mesh=init_device_mesh("cpu", 2),
    ...                     placements=(Shard(0),), dtype="torch.float32")
    >>> "DTensor" in dtensor_html(x) and "float32" in dtensor_html(x)
    True
    """
    try:
        dtype = getattr(dtensor, "dtype", None)
        title = "DTensor" + (f" {str(dtype).replace('torch.', '')}" if dtype is not None else "")
        return shard_html(tuple(dtensor.shape), dtensor.device_mesh, dtensor.placements,
                          title=title)
    except Exception as e:  # a repr must not raise
        return S.box(S.note(f"DTensor (could not draw: {type(e).__name__}: {e})", "#a33"))
