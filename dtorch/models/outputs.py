"""What a model's forward returns, as Hugging Face's ``ModelOutput`` (``CausalLMOutputWithPast``):
fields by attribute or key; by index or ``to_tuple()`` the fields that are not None, in order.
Example::

    >>> out = CausalLMOutput(logits="L")
    >>> out.loss is None, out.logits, out["logits"], out[0], out.to_tuple(), list(out.keys())
    (True, 'L', 'L', 'L', ('L',), ['logits'])
    >>> CausalLMOutput(loss=1.5, logits="L")[0]
    1.5
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class CausalLMOutput:
    """``.loss`` (given ``labels``: Hugging Face's shifted next-token loss, a 0-dim DTensor;
    else None) and ``.logits`` (``[batch, seq, vocab]``, a DTensor)."""

    loss: Any = None
    logits: Any = None

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, k) for k in self.keys())

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in self.keys():
                raise KeyError(key)
            return getattr(self, key)
        return self.to_tuple()[key]
