"""dtorch.optim: torch.optim's SGD, Adam and AdamW on DTensor parameters (see
:mod:`dtorch.optim.optimizer`). They are ``torch.optim.Optimizer`` subclasses, so
``torch.optim.lr_scheduler`` works on them unchanged.

>>> from dtorch.optim import AdamW
>>> import torch
>>> issubclass(AdamW, torch.optim.AdamW)
True
"""

from .adam import Adam, AdamW
from .optimizer import full_state_dict
from .sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "full_state_dict"]
