"""Shape ops: views that move dims (``transpose permute t movedim unsqueeze squeeze expand
narrow select split chunk unbind``, basic indexing) and reshapes (``view reshape flatten
unflatten``). The shard dim is tracked; Partial and Replicate pass through.

Views: the rule follows each input dim to the output by running the op once on a ``meta``
tensor whose strides are distinct primes: a sharded dim must come out whole (same size,
stride unchanged), and its Shard moves to that output dim; a sharded dim that is indexed,
narrowed or split raises.

Reshapes: dims are grouped (``[2, 6] -> [12]``, ``[12] -> [3, 4]``); a sharded dim must be the
leading dim of its group and every rank's block must stay one contiguous block of the
same size under the output's ``torch.chunk`` layout, else "would split a sharded dim
unevenly" raises. Each rank reshapes to its own local target shape. Example::

    >>> view_groups((2, 6), (12,))
    [((0, 1), (0,))]
    >>> view_groups((4, 6), (4, 2, 3))
    [((0,), (0,)), ((1,), (1, 2))]
"""

from __future__ import annotations

import math

import torch

from ..layout import rank_block
from ..placement import Replicate, Shard
from ..runtime.messages import Coord
from .explain import with_dim
from .infer import to_meta
from .registry import Decision, TArg, rule

R = Replicate()
_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79,
           83, 89, 97, 101, 103, 107, 109, 113)
LEGAL_VIEW = ("R -> R; P -> P; S(d) -> S(d') where d' is where dim d lands, when dim d comes "
              "out whole (not indexed, narrowed, split or expanded)")
LEGAL_RESHAPE = ("R -> R; P -> P; S(d) -> S(d') when d leads its group of merged/split dims "
                 "and every rank's block stays one contiguous block under torch.chunk sizes "
                 "of the output dim")


# views -------------------------------------------------------------------------------------------
def traced_outputs(op, x: TArg):
    """The op's outputs on a meta ``x`` with prime strides (other inputs plain meta)."""
    strides = _PRIMES[:x.ndim]

    def conv(a):
        if type(a) is TArg and a.index == x.index:
            return torch.empty_strided(x.shape, strides, dtype=x.dtype, device="meta")
        if type(a) in (list, tuple):
            return type(a)(conv(v) for v in a)
        return to_meta(a)

    res = (op.entry.meta or op.func)(*conv(op.args), **{k: conv(v) for k, v in op.kwargs.items()})
    return [res] if isinstance(res, torch.Tensor) else list(res)


def dim_map(x: TArg, out) -> dict:
    """``{input dim: output dim}`` for the input dims that come out whole in ``out``.

    A dim torch inserts before a size-1 dim (``unsqueeze``, ``None``) copies its stride; the
    original is then the last of the equal candidates."""
    found = {}
    for d in range(x.ndim):
        hits = [j for j in range(out.dim()) if out.stride(j) == _PRIMES[d]
                and out.shape[j] == x.shape[d]]
        if hits:
            found[d] = hits[-1]
    return found


def view_placements(op, x: TArg, outs) -> list:
    """Output placements per output of a view op on ``x``."""
    result = []
    for out in outs:
        mapping = dim_map(x, out)
        pl = []
        for m, p in enumerate(x.placements):
            if isinstance(p, Shard):
                if p.dim not in mapping:
                    op.fail(m, LEGAL_VIEW, {x: with_dim(x.placements, m, R)},
                            f"{op.name} indexes, narrows, splits or expands dim {p.dim}, which "
                            f"is sharded")
                pl.append(Shard(mapping[p.dim]))
            else:
                pl.append(p)
        result.append(tuple(pl))
    return result


# ops that cut along a dim given as an argument: (position, keyword, default) of that dim
_CUT_DIM = {"narrow": (1, "dim", None), "select": (1, "dim", None), "split": (2, "dim", 0),
            "chunk": (2, "dim", 0), "unbind": (1, "dim", 0), "tensor_split": (2, "dim", 0),
            "split_with_sizes": (2, "dim", 0), "vsplit": (None, None, 0),
            "unsafe_split": (2, "dim", 0), "unsafe_chunk": (2, "dim", 0),
            "unsafe_split_with_sizes": (2, "dim", 0), "dsplit": (None, None, 2)}


