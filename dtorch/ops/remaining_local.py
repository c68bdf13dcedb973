"""The last ops that need no communication on sharded inputs, as labelers on the
:mod:`dtorch.ops.local_dims` engine (a dim the op keeps apart has a label; a mixed one None).

- ``alias_copy``: a copy, every placement kept (Partial too); ``torch.fill(x, v)`` is
  ``full_like``: Shard kept, a Partial becomes Replicate (every rank holds ``v``);
  ``Tensor.new_empty_strided`` is a factory: Replicate;
- the aten softmax kernels (``_softmax``, ``_log_softmax``, ``_safe_softmax`` and their
  ``*_backward_data``): every dim but ``dim``; ``native_layer_norm``: the leading dims;
- the pooling backward kernels (``max_pool{2,3}d_with_indices_backward``,
  ``avg_pool{2,3}d_backward``): batch and channels;
- ``stft`` / ``istft``: the batch of signals; ``segment_reduce``: every dim but ``axis``
  (``lengths``/``offsets`` share the leading ones); ``_chunk_cat``: the dims before ``dim``;
- ``_unsafe_masked_index`` / ``_unsafe_masked_index_put_accumulate``: the positions of the
  index (gather: every output dim), the dims of ``x`` past the indexed ones;
- ``torch.vander``: the rows; ``quantile`` / ``nanquantile``: every dim but ``dim``;
- ``histc`` with a given range: each rank counts its block, the counts are a
  ``Partial("sum")`` (no data moves; the range from the data would need every value).

Example::

    >>> spatial_labels(4, 2), spatial_labels(3, 2)
    (('n', 'c', None, None), ('c', None, None))
    >>> masked_index_labels((5, 6, 7), [(3, 1), (1, 4)], (3, 4))[1]
    ('o0', 'o1', 'o2')
"""

from __future__ import annotations

import functools

import torch

from ..placement import Partial, Replicate, Shard
from .batch_local import _some_block_empty, attr, empty_safe, get, register, where
from .explain import with_dim
from .generic import picklable
from .like import new_rule, ones_like_rule
from .local_dims import Operand, free_labels, local_decision
from .registry import TArg, rule

R = Replicate()
LEGAL = "S(d) on a dim the op keeps apart (alike on every operand that has it) -> S(d); R; " \
        "no Partial"


def aten(*names):
    """``torch.ops.aten.<name>`` packets and their ``.default`` overloads that exist (a call
    reaches dispatch as either)."""
    out = []
    for n in names:
        packet = getattr(torch.ops.aten, n, None)
        if packet is not None:
            out += [packet] + ([packet.default] if "default" in packet.overloads() else [])
    return out


def by_name(op):
    """The local function: an aten operator travels by name."""
    return picklable(op.func)


# copies and factories ----------------------------------------------------------------------------
@rule(*attr(torch, "alias_copy"), family="shape", arg_names=("input",))
def alias_copy_rule(op):
    return op.tensors[0].placements


@rule(*attr(torch, "fill"), family="factory", arg_names=("input", "value"))
def fill_rule(op):
    """``torch.fill(x, v)``: ``v`` everywhere, so x's values never matter (its Partial too)."""
    v = op.arg(1, "value")
    if type(v) is TArg and any(not p.is_replicate() for p in v.placements):
        m = next(i for i, p in enumerate(v.placements) if not p.is_replicate())
        op.fail(m, "input any -> input's Shards, Partial -> R; value R", {v: (R,) * op.mesh.ndim},
                "every rank fills its block with the whole value")
    return ones_like_rule(op)


rule(*attr(torch.Tensor, "new_empty_strided"), family="factory",
     arg_names=("input", "size", "stride"))(new_rule)


# softmax and layer norm kernels ------------------------------------------------------------------
def _softmax_kernel(op):
    x = get(op, "input")
    labels = free_labels(x.ndim, mixed=(get(op, "dim"),) if x.ndim else ())
    return {"input": labels}, [labels]


def _softmax_backward(op):
    g = get(op, "grad_output")
    labels = free_labels(g.ndim, mixed=(get(op, "dim"),) if g.ndim else ())
    return {"grad_output": labels, "output": labels}, [labels]


def _native_layer_norm(op):
    x, shape = get(op, "input"), get(op, "normalized_shape")
    k = 1 if isinstance(shape, int) else len(shape)
    lead = free_labels(x.ndim - k)
    none = (None,) * k
    return ({"input": lead + none, "weight": none, "bias": none},
            [lead + none, lead + none, lead + none])


