"""``torch.fft.*`` on a real cluster along unsharded dims: each rank transforms its block, no
collective, the Shard kept (even, uneven and empty shards, 1-D and 2x2 meshes); a sharded
transformed dim raises PlacementError with the fix; gradients match torch's."""

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from test_ops_support import Batch, dt, illegal, no_comm

R = Replicate()
ONE = ["fft", "ifft", "rfft", "irfft", "hfft", "ihfft"]
TWO = ["fft2", "ifft2", "rfft2", "irfft2", "hfft2", "ihfft2"]
ALL = ["fftn", "ifftn", "rfftn", "irfftn", "hfftn", "ihfftn"]


def gen(*shape, seed=0, complex_=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    return torch.complex(x, torch.randn(shape, generator=g, dtype=torch.float64)) if complex_ \
        else x


def _input(name, *shape):
    complex_ = name.startswith(("irfft", "hfft", "ifft")) or name in ("fft", "fft2", "fftn")
    return gen(*shape, complex_=complex_ and not name.startswith("ihfft"))


def _run(mesh, fn, x, placements, out_placements=None):
    out = no_comm(lambda: fn(dt(x, mesh, placements)))
    batch = Batch()
    batch.add(out, fn(x), out_placements or placements, rtol=1e-9, atol=1e-9)
    batch.check()


@pytest.mark.parametrize("name", ONE + TWO + ALL)
def test_batch_sharded_even_uneven_empty(mesh1d, name):
    fn = getattr(torch.fft, name)
    kwargs = {"dim": (1, 2)} if name in ALL else {}
    for b in (8, 5, 3):
        _run(mesh1d, lambda x: fn(x, **kwargs), _input(name, b, 6, 7), [Shard(0)])


@pytest.mark.parametrize("name", ["fft", "rfft", "irfft", "hfft"])
def test_arguments_bound_by_name(mesh1d, name):
    fn = getattr(torch.fft, name)
    x = _input(name, 6, 5, 7)
    _run(mesh1d, lambda t: fn(t, 9, 0, "ortho"), x, [Shard(1)])  # n, dim, norm by position
    _run(mesh1d, lambda t: fn(t, n=4, dim=1, norm="forward"), x, [Shard(2)])
    _run(mesh1d, lambda t: fn(t, dim=-3), x, [Shard(2)])


def test_sizes_and_shifts(mesh1d):
    x = gen(5, 6, 7, complex_=True)
    _run(mesh1d, lambda t: torch.fft.fftn(t, s=(4, 9)), x, [Shard(0)])  # the last len(s) dims
    _run(mesh1d, lambda t: torch.fft.rfft2(t, s=(3, 8), dim=(0, 2)), x.real.contiguous(),
         [Shard(1)])
    _run(mesh1d, lambda t: torch.fft.fftshift(t, dim=(1, 2)), x, [Shard(0)])
    _run(mesh1d, lambda t: torch.fft.ifftshift(t, dim=0), x, [Shard(2)])


def test_2x2_mesh(mesh2d):
    x = gen(5, 3, 8, complex_=True)
    _run(mesh2d, torch.fft.fft, x, [Shard(0), Shard(1)])
    _run(mesh2d, lambda t: torch.fft.fft2(t, dim=(0, 2)), x, [R, Shard(1)])
    _run(mesh2d, torch.fft.rfft, x.real.contiguous(), [Shard(1), Shard(0)])


def test_sharded_transformed_dim_refuses_with_fix(mesh1d):
    x = gen(5, 6, 8)
    last, first = dt(x, mesh1d, [Shard(2)]), dt(x, mesh1d, [Shard(0)])
    err = illegal(lambda: torch.fft.rfft(last), match="transformed dims")
    assert "redistribute(placements=[Shard(0)])" in str(err)
    illegal(lambda: torch.fft.fftn(first))  # every dim by default
    illegal(lambda: torch.fft.fftshift(first))
    illegal(lambda: torch.fft.fft2(last))


@pytest.mark.parametrize("b", [8, 3])
def test_gradients(mesh1d, b):
    x = gen(b, 6)
    for fn in (lambda t: torch.fft.rfft(t).abs(), lambda t: torch.fft.fft2(t.unsqueeze(1)).real,
               lambda t: torch.fft.ihfft(t).imag):
        t = x.clone().requires_grad_()
        want_out = fn(t)
        g = gen(*want_out.shape, seed=9)
        (want,) = torch.autograd.grad(want_out, [t], g)
        d = dt(x, mesh1d, [Shard(0)]).requires_grad_()
        out = fn(d)
        (got,) = dtorch.autograd.grad(out, [d], dt(g, mesh1d, list(out.placements)))
        torch.testing.assert_close(got.to_torch(), want)
