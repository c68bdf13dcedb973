"""Batched matrix functions (``torch.linalg.*`` and their ``torch`` spellings) run on each rank's
block of batch matrices: a ``Shard`` on a leading (batch) dim stays a ``Shard``, nothing moves.

Each function is a row of data: the trailing *matrix* dims of each tensor parameter, in the
function's parameter order (:mod:`dtorch.ops.bind`); any other tensor parameter (``atol``,
``rtol``) is batch-shaped. The matrix dims are mixed (label ``None``); the batch dims broadcast
like torch's, right-aligned, and every output that starts with the batch shape keeps it
(``qr``'s Q and R, ``svd``'s U S V, ``slogdet``'s sign and logabsdet each get the batch
labels). An output that does not depend on the batch (``lstsq``'s empty residuals) is the same
empty tensor on every rank: Replicate. Operands that share batch dims (``solve``'s A and B) are
sharded alike, a Replicate one narrowed. On a 2-D matrix (no batch dim) every Shard raises
:class:`dtorch.PlacementError`. Example::

    >>> import torch
    >>> operand_labels([(4, 3, 3), (4, 3)], (2, 1))
    ([('b0', None, None), ('b0', None)], (4,))
    >>> output_labels([(4, 3), (0,)], (4,))
    [('b0', None), 'empty']
"""

from __future__ import annotations

import math

import torch

from ..placement import Replicate
from .bind import bind, params, value
from .generic import picklable
from .local_dims import Operand, local_decision
from .registry import OpCall, TArg, rule

LEGAL = ("a batched matrix function mixes its matrix (trailing) dims: Shard a leading batch "
         "dim, the other operands Replicate or Shard on the same batch dim")
VEC = "vec"  # a right-hand side that is a vector when torch says so (linalg.solve's B)
EMPTY = "empty"

# names resolve in torch, torch.Tensor and F; callables are themselves
MATRIX = [
    (("inverse", torch.linalg.inv, torch.linalg.inv_ex, "det", torch.linalg.det, "logdet",
      "slogdet", torch.linalg.slogdet, "matrix_exp", torch.linalg.matrix_exp, "cholesky",
      torch.linalg.cholesky, torch.linalg.cholesky_ex, "cholesky_inverse", "qr",
      torch.linalg.qr, "svd", torch.linalg.svd, torch.linalg.svdvals, torch.linalg.eig,
      torch.linalg.eigh, torch.linalg.eigvals, torch.linalg.eigvalsh, "pinverse",
      torch.linalg.pinv, "matrix_power", torch.linalg.matrix_power, torch.linalg.cond,
      torch.linalg.matrix_rank, "geqrf", "lu", torch.linalg.lu, torch.linalg.lu_factor,
      torch.linalg.lu_factor_ex, torch.linalg.ldl_factor, torch.linalg.ldl_factor_ex), (2,)),
    ((torch.linalg.solve, torch.linalg.solve_ex, torch.linalg.lstsq), (2, VEC)),
    (("cholesky_solve", "triangular_solve", torch.linalg.solve_triangular), (2, 2)),
    (("lu_unpack", torch.linalg.householder_product, "orgqr"), (2, 1)),
    (("lu_solve",), (2, 2, 1)),  # torch.lu_solve(B, LU, pivots)
    ((torch.linalg.lu_solve, torch.linalg.ldl_solve, "ormqr"), (2, 1, 2)),
]


def operand_labels(shapes, cores):
    """Labels per operand (its batch dims right-aligned to ``b0..``, its ``core`` trailing
    dims None) and the broadcast batch shape."""
    batches = [tuple(s[:len(s) - c]) for s, c in zip(shapes, cores)]
    batch = tuple(torch.broadcast_shapes(*batches)) if batches else ()
    nb = len(batch)
    labels = [tuple(f"b{nb - len(b) + i}" for i in range(len(b))) + (None,) * c
              for b, c in zip(batches, cores)]
    return labels, batch


def output_labels(shapes, batch):
    """Per output: the batch labels then None when it starts with the batch shape, ``EMPTY``
    when it is empty and batch-free, else all None."""
    nb, out = len(batch), []
    for s in shapes:
        if len(s) >= nb and tuple(s[:nb]) == batch:
            out.append(tuple(f"b{i}" for i in range(nb)) + (None,) * (len(s) - nb))
        else:
            out.append(EMPTY if math.prod(s) == 0 else (None,) * len(s))
    return out


