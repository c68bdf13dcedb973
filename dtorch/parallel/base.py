"""``ParallelStyle``: what a plan entry is (PyTorch's name). A style checks a module first
(``_check``, before anything is sent), then converts it in place (``_apply``): the tensors
``_partition`` names get their placement on the plan's mesh dim, then ``_hooks`` lay out the
forward's inputs and outputs. Example::

    class Replicated(ParallelStyle):          # every tensor Replicate: the default anyway
        pass
"""

from __future__ import annotations

from ..placement import Placement
from .convert import Target, place


class ParallelStyle:
    """Base of the styles: ``_apply(module, target, conv)`` converts one module in place."""

    src_data_rank: int | None = 0  # accepted (PyTorch's keyword); values come from the module

    def _partition(self, module) -> dict[str, Placement]:
        """{tensor name: placement on the plan's dim}; tensors not named are replicated."""
        return {}

    def _check(self, module, path: str) -> None:
        """Raise before anything is sent when this style cannot convert ``module``."""

    def _apply(self, module, target: Target, conv) -> None:
        for name, on_dim in self._partition(module).items():
            if name in module._parameters or name in module._buffers:
                place(module, name, target, on_dim, conv)
        self._hooks(module, target)

    def _hooks(self, module, target: Target) -> None:
        """Register the forward hooks that lay out inputs and outputs."""