def _cut_dim(op, x):
    short = op.name.split(".")[-1]
    if short == "hsplit":
        return 1 if x.ndim > 1 else 0
    spec = _CUT_DIM.get(short)
    if spec is None:
        return None
    d = op.arg(spec[0], spec[1], spec[2])
    return d % x.ndim if isinstance(d, int) and x.ndim else None


# index and size values given as tensors ----------------------------------------------------------
def _is_tensor(v) -> bool:
    from ..tensor import DTensor
    return isinstance(v, (torch.Tensor, DTensor))


def index_values(v, what: str):
    """An integer tensor (plain or DTensor) of index or size values -> an int (0-dim) or a
    list of ints, read on the controller (a DTensor's values are fetched: one round trip)."""
    if v.dtype.is_floating_point or v.dtype.is_complex or v.dtype is torch.bool:
        raise TypeError(f"{what} must be an integer tensor, got {v.dtype}; pass "
                        f"t.long() or a list of ints")
    if v.ndim > 1:
        raise TypeError(f"{what} must be a 0-dim or 1-D tensor, got shape {tuple(v.shape)}")
    return v.tolist()


def _tensor_split_prep(args, kwargs):
    """``tensor_split(x, t)``: ``t`` (plain or DTensor) -> its ints, which torch takes too."""
    if len(args) > 1 and _is_tensor(args[1]):
        args = (args[0], index_values(args[1], "tensor_split: indices_or_sections"), *args[2:])
    v = kwargs.pop("tensor_indices_or_sections", None)
    if v is not None:
        values = index_values(v, "tensor_split: tensor_indices_or_sections") if \
            _is_tensor(v) else v
        kwargs["sections" if isinstance(values, int) else "indices"] = values
    return args, kwargs


def _positions_prep(*where):
    """A prep turning the 0-dim tensors (plain or DTensor) at ``where`` (``(position,
    keyword)`` pairs) into ints: ``x.narrow(0, start_t, 2)``, ``x.select(0, i_t)``."""
    def prep(args, kwargs):
        args = list(args)
        for pos, name in where:
            if pos < len(args) and _is_tensor(args[pos]) and args[pos].ndim == 0:
                args[pos] = index_values(args[pos], f"{name}")
            elif name in kwargs and _is_tensor(kwargs[name]) and kwargs[name].ndim == 0:
                kwargs[name] = index_values(kwargs[name], name)
        return tuple(args), kwargs
    return prep


@rule("transpose", "swapaxes", "swapdims", "t", "permute", "movedim", "moveaxis", "unsqueeze",
      "split", "chunk", "unbind", "hsplit", "vsplit", "dsplit", "unsafe_split", "unsafe_chunk",
      "split_with_sizes", "unsafe_split_with_sizes", "diagonal", "adjoint", family="shape",
      arg_names=("input",))
def view_rule(op):
    x = op.tensors[0]
    cut = _cut_dim(op, x)
    for m, p in enumerate(x.placements):
        if isinstance(p, Shard) and p.dim == cut:
            op.fail(m, LEGAL_VIEW, {x: with_dim(x.placements, m, R)},
                    f"{op.name} cuts along dim {cut}, which is sharded")
    return view_placements(op, x, traced_outputs(op, x))


rule("tensor_split", family="shape", arg_names=("input",), prep=_tensor_split_prep)(view_rule)
rule("narrow", family="shape", arg_names=("input",),
     prep=_positions_prep((2, "start"), (3, "length")))(view_rule)
rule("select", family="shape", arg_names=("input",), prep=_positions_prep((2, "index")))(view_rule)



@rule("squeeze", family="shape", arg_names=("input", "dim"))
def squeeze_rule(op):
    """Locally, squeeze exactly the dims of global size 1 (a shard may have size 1 too)."""
    x = op.tensors[0]
    dim = op.arg(1, "dim")
    dims = range(x.ndim) if dim is None else ([dim] if isinstance(dim, int) else dim)
    dims = tuple(sorted({d % x.ndim for d in dims if x.shape[d % x.ndim] == 1})) if x.ndim else ()
    placements = view_placements(op, x, traced_outputs(op, x))[0]
    return Decision((placements,), torch.squeeze, (x, dims), {})


