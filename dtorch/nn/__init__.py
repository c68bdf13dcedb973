"""dtorch.nn: modules mirroring torch.nn, with DTensor parameters (seed 003).

>>> import dtorch.nn as nn
>>> issubclass(nn.Linear, nn.Module) and issubclass(nn.Module, __import__("torch").nn.Module)
True
"""

from . import functional  # noqa: F401  (dtorch.nn.functional.<name> on DTensors)
from . import init  # noqa: F401
from . import utils  # noqa: F401  (clip_grad_norm_, clip_grad_value_)
from .modules import *  # noqa: F401,F403
from .modules import __all__ as _modules_all
from .state_dict import full_state_dict, load_value

__all__ = [*_modules_all, "full_state_dict", "load_value", "functional", "init", "utils"]
