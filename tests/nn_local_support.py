"""Helpers for the batch-local family tests: run one call on DTensors (no collective may be
issued), compare with torch; gradients against torch.autograd."""

import torch

import dtorch
from dtorch import Replicate
from test_ops_support import dt, no_comm

R = Replicate()


def dist(args, placements, mesh):
    """``args`` with each tensor a DTensor on ``placements[i]`` (Replicate where None)."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            pl = placements[i] if i < len(placements) and placements[i] is not None else \
                [R] * mesh.ndim
            out.append(dt(a, mesh, pl))
        else:
            out.append(a)
    return out


def local(batch, fn, args, placements, mesh, want=None, **kwargs):
    """Queue ``fn(*args)`` on DTensors (no collective) against torch's; ``want`` the output
    placements (of each output)."""
    dargs = dist(args, placements, mesh)
    out = no_comm(lambda: fn(*dargs, **kwargs))
    expected = fn(*args, **kwargs)
    if isinstance(out, tuple):
        for o, e in zip(out, expected):
            batch.add(o, e, want)
    else:
        batch.add(out, expected, want)
    return out


def grad_check(fn, args, placements, mesh, grad_of=None):
    """The gradient of ``fn(*args).sum()``-like (a fixed random cotangent) w.r.t. the float
    tensors in ``grad_of`` (default: all), dtorch against torch; none issues a collective
    in the forward."""
    grad_of = range(len(args)) if grad_of is None else grad_of
    ts = [a.detach().clone().requires_grad_(i in grad_of) if isinstance(a, torch.Tensor)
          else a for i, a in enumerate(args)]
    want_out = fn(*ts)
    g = torch.randn(want_out.shape, generator=torch.Generator().manual_seed(7),
                    dtype=want_out.dtype)
    (want_out * g).sum().backward()
    ds = dist(args, placements, mesh)
    for i in grad_of:
        ds[i].requires_grad_()
    out = no_comm(lambda: fn(*ds))
    cot = dtorch.distribute_tensor(g, mesh, [R if p.is_partial() else p
                                             for p in out.placements])
    (out * cot).sum().backward()
    torch.testing.assert_close(out.to_torch(), want_out.detach(), rtol=1e-4, atol=1e-5)
    for i in grad_of:
        torch.testing.assert_close(ds[i].grad.to_torch(), ts[i].grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"grad of input {i}: {m}")