@rule("expand", "expand_as", "broadcast_to", family="shape", arg_names=("input", "size"))
def expand_rule(op):
    """A sharded dim keeps its local size (-1); only size-1 or new dims expand."""
    x = op.tensors[0]
    out_shape = op.out.shapes[0]
    placements = view_placements(op, x, traced_outputs(op, x))[0]
    lead = len(out_shape) - x.ndim
    sizes = list(out_shape)
    for p in x.placements:
        if isinstance(p, Shard):
            sizes[p.dim + lead] = -1
    return Decision((placements,), torch.Tensor.expand, (x, tuple(sizes)), {})


@rule("contiguous", family="shape", arg_names=("input",))
def contiguous_rule(op):
    return op.tensors[0].placements


# reshapes ----------------------------------------------------------------------------------------
def view_groups(src, dst) -> list:
    """Pair runs of input dims with runs of output dims that have the same element count
    (dims of size 1 outside a run are left out)."""
    groups = []
    i = j = 0
    while i < len(src) and j < len(dst):
        if src[i] == 1 and dst[j] != 1:
            i += 1
            continue
        if dst[j] == 1 and src[i] != 1:
            j += 1
            continue
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(i)
                pi *= src[i]
                i += 1
            else:
                gj.append(j)
                pj *= dst[j]
                j += 1
        groups.append((tuple(gi), tuple(gj)))
    return groups


def reshape_placements(op, x: TArg, out_shape) -> tuple:
    src = x.shape
    if math.prod(src) == 0:  # every shard is empty: any layout of the output holds them
        return tuple(p if p.is_partial() else R for p in x.placements)
    groups = view_groups(src, out_shape)
    out = []
    for m, p in enumerate(x.placements):
        if not isinstance(p, Shard):
            out.append(p)
            continue
        group = next((g for g in groups if p.dim in g[0]), None)
        lead_in = next((d for d in group[0] if src[d] > 1), group[0][0]) if group else None
        lead_out = next((d for d in group[1] if out_shape[d] > 1), group[1][0]) if group else None
        if group is None or lead_in != p.dim or lead_out is None:
            op.fail(m, LEGAL_RESHAPE, {x: with_dim(x.placements, m, R)},
                    f"reshaping {tuple(src)} -> {tuple(out_shape)} mixes sharded dim {p.dim} "
                    f"with the dims before it")
        out.append(Shard(lead_out))
    out = tuple(out)
    _check_blocks(op, x, out_shape, out, groups)
    return out


def _check_blocks(op, x, out_shape, out_pl, groups) -> None:
    mesh = x.mesh
    for m, p in enumerate(x.placements):
        if not isinstance(p, Shard):
            continue
        gi, gj = next(g for g in groups if p.dim in g[0])
        j = out_pl[m].dim
        inner_in = math.prod(x.shape[d] for d in gi if d > p.dim)
        inner_out = math.prod(out_shape[d] for d in gj if d > j)
        for rank in mesh.ranks:
            coord = mesh.get_coordinate(rank)
            a = rank_block(x.shape, mesh, x.placements, coord)
            b = rank_block(out_shape, mesh, out_pl, coord)
            if (a.offset[p.dim] * inner_in, a.shape[p.dim] * inner_in) != (
                    b.offset[j] * inner_out, b.shape[j] * inner_out):
                op.fail(m, LEGAL_RESHAPE, {x: with_dim(x.placements, m, R)},
                        f"reshaping {tuple(x.shape)} -> {tuple(out_shape)} would split sharded "
                        f"dim {p.dim} unevenly: rank {rank} holds elements "
                        f"[{a.offset[p.dim] * inner_in}, "
                        f"{(a.offset[p.dim] + a.shape[p.dim]) * inner_in}) of that run but "
                        f"Shard({j}) of the output gives it [{b.offset[j] * inner_out}, "
                        f"{(b.offset[j] + b.shape[j]) * inner_out})")


