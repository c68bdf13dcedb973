"""The rank side of dtorch's optimizers: torch's own functional steps on local shards.

Each runs under ``torch.no_grad()`` and updates the parameters and state tensors it is given in
place, as torch.optim does; SGD returns the momentum buffers it had to create (torch makes a
buffer from the first gradient). Example::

    >>> p, g = torch.ones(3), torch.full((3,), 2.0)
    >>> sgd_step([p], [g], [None], weight_decay=0.0, momentum=0.9, lr=0.1, dampening=0.0,
    ...          nesterov=False, maximize=False, foreach=None)[0]
    tensor([2., 2., 2.])
    >>> p
    tensor([0.8000, 0.8000, 0.8000])
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam
from torch.optim.sgd import sgd


def sgd_step(params, grads, buffers, **hyper) -> tuple:
    """torch's ``sgd``; the momentum buffers it created (where ``buffers`` had None)."""
    buffers = list(buffers)
    missing = [b is None for b in buffers]
    with torch.no_grad():
        sgd(params, grads, buffers, **hyper)
    return tuple(b for b, new in zip(buffers, missing) if new)


def adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, **hyper) -> None:
    """torch's ``adam`` (AdamW: ``decoupled_weight_decay=True``)."""
    with torch.no_grad():
        adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, **hyper)


def sgd_step_plain(params, grads, buffers, **hyper) -> None:
    """torch's ``sgd`` without momentum (no buffers)."""
    with torch.no_grad():
        sgd(params, grads, list(buffers), **hyper)
