"""Shared by the widget tests: a duck-typed DTensor, an SVG check, the widget MIME type."""

import re
import xml.etree.ElementTree as ET

from dtorch.layout import shard_of

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def svgs_parse(html: str) -> int:
    """Every <svg> in ``html`` is well-formed XML; returns how many there are."""
    found = re.findall(r"<svg.*?</svg>", html, re.S)
    for s in found:
        ET.fromstring(s)
    return len(found)


class FakeDTensor:
    """A stand-in with the attributes ShardView.of and dtensor_html read (the real DTensor
    lives elsewhere); ``to_local`` slices a full tensor the way dtorch's layout math says."""

    def __init__(self, full, mesh, placements):
        self.full = full
        self.shape = full.shape
        self.dtype = full.dtype
        self.device_mesh = mesh
        self.placements = tuple(placements)
        self.fetched = []

    def to_local(self, rank):
        self.fetched.append(rank)
        return shard_of(self.full, self.device_mesh, self.placements,
                        self.device_mesh.get_coordinate(rank))