def reshape_local(method, table, coord, x):
    """Local kernel: reshape (or view) to this rank's own target shape."""
    return method(x, table[coord])


def _reshape_decision(op, x, method):
    out_shape = op.out.shapes[0]
    placements = reshape_placements(op, x, out_shape)
    mesh = x.mesh
    table = {mesh.get_coordinate(r): rank_block(out_shape, mesh, placements,
                                                mesh.get_coordinate(r)).shape
             for r in mesh.ranks}
    shapes = set(table.values())
    if len(shapes) == 1:
        return Decision((placements,), method, (x, shapes.pop()), {})
    return Decision((placements,), reshape_local, (method, table, Coord(mesh), x), {})


@rule("reshape", "reshape_as", "flatten", "unflatten", "ravel", family="shape",
      arg_names=("input", "shape"))
def reshape_rule(op):
    return _reshape_decision(op, op.tensors[0], torch.Tensor.reshape)


@rule("view", "view_as", family="shape", arg_names=("input", "shape"))
def view_shape_rule(op):
    x = op.tensors[0]
    dtype = op.arg(1, "dtype")
    if isinstance(dtype, torch.dtype):  # x.view(torch.int32): reinterpret the bits
        for m, p in enumerate(x.placements):
            bad = p.is_partial() or (isinstance(p, Shard) and p.dim == x.ndim - 1
                                     and dtype.itemsize != x.dtype.itemsize)
            if bad:
                op.fail(m, "placements kept; no Partial, no Shard on the last dim when the "
                        "item size changes", {x: with_dim(x.placements, m, R)},
                        f"view as {dtype} of a {p} input")
        return x.placements
    return _reshape_decision(op, x, torch.Tensor.view)



# ops that move or copy elements along given dims: legal when those dims are not sharded -----------
def _dims_untouched(op, x, dims, what):
    for m, p in enumerate(x.placements):
        if isinstance(p, Shard) and p.dim in dims:
            op.fail(m, "R -> R; P -> P; S(d) -> S(d) when the op does not work along dim d",
                    {x: with_dim(x.placements, m, R)}, f"{op.name} {what} dim {p.dim}, which is "
                    f"sharded")
    return x.placements


def _as_dims(dims, ndim):
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(d % max(ndim, 1) for d in dims)


@rule("tril", "triu", family="shape", arg_names=("input", "diagonal"))
def tril_rule(op):
    x = op.tensors[0]
    return _dims_untouched(op, x, (x.ndim - 2, x.ndim - 1), "masks by position along")


rule("tril_", "triu_", family="shape", inplace=True, arg_names=("input",))(tril_rule)


@rule("flip", family="shape", arg_names=("input", "dims"))
def flip_rule(op):
    x = op.tensors[0]
    return _dims_untouched(op, x, _as_dims(op.arg(1, "dims"), x.ndim), "reverses")


@rule("roll", family="shape", arg_names=("input", "shifts", "dims"))
def roll_rule(op):
    """A shift that is a multiple of its dim's size (0 too) leaves that dim alone."""
    x = op.tensors[0]
    dims, shifts = op.arg(2, "dims"), op.arg(1, "shifts")
    if dims is None:
        return _dims_untouched(op, x, _as_dims(None, x.ndim), "rolls")
    dims = _as_dims(dims, x.ndim)
    shifts = (shifts,) * len(dims) if isinstance(shifts, int) else tuple(shifts)
    moved = tuple(d for d, s in zip(dims, shifts) if x.shape[d] and s % x.shape[d])
    placements = _dims_untouched(op, x, moved, "rolls")
    if len(moved) == len(dims):
        return placements
    local = tuple(s if d in moved else 0 for d, s in zip(dims, shifts))  # a block's own size
    return Decision((placements,), torch.roll, (x, local, dims), {})    # differs: shift 0


