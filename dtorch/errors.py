"""Exceptions dtorch raises on the controller.

Every error a user can cause is raised before anything is sent to the workers, and its message
says what to pass instead. Example::

    >>> from dtorch import Shard
    >>> Shard("0")
    Traceback (most recent call last):
    ...
    dtorch.errors.PlacementValueError: Shard(dim) needs an int tensor dim, got '0'; pass e.g. Shard(0)
"""


class DTorchError(Exception):
    """Base class of every dtorch error."""


class MeshError(DTorchError, ValueError):
    """A DeviceMesh was built or used with values that do not describe a mesh."""


class PlacementValueError(DTorchError, ValueError):
    """A placement, or a list of placements, does not fit the tensor or the mesh."""


class PlacementError(DTorchError):
    """An op's inputs have placements for which it has no rule (no automatic redistribute)."""


class RemoteError(DTorchError):
    """An exception raised on a worker rank, carried back with its remote traceback."""


class WorkerLostError(DTorchError):
    """A worker process (rank) died or stopped answering."""


class InterpreterStuckError(DTorchError, TimeoutError):
    """A rank has been in one instruction longer than ``DTORCH_OP_TIMEOUT`` seconds."""


class ClusterError(DTorchError):
    """The cluster cannot do what was asked (wrong size, not started, shut down)."""


class FreedTensorError(DTorchError):
    """A DTensor whose shards were freed was used again."""


class UnsupportedOpError(DTorchError, NotImplementedError):
    """dtorch cannot run this op (or take this input) on DTensors; the message says what to
    do instead."""


class MixedTensorError(UnsupportedOpError, TypeError):
    """A plain torch.Tensor met DTensors where a Replicate constant would be wrong: it
    requires grad, is an in-place target or ``out=``, or is on another device type (see
    :mod:`dtorch.ops.constants`); make it a DTensor first."""
