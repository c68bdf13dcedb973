"""Small SVG/HTML building blocks and the size caps every drawing obeys.

Static HTML only: inline attributes, no ``<script>``, no ``<style>`` and no ids, so the output
renders the same in JupyterLab, VS Code, nbconvert and GitHub, and two pictures on one page
cannot clash. Example::

    >>> rect(0, 0, 10, 5, "#1f77b4")
    '<rect x="0" y="0" width="10" height="5" fill="#1f77b4" stroke="#333"/>'
    >>> text(5, 3, "r<0>", fill="#fff")
    '<text x="5" y="3" fill="#fff">r&lt;0&gt;</text>'
"""

from __future__ import annotations

from html import escape

MAX_HTML_CHARS = 100_000  # no repr is ever longer than this
MAX_MESH_CELLS = 256  # ranks drawn in a mesh picture
MAX_TILES = 192  # blocks drawn in a shard picture (all panels together)
MAX_PANELS = 8  # 2-D slices drawn for a 3-D tensor
MAX_VALUE_CELLS = 400  # element values written into a shard picture
MAX_TABLE_ROWS = 32  # rows of any table
MAX_TIMELINE = 200  # collectives drawn in a timeline
FONT = "font-family:sans-serif;font-size:12px;line-height:1.35"


def _n(v: float) -> str:
    """A coordinate, short: ints stay ints, floats get one decimal."""
    return str(int(v)) if float(v).is_integer() else f"{v:.1f}"


def rect(x, y, w, h, fill, stroke="#333", extra="") -> str:
    """An SVG rectangle (``extra`` is appended raw inside the tag)."""
    return (f'<rect x="{_n(x)}" y="{_n(y)}" width="{_n(w)}" height="{_n(h)}" fill="{fill}" '
            f'stroke="{stroke}"{" " + extra if extra else ""}/>')


def text(x, y, s, size=None, anchor=None, fill=None, extra="") -> str:
    """An SVG text, escaped; size, anchor and fill default to the ``svg()`` root's (11px,
    centred, black)."""
    attrs = "".join(f' {k}="{v}"' for k, v in (("font-size", size), ("text-anchor", anchor),
                                               ("fill", fill)) if v is not None)
    return (f'<text x="{_n(x)}" y="{_n(y)}"{attrs}{" " + extra if extra else ""}>'
            f"{escape(str(s))}</text>")


def svg(width, height, body: str) -> str:
    """An ``<svg>`` element of the given pixel size around ``body``.

    >>> svg(4, 2, "")[:40]
    '<svg xmlns="http://www.w3.org/2000/svg" '
    """
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_n(width)}" height="{_n(height)}" '
            f'viewBox="0 0 {_n(width)} {_n(height)}" font-family="sans-serif" font-size="11" '
            f'text-anchor="middle">{body}</svg>')


def box(*parts: str) -> str:
    """The outer ``<div>`` every repr is wrapped in."""
    return f'<div class="dtorch-repr" style="{FONT}">' + "".join(parts) + "</div>"


def row_of(*items: str) -> str:
    """Pictures side by side, wrapping onto new lines when the page is narrow."""
    return ('<div style="display:flex;flex-wrap:wrap;gap:12px;align-items:flex-end">'
            + "".join(items) + "</div>")


def note(s: str, color="#555") -> str:
    """A line of small explanatory text (escaped)."""
    return f'<div style="color:{color};font-size:11px">{escape(s)}</div>'


def not_drawn(n: int, what: str) -> str:
    """The ``(N more ... not drawn)`` line, or nothing when ``n`` is 0.

    >>> not_drawn(3, "ranks")
    '<div style="color:#a33;font-size:11px">(3 more ranks not drawn)</div>'
    """
    return note(f"({n} more {what} not drawn)", "#a33") if n > 0 else ""


def table(header, rows, total_rows=None) -> str:
    """A small HTML table; ``rows`` are lists of already-escaped cell HTML.

    >>> table(["a"], [["1"]])
    '<table style="border-collapse:collapse;font-size:11px;margin-top:4px"><tr><th style="text-align:left;padding:1px 8px 1px 0;border-bottom:1px solid #999">a</th></tr><tr><td style="padding:1px 8px 1px 0">1</td></tr></table>'
    """
    th = "".join(f'<th style="text-align:left;padding:1px 8px 1px 0;'
                 f'border-bottom:1px solid #999">{escape(h)}</th>' for h in header)
    body = "".join("<tr>" + "".join(f'<td style="padding:1px 8px 1px 0">{c}</td>' for c in r)
                   + "</tr>" for r in rows)
    extra = ""
    if total_rows is not None and total_rows > len(rows):
        extra = not_drawn(total_rows - len(rows), "rows")
    return (f'<table style="border-collapse:collapse;font-size:11px;margin-top:4px">'
            f"<tr>{th}</tr>{body}</table>{extra}")


def chip(color: str, label: str) -> str:
    """A coloured square followed by a label: one legend entry.

    >>> chip("#1f77b4", "r0")
    '<span style="white-space:nowrap;margin-right:6px"><span style="color:#1f77b4">■</span> r0</span>'
    """
    return (f'<span style="white-space:nowrap;margin-right:6px">'
            f'<span style="color:{color}">■</span> {escape(label)}</span>')


def cap_html(html: str, fallback: str) -> str:
    """``html`` when it is at most MAX_HTML_CHARS long, else ``fallback`` (a short summary).

    >>> cap_html("x" * 10, "short") == "x" * 10, cap_html("x" * 200_000, "short")
    (True, 'short')
    """
    return html if len(html) <= MAX_HTML_CHARS else fallback


def fmt_value(v) -> str:
    """A tensor element, in at most about 6 characters.

    >>> fmt_value(3), fmt_value(0.123456), fmt_value(True), fmt_value(12345678.0)
    ('3', '0.123', 'T', '1.23e+07')
    """
    v = v.item() if hasattr(v, "item") else v
    if isinstance(v, bool):
        return "T" if v else "F"
    if isinstance(v, int):
        s = str(v)
        return s if len(s) <= 6 else f"{v:.2e}"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)[:6]


def fmt_bytes(n: int) -> str:
    """Bytes in B / KiB / MiB / GiB.

    >>> fmt_bytes(512), fmt_bytes(1536), fmt_bytes(3 * 2**30)
    ('512 B', '1.5 KiB', '3.0 GiB')
    """
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def fmt_shape(shape) -> str:
    """``(4, 3)`` as ``4×3``; a 0-D shape as ``scalar``.

    >>> fmt_shape((4, 3)), fmt_shape(())
    ('4×3', 'scalar')
    """
    return "×".join(str(n) for n in shape) if len(shape) else "scalar"