def repeat_counts(input, repeats=None, dim=None, *, output_size=None):
    """``torch.repeat_interleave`` where per-element ``repeats`` arrive as a tuple of ints
    (see :func:`_repeats_prep`): the meta function and the ranks' local kernel."""
    if isinstance(repeats, tuple):
        if output_size is None:
            output_size = sum(repeats)
        repeats = torch.tensor(repeats, dtype=torch.int64, device=input.device)
    return torch.repeat_interleave(input, repeats, dim, output_size=output_size)


def _repeats_prep(args, kwargs):
    """``repeats`` given as a tensor (plain or DTensor) -> an int, or a tuple of ints."""
    if len(args) > 1:
        args = (args[0], _repeat_values(args[1]), *args[2:])
    elif "repeats" in kwargs:
        kwargs["repeats"] = _repeat_values(kwargs["repeats"])
    return args, kwargs


def _repeat_values(v):
    if not _is_tensor(v):
        return v
    values = index_values(v, "repeat_interleave: repeats")
    return values if isinstance(values, int) else tuple(values)


@rule("repeat_interleave", family="shape", arg_names=("input", "repeats", "dim"),
      meta=repeat_counts, prep=_repeats_prep)
def repeat_interleave_rule(op):
    x = op.tensors[0]
    repeats, dim = op.arg(1, "repeats"), op.arg(2, "dim")
    if type(repeats) is TArg or repeats is None:
        op.fail(None, "int repeats, or repeats given as a tensor of ints", {},
                "repeat_interleave(repeats) alone gives a shape that depends on the values")
    dims = tuple(range(x.ndim)) if dim is None else (dim % max(x.ndim, 1),)
    placements = _dims_untouched(op, x, dims, "repeats along")
    if isinstance(repeats, tuple):
        return Decision((placements,), repeat_counts, None, None)
    return placements


@rule(torch.Tensor.repeat, family="shape", arg_names=("input", "sizes"))
def repeat_rule(op):
    x = op.tensors[0]
    sizes = op.args[1:] if len(op.args) > 2 or not isinstance(op.args[1], (tuple, list)) else \
        op.args[1]
    lead = len(sizes) - x.ndim
    tiled = tuple(d for d in range(x.ndim) if sizes[d + lead] != 1)
    placements = _dims_untouched(op, x, tiled, "tiles")
    return tuple(Shard(p.dim + lead) if isinstance(p, Shard) else p for p in placements)


@rule("pad", family="shape", arg_names=("input", "pad"))
def pad_rule(op):
    x = op.tensors[0]
    pad = op.arg(1, "pad")
    padded = tuple(x.ndim - 1 - i // 2 for i, v in enumerate(pad) if v)
    placements = _dims_untouched(op, x, padded, "pads")
    if op.arg(2, "mode", "constant") == "constant" and op.arg(3, "value", None):
        for m, p in enumerate(placements):
            if p.is_partial("sum"):
                op.fail(m, "a nonzero pad value cannot go into Partial('sum')",
                        {x: with_dim(x.placements, m, R)}, "padding with a nonzero value")
    if op.arg(2, "mode", "constant") != "constant" and _some_block_empty(x):
        return Decision((placements,), pad_or_empty, None, None)
    return placements


def _some_block_empty(x) -> bool:
    mesh = x.mesh
    return any(0 in rank_block(x.shape, mesh, x.placements, mesh.get_coordinate(r)).shape
               for r in mesh.ranks)


def pad_or_empty(input, pad, mode="constant", value=None):
    """Local kernel: ``F.pad``, except that an empty shard (uneven sharding) gives its empty
    padded block (reflect/replicate/circular refuse empty inputs)."""
    if input.numel():
        return torch.nn.functional.pad(input, pad, mode, value)
    shape = list(input.shape)
    for i in range(len(pad) // 2):
        shape[-1 - i] += pad[2 * i] + pad[2 * i + 1]
    return input.new_zeros(shape)


@rule("view_as_real", "view_as_complex", family="shape", arg_names=("input",))
def complex_view_rule(op):
    x = op.tensors[0]
    if op.entry.name.endswith("view_as_complex"):
        return _dims_untouched(op, x, (x.ndim - 1,), "pairs up the last")
    return x.placements
