"""Metadata queries answered on the controller (nothing is sent): ``is_floating_point``,
``is_complex``, ``element_size``, ``nelement``, ``is_contiguous``, ``is_signed``, ...

They return plain Python values computed from the global shape and dtype. Example::

    >>> import torch
    >>> from dtorch.ops.registry import lookup
    >>> lookup(torch.Tensor.is_floating_point).family
    'metadata'
"""

from __future__ import annotations

from .registry import rule


@rule("is_floating_point", "is_complex", "is_signed", "element_size", "nelement",
      "is_contiguous", "is_nonzero_size", "is_same_size", "get_device", "is_inference",
      "is_conj", "is_neg", family="metadata")
def metadata_rule(op):
    raise AssertionError("metadata ops return values, not tensors")  # never reached
