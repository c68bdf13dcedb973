"""Op placement rules: one registry, one file per op family.

``coverage()`` lists every torch callable that has a rule, with its family::

    >>> rows = coverage()
    >>> ("torch.matmul", "matmul") in rows
    True
    >>> ("F.softmax", "softmax") in rows
    True
"""

from __future__ import annotations

from . import registry
from . import (attention, binary, cast, compare, concat, elementwise, embedding,  # noqa: F401
               indexing, like, loss_parallel, losses, matmul, meta_ops, norm, reduction, shape,
               softmax)
from . import dropout  # noqa: F401 - dropout in training (registry.decomposed)
from . import mha  # noqa: F401 - F.multi_head_attention_forward on sharded inputs
from . import scalar_partials  # noqa: F401 - a 0-dim Partial compared: reduced first
from . import sharded_reductions, sharded_moments, sharded_scans  # noqa: F401 - along a sharded dim
from . import conv_pool, losses_more, nn_local  # noqa: F401 - batch-local families
from . import dim_local, index_local  # noqa: F401 - ops along a dim other than the sharded one
from . import fft_local, linalg_batched, linalg_dims, matmul_batched  # noqa: F401 - batched linalg, fft
from . import remaining_local, remaining_refusals  # noqa: F401 - the last local ops; refusals
from .dispatch import UnsupportedOpError, clear_cache
from .registry import lookup


def coverage() -> list[tuple[str, str]]:
    """``[(name, family), ...]`` sorted by family then name: ``("torch.add", "binary")``."""
    rows = {(e.name, e.family) for e in registry.entries().values()}
    return sorted(rows, key=lambda r: (r[1], r[0]))


def coverage_markdown() -> str:
    """The coverage list as a markdown table (one row per family), used by docs/ops.md."""
    by_family: dict[str, list[str]] = {}
    for name, family in coverage():
        by_family.setdefault(family, []).append(name)
    lines = ["| family | count | callables |", "| --- | --- | --- |"]
    for family, names in by_family.items():
        lines.append(f"| {family} | {len(names)} | " + ", ".join(f"`{n}`" for n in names) + " |")
    return "\n".join(lines)


_START, _END = "<!-- coverage:start -->", "<!-- coverage:end -->"


def write_coverage(path: str = "docs/ops.md") -> None:
    """Regenerate the coverage table between the markers of ``path`` (docs/ops.md)::

        .venv/bin/python -c "import dtorch.ops as o; o.write_coverage()"
    """
    with open(path) as f:
        text = f.read()
    head, _, rest = text.partition(_START)
    _, _, tail = rest.partition(_END)
    n = len(coverage())
    body = f"\n{n} torch callables have a rule.\n\n{coverage_markdown()}\n"
    with open(path, "w") as f:
        f.write(head + _START + body + _END + tail)


__all__ = ["coverage", "coverage_markdown", "write_coverage", "lookup", "clear_cache",
           "UnsupportedOpError"]
