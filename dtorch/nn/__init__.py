"""dtorch.nn: modules mirroring torch.nn."""

from . import functional  # noqa: E402,F401  (dtorch.nn.functional.<name> on DTensors)