SOFTMAX_NAMES = ("input", "dim", "half_to_float")
register(aten("_softmax", "_log_softmax"), _softmax_kernel, LEGAL, "softmax", SOFTMAX_NAMES,
         fn=by_name)
register(aten("_safe_softmax"), _softmax_kernel, LEGAL, "softmax", ("input", "dim", "dtype"),
         fn=by_name)
register(aten("_softmax_backward_data", "_log_softmax_backward_data"), _softmax_backward, LEGAL,
         "softmax", ("grad_output", "output", "dim", "input_dtype"), fn=by_name)
register(attr(torch, "native_layer_norm"), _native_layer_norm, LEGAL, "norm",
         ("input", "normalized_shape", "weight", "bias", "eps"))


# pooling backward --------------------------------------------------------------------------------
def spatial_labels(ndim: int, k: int) -> tuple:
    """Batch ``n`` and channels ``c`` free (no batch when unbatched), the last ``k`` mixed."""
    lead = ndim - k
    return ("n", "c")[2 - lead:] + (None,) * k if lead in (1, 2) else (None,) * ndim


def _pool_backward(k: int, params=("grad_output", "input", "indices")):
    def labeler(op):
        labels = spatial_labels(get(op, "input").ndim, k)
        return {p: labels for p in params}, [labels]
    return labeler


MAXPOOL_BW = ("grad_output", "input", "kernel_size", "stride", "padding", "dilation",
              "ceil_mode", "indices")
AVGPOOL_BW = ("grad_output", "input", "kernel_size", "stride", "padding", "ceil_mode",
              "count_include_pad", "divisor_override")
for _k in (2, 3):
    register(aten(f"max_pool{_k}d_with_indices_backward"), _pool_backward(_k), LEGAL, "pool",
             MAXPOOL_BW, fn=by_name)
    register(aten(f"avg_pool{_k}d_backward"), _pool_backward(_k, ("grad_output", "input")),
             LEGAL, "pool", AVGPOOL_BW, fn=by_name)


# signals and segments ----------------------------------------------------------------------------
def _stft(op):
    x = get(op, "input")
    batch = ("b",) if x.ndim == 2 else ()
    out_nd = len(op.out.shapes[0])
    labels = batch + (None,) * (x.ndim - len(batch))
    return {"input": labels, "window": (None,)}, [batch + (None,) * (out_nd - len(batch))]


def _istft(op):
    x = get(op, "input")
    batch = ("b",) if x.ndim == 3 else ()
    labels = batch + (None,) * (x.ndim - len(batch))
    return ({"input": labels, "window": (None,)},
            [batch + (None,) * (len(op.out.shapes[0]) - len(batch))])


