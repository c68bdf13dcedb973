"""Colours: one per rank (or per group, per collective kind) from matplotlib's ``tab20``.

The ten dark ``tab20`` colours come first (they are ``tab10``), then the ten light ones, so a
rank has the same colour in every view and on every mesh. Example::

    >>> rank_color(0), rank_color(1), rank_color(20)
    ('#1f77b4', '#ff7f0e', '#1f77b4')
    >>> text_color('#1f77b4'), text_color('#ffffff')
    ('#ffffff', '#000000')
"""

from __future__ import annotations

from functools import lru_cache

from matplotlib import colormaps
from matplotlib.colors import to_hex, to_rgb


@lru_cache(maxsize=1)
def palette() -> tuple[str, ...]:
    """The 20 colours in use order: ``tab20``'s dark half, then its light half.

    >>> len(palette()), palette()[10]
    (20, '#aec7e8')
    """
    colors = colormaps["tab20"].colors
    order = list(range(0, 20, 2)) + list(range(1, 20, 2))
    return tuple(to_hex(colors[i]) for i in order)


def rank_color(index: int) -> str:
    """Colour of rank (or group, or kind) number ``index``; cycles after 20.

    >>> rank_color(3)
    '#d62728'
    """
    return palette()[index % 20]


def text_color(fill: str) -> str:
    """Black or white, whichever reads better on ``fill``.

    >>> text_color('#ff7f0e')
    '#000000'
    """
    r, g, b = to_rgb(fill)
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "#ffffff"


def blend(fills, toward_white: float = 0.5) -> str:
    """The mean of several colours, lightened: the body colour of a block several ranks share.

    >>> blend(['#000000', '#ffffff'], 0.0)
    '#808080'
    """
    rgbs = [to_rgb(f) for f in fills]
    mean = [sum(c[i] for c in rgbs) / len(rgbs) for i in range(3)]
    return to_hex([m + (1 - m) * toward_white for m in mean])
