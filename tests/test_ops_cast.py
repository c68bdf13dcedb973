"""Casts keep placements; a Partial stays Partial only where the cast commutes with it."""

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from test_ops_support import Batch, dt, illegal, make, no_comm, placements_1d

R = Replicate()
CASTS = {
    "to_half": (lambda x, o: x.to(torch.float16), torch.float16),
    "to_kw": (lambda x, o: x.to(dtype=torch.float32), torch.float32),
    "to_device_dtype": (lambda x, o: x.to("cpu", torch.float16), torch.float16),
    "float": (lambda x, o: x.float(), torch.float32),
    "double": (lambda x, o: x.double(), torch.float64),
    "half": (lambda x, o: x.half(), torch.float16),
    "long": (lambda x, o: x.long(), torch.int64),
    "int": (lambda x, o: x.int(), torch.int32),
    "bool": (lambda x, o: x.bool(), torch.bool),
    "byte": (lambda x, o: x.byte(), torch.uint8),  # negative values wrap: order not kept
    "char": (lambda x, o: x.char(), torch.int8),  # |x| < 128 here, but not in general
    "short": (lambda x, o: x.short(), torch.int16),
    "type_as": (lambda x, o: x.type_as(o), torch.int64),
    "to_other": (lambda x, o: x.to(o), torch.int64),
    "type": (lambda x, o: x.type(torch.float16), torch.float16),
}


def oracle(pl, src, dst):
    for p in pl:
        if p.is_partial():
            if p.reduce_op in ("sum", "avg") and not (src.is_floating_point and
                                                       dst.is_floating_point):
                return None
            # max/min commute with a cast that keeps order and cannot wrap (hand-listed)
            if p.reduce_op in ("max", "min") and dst in (torch.bool, torch.uint8, torch.int8,
                                                         torch.int16):
                return None
    return tuple(pl)


def cast_tolerance(pl, x: torch.Tensor, dst: torch.dtype, n: int) -> dict:
    """Exact unless a Partial sum/avg is cast: then each rank casts its share (rounding by at
    most half an ulp of ``dst``) and the shares are summed in ``dst``: an error of at most
    about ``eps(dst) * n * (largest share)`` per element (``make``'s shares are ``x`` moved by
    random amounts below 1.25 each). A monotone cast of a Partial max/min commutes with it,
    so it is exact too."""
    if not any(p.is_partial() and p.reduce_op in ("sum", "avg") for p in pl):
        return {"exact": True}
    largest = x.abs().max().item() + 1.25 * n
    return {"exact": False, "rtol": 0.0, "atol": 2 * torch.finfo(dst).eps * n * largest}


@pytest.mark.parametrize("name", sorted(CASTS))
def test_casts_every_placement_1d(mesh1d, name):
    fn, dst = CASTS[name]
    x = torch.randn(5, 6, dtype=torch.float64) * 4
    other = torch.arange(3)
    o = dt(other, mesh1d, [Shard(0)])  # its placements do not matter, only its dtype
    expected = fn(x, other)
    batch = Batch()
    for pl in placements_1d(2):
        d = make(x, mesh1d, pl, 1)
        want = oracle(pl, x.dtype, dst)
        if want is None:
            illegal(lambda: fn(d, o))
        else:
            batch.add(no_comm(lambda: fn(d, o)), expected, want,
                      **cast_tolerance(pl, x, dst, mesh1d.size()))
    batch.check()


def test_casts_2d_and_devices(mesh2d):
    x = torch.randint(-9, 9, (4, 5))
    xs = dt(x, mesh2d, [Shard(1), Shard(0)])
    batch = Batch()
    batch.add(no_comm(lambda: xs.float()), x.float(), [Shard(1), Shard(0)])
    batch.add(no_comm(lambda: xs.to(torch.float64) / 2), x.double() / 2, [Shard(1), Shard(0)])
    batch.add(no_comm(lambda: xs.cpu()), x, [Shard(1), Shard(0)])
    batch.check()
    with pytest.raises(ValueError, match="device is set by its mesh"):
        xs.to("cuda")
    with pytest.raises(ValueError, match="device is set by its mesh"):
        xs.cuda()
    p = make(torch.randn(3, 3, dtype=torch.float64), mesh2d, [Partial(), R], 1)
    illegal(lambda: p.long())


@pytest.mark.parametrize("src, dst, kept", [
    (torch.int32, torch.int64, True), (torch.uint8, torch.int16, True),
    (torch.int64, torch.int32, False), (torch.int16, torch.uint8, False),
    (torch.bool, torch.int8, True)], ids=str)
def test_integer_casts_of_max_min_partials_keep_them_only_where_no_value_wraps(mesh1d, src,
                                                                               dst, kept):
    """int64 -> int32 wraps 2**31 + 5 to a negative number: max of the casts is not the cast
    of the max, so the Partial must be reduced first (PlacementError naming the fix)."""
    big = 2 ** 31 + 5 if src == torch.int64 else 300 if src == torch.int16 else 1
    shares = [torch.tensor([big, 3, 0, 1]).to(src), torch.tensor([0, 7, 1, 1]).to(src),
              torch.tensor([1, 2, 2, 0]).to(src), torch.tensor([0, 0, 0, 1]).to(src)]
    for op, reduce in (("max", torch.maximum), ("min", torch.minimum)):
        p = dtorch.from_local(shares, mesh1d, [Partial(op)])
        if not kept:
            illegal(lambda: p.to(dst))
            continue
        want = shares[0]
        for s in shares[1:]:
            want = reduce(want, s)
        batch = Batch()
        batch.add(no_comm(lambda: p.to(dst)), want.to(dst), [Partial(op)], exact=True)
        batch.check()
