"""Plan keys to modules: PyTorch's matching, one dotted token at a time with ``fnmatch``
(``"layers.*.self_attn.q_proj"``), ``""`` for the module itself. A key that matches nothing is
an error here (PyTorch warns and skips it), raised before anything is sent. Example::

    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    >>> [path for path, _, _ in resolve(m, {"*": "style"}) if path]
    ['0', '1', '2']
"""

from __future__ import annotations

from fnmatch import fnmatch

from ..errors import PlacementError


def _match(module, prefix: str, tokens: list[str], key: str):
    if not tokens:
        return [(prefix, module)]
    children = list(module.named_children())
    hits = [(name, child) for name, child in children if fnmatch(name, tokens[0])]
    if not hits:
        where = f"submodule {prefix!r}" if prefix else "the root module"
        raise PlacementError(
            f"parallelize plan key {key!r} matches no module: {where} "
            f"({type(module).__name__}) has no child matching {tokens[0]!r} (its children: "
            f"{[n for n, _ in children]}). Fix: use a name from model.named_modules(), with * "
            f"for any one name")
    out = []
    for name, child in hits:
        out += _match(child, f"{prefix}.{name}" if prefix else name, tokens[1:], key)
    return out


def resolve(root, plan) -> list[tuple[str, object, object]]:
    """``[(path, module, style)]`` in plan order; a bare style applies to ``root``."""
    if not isinstance(plan, dict):
        return [("", root, plan)]
    out = []
    for key, style in plan.items():
        if not isinstance(key, str):
            raise PlacementError(f"parallelize plan keys are module names (str); got {key!r}")
        tokens = key.split(".") if key else []
        out += [(path, module, style) for path, module in _match(root, "", tokens, key)]
    return out
