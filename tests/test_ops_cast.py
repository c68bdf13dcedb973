"""Casts keep placements; a Partial stays Partial only where the cast commutes with it."""

import pytest
import torch

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
            if p.reduce_op in ("max", "min") and dst is torch.bool:
                return None
    return tuple(pl)


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
        elif all(not p.is_partial() for p in pl) or dst.is_floating_point:
            batch.add(no_comm(lambda: fn(d, o)), expected, want,
                      rtol=1e-2 if dst in (torch.float16, torch.bfloat16) else 1e-5, atol=1e-2)
        else:  # a monotone cast of P(max|min): values differ in rounding of the shares only
            assert no_comm(lambda: fn(d, o)).placements == want
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