def istft_meta(input, n_fft, hop_length=None, win_length=None, window=None, center=True,
               normalized=False, onesided=None, length=None, return_complex=False):
    """Shape inference for ``istft``: torch's checks the window's overlap-add by value,
    which meta cannot (the output length is torch's formula)."""
    hop = hop_length or n_fft // 4
    if length is None:
        length = n_fft + hop * (input.shape[-1] - 1) - (2 * (n_fft // 2) if center else 0)
    dtype = input.dtype if return_complex else input.dtype.to_real()
    return torch.empty((*input.shape[:-2], length), dtype=dtype, device="meta")


SEGMENT_NAMES = ("data", "reduce", "lengths", "indices", "offsets", "axis", "unsafe", "initial")


def segment_reduce_local(data, reduce, lengths=None, indices=None, offsets=None, axis=0,
                         unsafe=False, initial=None):
    """Rank-side ``segment_reduce``; an empty block (no row besides ``axis``) gives its empty
    result (torch checks the lengths against the rows, which an empty block lacks)."""
    if data.numel() == 0:
        seg = lengths if lengths is not None else offsets
        shape = list(data.shape)
        shape[axis % data.ndim] = seg.shape[-1] - (lengths is None)
        return data.new_zeros(shape) + data.sum()
    return torch.segment_reduce(data, reduce, lengths=lengths, indices=indices, offsets=offsets,
                                axis=axis, unsafe=unsafe, initial=initial)


def segment_reduce_rule(op):
    data = get(op, "data")
    axis = get(op, "axis", 0) % max(data.ndim, 1)
    labels = free_labels(data.ndim, mixed=(axis,))
    operands = [Operand(where(op, "data"), data, labels)]
    for name in ("lengths", "offsets", "indices"):
        t = get(op, name)
        if type(t) is TArg:
            operands.append(Operand(where(op, name), t, labels[:axis] + (None,) * (t.ndim - axis)))
    return local_decision(op, operands, [labels], LEGAL, fn=segment_reduce_local)


register(attr(torch, "stft"), _stft, LEGAL, "fft",
         ("input", "n_fft", "hop_length", "win_length", "window", "center", "pad_mode",
          "normalized", "onesided", "return_complex"))
register(attr(torch, "istft"), _istft, LEGAL, "fft",
         ("input", "n_fft", "hop_length", "win_length", "window", "center", "normalized",
          "onesided", "length", "return_complex"), meta=istft_meta)
for _f in attr(torch, "segment_reduce", "_segment_reduce"):
    rule(_f, family="reduction", arg_names=SEGMENT_NAMES)(segment_reduce_rule)


# tensor lists: _chunk_cat, masked index ----------------------------------------------------------
def decide_operands(op, operands, outs, fn, args, kwargs=None):
    """:func:`local_decision` for ``operands`` built here (tensor lists), with the empty-block
    guard of :mod:`dtorch.ops.batch_local`."""
    if _some_block_empty(operands):
        spec = (tuple((o.where, o.labels) for o in operands), tuple(outs))
        fn = functools.partial(empty_safe, fn, spec)
    return local_decision(op, operands, outs, LEGAL, fn=fn, args=args, kwargs=kwargs or {})


def chunk_cat_local(func, dim, num_chunks, *tensors):
    """Rank-side ``_chunk_cat`` with the tensors as top-level arguments (so they narrow)."""
    return func(list(tensors), dim, num_chunks)


def _list(op, pos, name):
    v = op.arg(pos, name)
    return list(v) if type(v) in (list, tuple) else []


@rule(*attr(torch, "_chunk_cat"), family="concat", arg_names=("tensors", "dim", "num_chunks"))
def chunk_cat_rule(op):
    """Each tensor is cut into ``num_chunks`` along ``dim`` (padded), the chunks flattened
    and concatenated: the dims before ``dim`` (shared by every tensor) are kept apart."""
    tensors, n = _list(op, 0, "tensors"), op.arg(2, "num_chunks")
    dim = op.arg(1, "dim")
    dim = dim % tensors[0].ndim if dim < 0 else dim
    lead = free_labels(dim)
    operands = [Operand(3 + i, t, lead + (None,) * (t.ndim - dim)) for i, t in enumerate(tensors)]
    return decide_operands(op, operands, [lead + (None, None)], chunk_cat_local,
                           (picklable(op.func), dim, n, *tensors))


def masked_index_labels(x_shape, index_shapes, mask_shape) -> tuple:
    """``(x, output, indices, mask)`` labels of ``where(mask, x[indices], fill)``: the output
    is the indices' broadcast positions ``o*`` then x's unindexed dims; x's indexed dims mix."""
    k = len(index_shapes)
    b = max((len(s) for s in index_shapes), default=0)
    width = b + len(x_shape) - k
    out = tuple(f"o{p}" for p in range(width))
    x = (None,) * k + out[b:]
    indices = [out[b - len(s):b] for s in index_shapes]
    mask = out[width - len(mask_shape):]
    return x, out, indices, mask


def masked_index_local(func, x, mask, last, *indices):
    """Rank-side ``func(x, mask, indices, last)`` (indices as top-level arguments)."""
    return func(x, mask, list(indices), last)


def _masked_operands(op, put: bool):
    """``([(where, TArg, labels)], [output labels], last)``; ``last`` is the fill or the
    values. Scattering (``put``) mixes the index positions: several may hit one element."""
    x, mask, indices = op.arg(0, "input"), op.arg(1, "mask"), _list(op, 2, "indices")
    last = op.arg(3, "values" if put else "fill")
    if any(type(i) is not TArg for i in indices):
        sharded = next(t for t in op.tensors if not all(p.is_replicate() for p in t.placements))
        op.fail(None, LEGAL, {sharded: (R,) * op.mesh.ndim},
                "an index list with None entries is only supported on Replicate inputs")
    xl, vl, il, ml = masked_index_labels(x.shape, [i.shape for i in indices], mask.shape)
    if put:
        b = len(vl) - (x.ndim - len(indices))
        def free(labs):
            return tuple(None if lab in vl[:b] else lab for lab in labs)
        il = [(None,) * i.ndim for i in indices]
        ml = free(ml)
    labels = [(1, x, xl), (2, mask, ml)]
    if type(last) is TArg:
        labels.append((3, last, free(vl[max(0, len(vl) - last.ndim):]) if put
                       else (None,) * last.ndim))
    labels += [(4 + j, t, lab) for j, (t, lab) in enumerate(zip(indices, il))]
    return labels, [xl if put else vl], last


def _masked_rule(put: bool):
    def rule_fn(op):
        labels, outs, last = _masked_operands(op, put)
        operands = [Operand(w, t, tuple(lab)) for w, t, lab in labels]
        return decide_operands(op, operands, outs, masked_index_local,
                               (picklable(op.func), op.arg(0, "input"), op.arg(1, "mask"), last,
                                *_list(op, 2, "indices")))
    return rule_fn


for _f, _put, _last in ((getattr(torch, "_unsafe_masked_index", None), False, "fill"),
                        (getattr(torch, "_unsafe_masked_index_put_accumulate", None), True,
                         "values")):
    if _f is not None:
        rule(_f, family="indexing", arg_names=("input", "mask", "indices", _last))(
            _masked_rule(_put))


# vander, quantile --------------------------------------------------------------------------------
@rule(*attr(torch, "vander"), family="linalg", arg_names=("x", "N", "increasing"))
def vander_rule(op):
    """Row i is ``x[i] ** j``: the rows are kept apart; ``N`` defaults to the global length."""
    x = op.tensors[0]
    n = op.arg(1, "N")
    kwargs = {"N": x.shape[0] if n is None else n, "increasing": op.arg(2, "increasing", False)}
    where = 0 if op.args else "x"
    operands = [Operand(where, x, ("r",))]
    args = (x,) if op.args else ()
    kw = kwargs if op.args else {**kwargs, "x": x}
    return decide_operands(op, operands, [("r", None)], picklable(op.func), args, kw)


def _quantile(op):
    x, q = get(op, "input"), get(op, "q")
    dim, keepdim = get(op, "dim"), get(op, "keepdim", False)
    if dim is None:
        labels = (None,) * x.ndim
        out = (None,) * (x.ndim if keepdim else 0)
    else:
        d = dim % max(x.ndim, 1)
        labels = free_labels(x.ndim, mixed=(d,)) if x.ndim else ()
        out = tuple(None if i == d else lab for i, lab in enumerate(labels)
                    if keepdim or i != d) if x.ndim else ()
    qs = type(q) is TArg and q.ndim == 1
    return ({"input": labels, "q": (None,) * (q.ndim if type(q) is TArg else 0)},
            [((None,) if qs else ()) + out])


register(attr(torch, "quantile", "nanquantile") + attr(torch.Tensor, "quantile", "nanquantile"),
         _quantile, LEGAL, "reduction", ("input", "q", "dim", "keepdim", "interpolation"))


# histc -------------------------------------------------------------------------------------------
HIST_LEGAL = "input S(d) with min < max given -> P(sum) (each rank counts its block); R -> R; " \
             "no Partial"


@rule(*attr(torch, "histc") + attr(torch.Tensor, "histc"), family="reduction",
      arg_names=("input", "bins", "min", "max"))
def histc_rule(op):
    x = op.tensors[0]
    lo, hi = op.arg(2, "min", 0), op.arg(3, "max", 0)
    out = []
    for m, p in enumerate(x.placements):
        if p.is_partial():
            op.fail(m, HIST_LEGAL, {x: with_dim(x.placements, m, R)},
                    "a histogram does not commute with a pending reduction")
        if isinstance(p, Shard) and lo == hi:
            op.fail(m, HIST_LEGAL, {x: with_dim(x.placements, m, R)},
                    "without min and max the bins span the data's range, which needs every "
                    "rank's values; pass min= and max= (then each rank counts its block)")
        out.append(Partial("sum") if isinstance(p, Shard) else R)
    return tuple(out)


__all__ = ["aten", "spatial_labels", "masked_index_labels", "chunk_cat_local",
           "masked_index_local", "decide_operands"]
