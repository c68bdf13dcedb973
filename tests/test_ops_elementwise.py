"""Unary elementwise ops and activations: placements kept; Partial only where it commutes."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtorch import Partial, Replicate, Shard
from test_ops_support import PARTIALS, Batch, dt, illegal, make, no_comm, placements_1d

R = Replicate()
SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
FLIP = {"max": "min", "min": "max", "sum": "sum", "avg": "avg"}

# name -> (function, what a Partial input becomes: None illegal, "same", "flip")
OPS = {
    "relu": (torch.relu, None), "gelu": (F.gelu, None), "gelu_tanh": (
        lambda x: F.gelu(x, approximate="tanh"), None),
    "silu": (F.silu, None), "sigmoid": (torch.sigmoid, None), "tanh": (lambda x: x.tanh(), None),
    "exp": (torch.exp, None), "log": (lambda x: x.abs().log(), None), "sqrt": (
        lambda x: torch.sqrt(x.abs()), None),
    "sin": (torch.sin, None), "erf": (torch.erf, None), "abs": (abs, None),
    "floor": (torch.floor, None), "reciprocal": (lambda x: (x.abs() + 1).reciprocal(), None),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.1), None), "softplus": (F.softplus, None),
    "hardtanh": (F.hardtanh, None), "elu": (F.elu, None), "mish": (F.mish, None),
    "neg": (lambda x: -x, "flip"), "negative": (torch.neg, "flip"),
    "clone": (torch.clone, "same"), "detach": (lambda x: x.detach(), "same"),
    "dropout_eval": (lambda x: F.dropout(x, 0.3, training=False), "same"),
    "contiguous": (lambda x: x.contiguous(), "same"),
}


def oracle(rule, placements):
    out = []
    for p in placements:
        if p.is_partial():
            if rule is None:
                return None
            out.append(Partial(FLIP[p.reduce_op]) if rule == "flip" else p)
        else:
            out.append(p)
    return tuple(out)


def _run(mesh, name, x, placement_list, seed=0):
    fn, rule = OPS[name]
    expected = fn(x)
    batch = Batch()
    for pl in placement_list:
        d = make(x, mesh, pl, seed)
        want = oracle(rule, pl)
        if want is None:
            illegal(lambda: fn(d))
        else:
            batch.add(no_comm(lambda: fn(d)), expected, want)
    batch.check()


shapes = st.lists(st.integers(1, 6), min_size=0, max_size=3).map(tuple)


@SETTINGS
@given(shape=shapes, name=st.sampled_from(sorted(OPS)), seed=st.integers(0, 99))
def test_every_placement_1d(mesh1d, shape, name, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    _run(mesh1d, name, x, placements_1d(len(shape)), seed)


@SETTINGS
@given(shape=shapes, name=st.sampled_from(sorted(OPS)), data=st.data())
def test_sampled_placements_2d(mesh2d, shape, name, data):
    x = torch.randn(shape, dtype=torch.float64)
    choices = [R] + [Shard(d) for d in range(len(shape))] + PARTIALS
    pls = [tuple(data.draw(st.sampled_from(choices)) for _ in range(2)) for _ in range(5)]
    _run(mesh2d, name, x, pls)


def test_inplace_variants(mesh1d, mesh2d):
    x = torch.randn(7, 5)
    batch = Batch()
    for mesh, pl in ((mesh1d, [Shard(0)]), (mesh2d, [Shard(1), Shard(0)])):
        a = dt(x, mesh, pl)
        no_comm(lambda: a.exp_())
        no_comm(lambda: torch.relu_(a))
        no_comm(lambda: F.silu(a, inplace=True))
        no_comm(lambda: a.neg_())
        batch.add(a, -F.silu(torch.relu(x.exp())), pl)
    s = make(x.double(), mesh1d, [Partial("sum")], 2)
    no_comm(lambda: s.neg_())
    no_comm(lambda: s.detach_())
    batch.add(s, -x.double(), [Partial("sum")])
    batch.check()
    p = make(x.double(), mesh1d, [Partial("max")], 2)
    illegal(lambda: p.neg_(), match="in-place")  # -P(max) is P(min): not in place


def test_neg_of_partial_max_in_place_raises(mesh1d):
    p = make(torch.randn(3, 3, dtype=torch.float64), mesh1d, [Partial("max")], 1)
    q = make(torch.randn(3, 3, dtype=torch.float64), mesh1d, [Partial("sum")], 1)
    illegal(lambda: p.exp_())
    illegal(lambda: q.relu_())


def test_integer_unary_exact(mesh2d):
    x = torch.randint(-20, 20, (5, 3))
    xs = dt(x, mesh2d, [Shard(0), Shard(1)])
    batch = Batch()
    batch.add(no_comm(lambda: abs(xs)), x.abs(), [Shard(0), Shard(1)])
    batch.add(no_comm(lambda: -xs), -x, [Shard(0), Shard(1)])
    batch.add(no_comm(lambda: ~xs), ~x, [Shard(0), Shard(1)])
    batch.add(no_comm(lambda: torch.sign(xs)), x.sign(), [Shard(0), Shard(1)])
    batch.check()
