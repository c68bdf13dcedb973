"""Shared by the parallelize_module tests: seed 002's MLP, and checks against torch."""

import dtorch
import torch

from dtorch import ColwiseParallel, RowwiseParallel
from ledgers import counted

ATOL = 1e-5


class MLP(torch.nn.Module):
    """Seed 002's MLP: up-projection, ReLU, down-projection."""

    def __init__(self, dim=4, hidden=8, bias=True):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden, bias=bias)
        self.relu = torch.nn.ReLU()
        self.down = torch.nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return self.down(self.relu(self.up(x)))


MLP_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def close(d, t, atol=ATOL):
    got = d.to_torch()
    assert got.shape == t.shape, (got.shape, t.shape)
    assert torch.allclose(got, t.detach(), atol=atol), (got - t).abs().max()


def forward_counts(model, x):
    dtorch.synchronize()
    return counted(lambda: model(x))


def check_grads(model, ref, xd, xt):
    close(xd.grad, xt.grad)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        close(p.grad, grads[name].grad)


def check_sum_backward(model, ref, y, xd, x):
    """``y`` (the converted model's output on ``xd``) equals ``ref(x)``, and after
    ``sum().backward()`` on both every gradient does too."""
    xt = x.clone().requires_grad_()
    want = ref(xt)
    close(y, want)
    y.sum().backward()
    want.sum().backward()
    check_grads(model, ref, xd, xt)


class Tied(torch.nn.Module):
    def __init__(self, vocab=10, dim=6):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))
