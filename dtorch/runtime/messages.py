"""Controller -> worker instructions: one small NamedTuple each.

A flush sends each rank the instructions it runs (``batches.py``): each instruction names
the ranks that execute it (``ranks``; None for every rank). Example::

    >>> Free(tids=(3, 4), ranks=(0, 1))
    Free(tids=(3, 4), ranks=(0, 1))
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Tid(int):
    """An id the controller made (a tensor, a graph node, a request): an int whose place in a
    batch is a slot, so a run of instructions that repeats with fresh ids pickles to the same
    bytes and can be replayed (``intern.py``, ``replay.py``).

    >>> Tid(5) == 5, hash(Tid(5)) == hash(5)
    (True, True)
    """

    __slots__ = ()


class Ref(NamedTuple):
    """A placeholder in op arguments for the local shard of tensor ``tid``."""

    tid: int


class Coord(NamedTuple):
    """A placeholder in op arguments for this rank's coordinate in ``mesh`` (per-rank args:
    a kernel that needs to know which block it holds takes a ``Coord`` argument)."""

    mesh: Any


class SetupMesh(NamedTuple):
    """Every rank creates the process groups of these rank tuples, in this order."""

    groups: tuple[tuple[int, ...], ...]
    backend: str


class Seed(NamedTuple):
    """Every rank reseeds its random generator (``dtorch.manual_seed``)."""

    seed: int


class Create(NamedTuple):
    """A factory: ``fn`` in zeros/ones/full/empty/arange/rand/randn/randint/...; random ones
    run on every rank so generators stay in step, members keep their block."""

    tid: int
    fn: str
    args: tuple
    kwargs: dict
    shape: tuple[int, ...]
    dtype: Any
    mesh: Any
    placements: tuple
    ranks: tuple[int, ...]
    all_ranks: bool


class Load(NamedTuple):
    """Take this rank's shard of ``tid`` from the data staged with this batch."""

    tid: int
    ranks: tuple[int, ...]


class Redistribute(NamedTuple):
    """Apply the planned ``steps`` to ``src``'s shards, store the result as ``out``."""

    out: int
    src: int
    shape: tuple[int, ...]
    dtype: Any
    mesh: Any
    dst_mesh: Any
    steps: tuple
    ranks: tuple[int, ...]


class StartReduce(NamedTuple):
    """Start the one planned all_reduce ``step`` of ``src``'s shards and go on without waiting
    (DDP's overlap: the instructions issued before ``FinishReduce`` run while it moves data);
    ``out`` holds the reduction in flight."""

    out: int
    src: int
    shape: tuple[int, ...]
    dtype: Any
    mesh: Any
    step: Any
    ranks: tuple[int, ...]


class FinishReduce(NamedTuple):
    """Wait for the reduction a ``StartReduce`` keeps in ``tid``; store its result there."""

    tid: int
    ranks: tuple[int, ...]


class Call(NamedTuple):
    """Run ``fn(*args, **kwargs)`` on local shards (``Ref`` placeholders), store outputs."""

    outs: tuple[int, ...]
    fn: Any
    args: tuple
    kwargs: dict
    ranks: tuple[int, ...]


class Checkpoint(NamedTuple):
    """Every rank of the world saves or loads (``action``: "save", "save_async", "load") the
    ``entries`` (``checkpoint.entries.Entry``) it holds with torch.distributed.checkpoint,
    then answers ``req`` (rank 0: the loaded values that live on the controller). A save
    writes ``staging`` and renames it to ``path`` when complete; ``lists``: ``(path,
    length)`` of the state dict's lists."""

    req: int
    action: str
    path: str
    staging: str | None
    entries: tuple
    lists: tuple
    ranks: tuple[int, ...]


class Fetch(NamedTuple):
    """Send the local shard of ``tid`` back under request id ``req``."""

    req: int
    tid: int
    ranks: tuple[int, ...]


class Sync(NamedTuple):
    """Answer request ``req`` with the errors raised since the last Sync."""

    req: int


class MeasureLinks(NamedTuple):
    """Every rank times ``kind`` on ``groups`` (a mesh dim's groups, all at once; for
    ``send_recv`` ``(source, destination)`` pairs) at each of ``sizes`` bytes per rank,
    ``repeats`` times, each after a barrier; answers ``req`` with ``{size: [seconds]}`` (empty
    on a rank in no group). Its collectives stay out of the ledgers (``link_timing.py``)."""

    req: int
    kind: str
    groups: tuple
    sizes: tuple[int, ...]
    repeats: int


class Free(NamedTuple):
    """Drop the local shards of these tensors (held by ``ranks``; None: ask every rank)."""

    tids: tuple[int, ...]
    ranks: tuple[int, ...] | None = None


class Eager(NamedTuple):
    """Run ``fn`` on local shards and keep its whole result as ``out``; ``answer_rank``
    answers ``req`` with its structure (ops whose outputs depend on the values). With
    ``node``, recorded as a ``RecordedCall`` is: the inputs ``grad_tids`` as leaves, the
    result's tensor leaves (in pytree order) the graph's outputs, kept under ``node``."""

    req: int
    out: int
    fn: Any
    args: tuple
    kwargs: dict
    ranks: tuple[int, ...]
    answer_rank: int
    node: int | None = None
    grad_tids: tuple[int, ...] = ()


