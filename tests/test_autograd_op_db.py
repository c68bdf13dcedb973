"""Gradients of PyTorch's OpInfo database on DTensors: every differentiable op in ``op_db``
(its first 2 float64 cpu samples) on 4 ranks, with every tensor Replicate and with the first
tensor input ``Shard(0)``, ``dtorch.autograd.grad`` against ``torch.autograd.grad`` on one
device with the same output gradients.

Each (op, configuration) ends in one category: ``ok``, ``differs``, ``forward-refused`` (the
forward raises a dtorch error: no rule for these placements, an eager op, ...; nothing to
differentiate), ``backward-error`` (the forward ran, the gradient raised) or ``timeout``. The
contract: no op differs or hangs, and with all-Replicate inputs at least 90% of the ops whose
forward runs give torch's gradients. Run as a script it prints the ops that do not::

    .venv/bin/python tests/test_autograd_op_db.py
"""

from __future__ import annotations

import collections
import signal
import sys
import warnings

import pytest
import torch
import torch.utils._pytree as pytree
from torch.testing._internal.common_methods_invocations import op_db

import dtorch
from dtorch import Replicate, Shard

SAMPLES = 2
OP_TIMEOUT_S = 30
CONFIGS = ("replicate", "shard0")
# random values (or uninitialised memory): nothing to compare with; dropout has its own tests
SKIP_WORDS = ("rand", "bernoulli", "dropout", "uniform", "multinomial", "cauchy",
              "exponential", "geometric", "log_normal", "rrelu", "fractional", "lowrank",
              "empty", "new_empty")
SKIP_NAMES = ("normal",)  # not a word: ``nn.functional.normalize`` is deterministic


def is_random(op) -> bool:
    return op.name in SKIP_NAMES or any(w in op.name for w in SKIP_WORDS)


def differentiable_ops() -> list:
    return [op for op in op_db
            if op.supports_autograd and not is_random(op)
            and torch.float64 in op.supported_dtypes("cpu")]


def _samples(op) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = []
        for s in op.sample_inputs("cpu", torch.float64, requires_grad=True):
            out.append(s)
            if len(out) == SAMPLES:
                break
    return out


def _is_leaf(x) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


def _torch_grads(op, sample):
    args = pytree.tree_map(lambda x: x.detach().clone().requires_grad_() if _is_leaf(x) else x,
                           (sample.input, sample.args, sample.kwargs))
    leaves = [x for x in pytree.tree_leaves(args) if _is_leaf(x)]
    out = op(args[0], *args[1], **args[2])
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs or not leaves:
        return None
    g = torch.Generator().manual_seed(0)
    cots = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
    try:  # some ops' gradients are ill-defined for random cotangents (eig's phases)
        grads = torch.autograd.grad(outs, leaves, cots, allow_unused=True,
                                    materialize_grads=True)
    except RuntimeError:
        return None
    return args, leaves, outs, cots, grads


def _distributed(args, mesh, config):
    first = [True]

    def convert(x):
        if not isinstance(x, torch.Tensor):
            return x
        placement = Replicate()
        if config == "shard0" and first[0] and x.ndim >= 1:
            placement = Shard(0)
        first[0] = False
        return dtorch.tensor(x.detach(), device_mesh=mesh, placements=[placement],
                             requires_grad=x.requires_grad)
    return pytree.tree_map(convert, args)


def _alarm(signum, frame):
    raise TimeoutError(f"no result within {OP_TIMEOUT_S} s")


def run_config(op, samples, mesh, config) -> tuple[str, str]:
    """``(category, first message)`` for one op and configuration."""
    for sample in samples:
        try:
            ref = _torch_grads(op, sample)
        except Exception:  # noqa: BLE001 - torch itself fails on this sample: nothing to test
            continue
        if ref is None:
            continue
        args, _, outs, cots, want = ref
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(OP_TIMEOUT_S)
        try:
            try:
                dargs = _distributed(args, mesh, config)
                dout = op(dargs[0], *dargs[1], **dargs[2])
            except Exception as exc:  # noqa: BLE001 - the forward's own sweep (test_op_db)
                return "forward-refused", f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            douts = [o for o in pytree.tree_leaves(dout)
                     if isinstance(o, dtorch.DTensor) and o.requires_grad]
            dleaves = [x for x in pytree.tree_leaves(dargs)
                       if isinstance(x, dtorch.DTensor) and x.requires_grad]
            if len(douts) != len(outs):
                return "differs", f"{len(douts)} outputs require grad, torch has {len(outs)}"
            try:
                dcots = [dtorch.tensor(c, device_mesh=mesh, placements=[
                    Replicate() if p.is_partial() else p for p in o.placements])
                         for c, o in zip(cots, douts)]
                got = dtorch.autograd.grad(douts, dleaves, dcots, allow_unused=True,
                                           materialize_grads=True)
                values = [g.to_torch() for g in got]
            except Exception as exc:  # noqa: BLE001 - a category of its own
                dtorch.synchronize() if not isinstance(exc, dtorch.RemoteError) else None
                return "backward-error", f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            for i, (v, w) in enumerate(zip(values, want)):
                if not torch.allclose(v, w, rtol=1e-5, atol=1e-6, equal_nan=True):
                    return "differs", f"gradient {i}: max error {(v - w).abs().max():.3g}"
        except TimeoutError as exc:
            return "timeout", str(exc)
        finally:
            signal.alarm(0)
    return "ok", ""


def _clear_errors():
    try:
        dtorch.synchronize()
    except dtorch.RemoteError:
        pass


def run_all(mesh) -> dict:
    """``{(op name, config): (category, message)}``."""
    results = {}
    for op in differentiable_ops():
        samples = _samples(op)
        for config in CONFIGS:
            results[(op.name + (f".{op.variant_test_name}" if op.variant_test_name else ""),
                     config)] = run_config(op, samples, mesh, config)
        _clear_errors()
    return results


pytestmark = pytest.mark.timeout(1800)  # the module fixture runs the whole database


@pytest.fixture(scope="module")
def results(cluster):
    return run_all(dtorch.init_device_mesh("cpu", 4))


def test_no_gradient_differs_or_hangs(results):
    bad = {k: v for k, v in results.items() if v[0] in ("differs", "timeout")}
    assert not bad, bad


def test_most_replicate_gradients_match(results):
    ran = {k: v for k, v in results.items() if k[1] == "replicate" and
           v[0] != "forward-refused"}
    ok = sum(v[0] == "ok" for v in ran.values())
    assert ran and ok >= 0.9 * len(ran), (ok, len(ran), {k: v for k, v in ran.items()
                                                         if v[0] != "ok"})


if __name__ == "__main__":
    dtorch.init(n_workers=4)
    found = run_all(dtorch.init_device_mesh("cpu", 4))
    print(collections.Counter((c, v[0]) for (_, c), v in found.items()))
    for key, (category, message) in sorted(found.items()):
        if category != "ok":
            print(key, category, message[:160], file=sys.stdout)
    dtorch.shutdown()