def decide(op, operands, outs, legal=LEGAL, **call):
    """:func:`local_decision`, with ``EMPTY`` outputs Replicate (see module doc)."""
    call.setdefault("fn", picklable(op.func))  # torch.lu is a local function: sent by name
    keep = [i for i, o in enumerate(outs) if o != EMPTY]
    if len(keep) == len(outs):
        return local_decision(op, operands, outs, legal, **call)
    out = op.out._replace(shapes=tuple(op.out.shapes[i] for i in keep),
                          dtypes=tuple(op.out.dtypes[i] for i in keep))
    sub = OpCall(op.entry, op.func, op.args, op.kwargs, op.tensors, op.mesh, out)
    d = local_decision(sub, operands, [outs[i] for i in keep], legal, **call)
    placements = [(Replicate(),) * op.mesh.ndim] * len(outs)
    for i, p in zip(keep, d.placements):
        placements[i] = p
    return d._replace(placements=tuple(placements))


def tensor_params(op):
    """``[(name, where, TArg)]`` of the call's DTensor arguments."""
    return [(n, w, v) for n, (w, v) in bind(op).items() if type(v) is TArg]


def _core(name, t, first, names, cores):
    i = names.index(name) if name in names else len(cores)
    core = cores[i] if i < len(cores) else 0
    if core == VEC:  # torch's linalg_solve_is_vector_rhs
        vector = t.ndim == 1 or (t.ndim == first.ndim - 1 and t.shape == first.shape[:-1])
        core = 1 if vector else 2
    return core


def matrix_rule(cores):
    """The rule of one :data:`MATRIX` row."""
    def rule_(op):
        ts = tensor_params(op)
        names = params(op.func)
        first = ts[0][2]
        cs = [_core(n, t, first, names, cores) for n, _, t in ts]
        labels, batch = operand_labels([t.shape for _, _, t in ts], cs)
        operands = [Operand(w, t, lab) for (_, w, t), lab in zip(ts, labels)]
        return decide(op, operands, output_labels(op.out.shapes, batch))
    return rule_


for _funcs, _cores in MATRIX:
    rule(*_funcs, family="linalg")(matrix_rule(_cores))


# ops with no meta kernel: their output shapes ------------------------------------------------
def geqrf_meta(input):
    m, n = input.shape[-2:]
    return torch.return_types.geqrf((torch.empty_like(input),
                                     input.new_empty(input.shape[:-2] + (min(m, n),))))


def _lstsq_driver(driver):
    return driver or "gelsy"  # torch's default on cpu


def lstsq_meta(A, B, rcond=None, *, driver=None):
    """Output shapes of ``torch.linalg.lstsq`` on cpu; its residuals assume full rank (the
    rule refuses the value-dependent case)."""
    driver = _lstsq_driver(driver)
    vector = B.ndim == 1 or (B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])
    Bm = B.unsqueeze(-1) if vector else B
    (m, n), k = A.shape[-2:], Bm.shape[-1]
    batch = torch.broadcast_shapes(A.shape[:-2], Bm.shape[:-2])
    real = A.real.dtype if A.is_complex() else A.dtype
    empty = A.new_empty((0,), dtype=real)
    residuals = A.new_empty(batch + (k,), dtype=real) if m > n and driver != "gelsy" else empty
    rank = A.new_empty(batch if driver != "gels" else (0,), dtype=torch.int64)
    sv = A.new_empty(batch + (min(m, n),), dtype=real) if driver in ("gelsd", "gelss") else empty
    solution = A.new_empty(batch + ((n,) if vector else (n, k)))
    return torch.return_types.linalg_lstsq((solution, residuals, rank, sv))


def lstsq_rule(op):
    b = bind(op)
    A = tensor_params(op)[0][2]
    if A.shape[-2] > A.shape[-1] and _lstsq_driver(value(b, "driver")) != "gelsy":
        op.fail(None, LEGAL + " (driver='gelsy' for tall matrices)", {},
                "lstsq's residuals are empty or not depending on each matrix's rank")
    return matrix_rule((2, VEC))(op)


rule("geqrf", family="linalg", meta=geqrf_meta)(matrix_rule((2,)))
rule(torch.linalg.lstsq, family="linalg", meta=lstsq_meta)(lstsq_rule)