class Unflatten(NamedTuple):
    """Replace the kept result ``src`` by its tensor leaves, stored as ``outs``."""

    src: int
    outs: tuple[int, ...]
    ranks: tuple[int, ...]


# composite ops: a small plan of local calls and collective steps (see dtorch.ops.composite) --
class Slot(NamedTuple):
    """A placeholder in a composite's step arguments for the temporary in slot ``index``."""

    index: int


class PerRank(NamedTuple):
    """A placeholder for a per-rank constant: ``table[rank]`` (``table`` is a tuple of
    ``(rank, value)`` pairs, so the plan stays hashable)."""

    table: tuple


class Local(NamedTuple):
    """Run ``fn(*args, **kwargs)`` on this rank (``Slot``/``PerRank``/``Coord`` resolved);
    its tensors go to the slots ``outs``."""

    fn: Any
    args: tuple
    kwargs: dict
    outs: tuple[int, ...]


class Exchange(NamedTuple):
    """all_to_all along mesh dim ``mesh_dim``: split slot ``src`` along ``split_dim``, send
    piece j to the group member at coordinate j, concatenate what arrives along ``cat_dim``
    (in coordinate order) into slot ``out``. ``table`` maps each rank to ``(in_shape,
    send_sizes, recv_shapes, pad_shape)``: what it sends, what it receives and the padded
    piece every member of its group uses."""

    src: int
    out: int
    split_dim: int
    cat_dim: int
    table: tuple
    mesh_dim: int
    mesh_dim_name: str | None
    groups: tuple
    bytes_per_rank: int
    kind: str = "all_to_all"


class Shift(NamedTuple):
    """send_recv along mesh dim ``mesh_dim``: each rank sends slots ``srcs`` to its next
    coordinate and receives ``outs`` from its previous one (posted now, finished by
    ``Wait``). ``table`` maps each rank to ``(send_to, recv_from, send_shapes,
    recv_shapes)``; a one-byte poison flag travels with the data."""

    srcs: tuple[int, ...]
    outs: tuple[int, ...]
    table: tuple
    mesh_dim: int
    mesh_dim_name: str | None
    groups: tuple
    bytes_per_rank: int
    kind: str = "send_recv"


class Wait(NamedTuple):
    """Finish the ``Shift`` that writes slots ``outs`` (compute in between overlaps it)."""

    outs: tuple[int, ...]


class Drop(NamedTuple):
    """Forget the temporaries in ``slots`` (memory comes back as soon as possible)."""

    slots: tuple[int, ...]


class CompositePlan(NamedTuple):
    """A composite op, planned on the controller and interpreted by every rank in ``ranks``
    of a ``Call`` whose ``fn`` is this plan: inputs go to slots ``0..n_inputs-1``, ``steps``
    run in order, slots ``outputs`` are stored as the call's outputs. ``dtype`` is what the
    collectives carry (a poisoned rank sends zeros of it); ``watch`` names slots whose peak
    bytes the rank reports (``rank_stats()["composite_peak_bytes"]``)."""

    name: str
    n_inputs: int
    steps: tuple
    outputs: tuple[int, ...]
    dtype: Any
    watch: tuple[int, ...] = ()

    @property
    def collectives(self) -> tuple:
        """The collective steps, in order (what both ledgers count)."""
        return tuple(s for s in self.steps if type(s) in (Exchange, Shift))


# autograd: a recorded op keeps its local graph; backward runs it (see dtorch.autograd) -------
class RecordedCall(NamedTuple):
    """A ``Call`` whose inputs ``grad_tids`` require grad: run ``fn`` with autograd on
    (those inputs as detached leaves that require grad), store the outputs detached and keep
    the local graph under ``node`` until a ``Backward`` without retain or a ``Free`` of
    ``node``. ``inplace`` is the mutated input's tid (the op runs on a clone of it, which is
    then copied back, so the version counter sees the mutation), or None."""

    node: int
    outs: tuple[int, ...]
    fn: Any
    args: tuple
    kwargs: dict
    ranks: tuple[int, ...]
    grad_tids: tuple[int, ...]
    inplace: int | None = None


class Backward(NamedTuple):
    """Run ``torch.autograd.grad`` on the local graph of ``node``: ``grads`` pairs an output
    index with the tid of its incoming gradient (scaled by ``out_scales[i]`` when not None:
    the 1/n of a Partial('avg') output); the gradient of leaf j (``grad_tids`` order) is
    stored as ``outs[j]``, scaled by ``in_scales[j]`` when not None. Without ``retain`` the
    graph is dropped after."""

    node: int
    grads: tuple[tuple[int, int], ...]
    outs: tuple[int, ...]
    out_scales: tuple
    in_scales: tuple
    retain: bool
    ranks: tuple[int, ...]
