"""PyTorch's OpInfo database on DTensors: every op in ``op_db`` (its first 3 float32 cpu
samples) on 4 ranks, in three modes: every tensor Replicate, the first tensor input
``Shard(0)``, and the first tensor input sharded on its last dim; each result compared with
the same call on plain torch.

Each sample ends in one category, and so does each (op, mode), by its worst sample: ``ok`` (every sample gives torch's result),
``differs``, ``placement-refused`` (``PlacementError``: no rule fits and nothing moves
automatically), ``unsupported`` (``dtorch.ops.UnsupportedOpError``, e.g. random ops),
``other-exception`` or ``timeout``; ops with random or uninitialized results (``RANDOM``,
``has_nondeterministic_output``) run but are not compared. The contract: no op differs, hangs
or raises anything else, and with all-Replicate inputs at least 95% of the deterministic ops
give torch's result. Samples are counted too, with the collectives each issued
(``CommDebugMode``): a sample that runs with none is what PyTorch's DTensor counts as
communication-free. The ops that still refuse, and why, are the tables in docs/ops.md, which
this file regenerates when run as a script::

    .venv/bin/python tests/test_op_db.py        # ~3 minutes: 4 local ranks
"""

from __future__ import annotations

import gc
import re
import signal
import sys
import time
import warnings
from typing import NamedTuple

import pytest
import torch
import torch.utils._pytree as pytree
from torch.testing._internal.common_methods_invocations import op_db

import dtorch
from dtorch import PlacementError, Replicate, Shard
from dtorch.ops import UnsupportedOpError
from op_db_report import (CATEGORIES, CONFIGS, DOC, SAMPLES, docs_section,  # noqa: F401
                          ok_fraction, summary, write_docs)

OP_TIMEOUT_S = 30
WORST_FIRST = ("timeout", "differs", "other-exception", "unsupported", "placement-refused", "ok")
# OpInfo names whose results are random draws (torch.testing flags only the uninitialized ones)
RANDOM = {"bernoulli", "cauchy", "exponential", "geometric", "log_normal", "normal",
          "normal.in_place", "normal.number_mean", "uniform", "multinomial", "rand_like",
          "randn_like", "randint_like", "randn", "randint", "nn.functional.dropout",
          "nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.alpha_dropout",
          "nn.functional.feature_alpha_dropout.with_train", "nn.functional.rrelu",
          "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
          "svd_lowrank", "pca_lowrank"}


class Outcome(NamedTuple):
    """One (op, configuration) or one sample: its category, the first message that decided
    it, whether its values were compared (False for random / uninitialized results); for an
    op, its samples' outcomes; for a sample, the collectives its call issued."""

    category: str
    reason: str
    compared: bool
    samples: tuple = ()
    collectives: int = 0


class OpTimeout(BaseException):
    """The controller spent longer than OP_TIMEOUT_S in one call (BaseException: dtorch's
    own ``except Exception`` must not swallow it)."""


def full_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def random_sample(op, sample) -> bool:
    """A sample whose result is a random draw though its op's are not in general: attention
    with ``dropout_p > 0`` (dtorch's mask is its own stream's, not torch's)."""
    return (full_name(op) == "nn.functional.scaled_dot_product_attention"
            and sample.kwargs.get("dropout_p", 0.0) > 0)


def is_compared(op) -> bool:
    return full_name(op) not in RANDOM and not op.has_nondeterministic_output


def runnable_ops() -> list:
    """The OpInfos with float32 cpu samples."""
    return [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]


def callable_of(op):
    """``op.op``, except that a ``torch.Tensor`` method descriptor (``Tensor.__radd__``,
    ``Tensor.__getitem__``), which only takes a torch.Tensor self, is called as the DTensor's
    own method, the way user code calls it (``x.__radd__(2)``, ``x[i]``)."""
    if type(op.op).__name__ in ("method_descriptor", "wrapper_descriptor"):
        name = op.op.__name__
        return lambda self, *args, **kwargs: getattr(self, name)(*args, **kwargs)
    return op.op


_UNBOUND = re.compile(r"descriptor '(\w+)' for 'torch._C.TensorBase' objects doesn't apply "
                      r"to a 'DTensor' object")


def call(op, parts):
    """Run the op on DTensor ``parts`` under the timeout. An OpInfo that calls an unbound
    ``torch.Tensor`` method (``torch.Tensor.cauchy_(t)``), which takes only a torch.Tensor, is
    retried as the DTensor's method (``t.cauchy_()``)."""
    inp, args, kwargs = parts
    try:
        return timed(callable_of(op), inp, *args, **kwargs)
    except TypeError as exc:
        unbound = _UNBOUND.match(str(exc))
        if unbound is None or not isinstance(inp, dtorch.DTensor):
            raise
    return timed(getattr(inp, unbound.group(1)), *args, **kwargs)


def first_samples(op) -> list:
    """Up to SAMPLES float32 cpu samples that have a tensor to distribute."""
    out = []
    for s in op.sample_inputs("cpu", torch.float32, requires_grad=False):
        if any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(_parts(s))):
            out.append(s)
        if len(out) == SAMPLES:
            break
    return out


def _parts(sample):
    return (sample.input, tuple(sample.args), dict(sample.kwargs))


def cloned(sample):
    """``(input, args, kwargs)`` with every tensor a fresh copy (ops may mutate them)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), _parts(sample))


def distributed(sample, mesh, config):
    """``(input, args, kwargs)`` with every tensor a DTensor: Replicate, except the first
    tensor, sharded on dim 0 under ``shard0`` and on its last dim under ``shardlast`` (None
    when it has no dim: nothing to shard)."""
    leaves, spec = pytree.tree_flatten(cloned(sample))
    tensors = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    shard, dim = None, 0
    if config != "replicate":
        if leaves[tensors[0]].dim() == 0:
            return None
        shard = tensors[0]
        dim = 0 if config == "shard0" else leaves[shard].dim() - 1
    for i in tensors:
        placements = [Shard(dim)] if i == shard else [Replicate()]
        leaves[i] = dtorch.distribute_tensor(leaves[i], mesh, placements)
    return pytree.tree_unflatten(leaves, spec)


def _alarm(signum, frame):
    raise OpTimeout()


def timed(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, raising OpTimeout after OP_TIMEOUT_S seconds.

    It borrows SIGALRM from pytest-timeout (whose timer guards the whole test) and hands it
    back: the outer timer is re-armed with what is left of it, so a hang after this call is
    still caught. If the outer timer would fire first, it keeps its own handler."""
    outer_handler = signal.getsignal(signal.SIGALRM)
    outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    started = time.monotonic()
    ours = not outer_left or OP_TIMEOUT_S < outer_left
    if ours:
        signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, OP_TIMEOUT_S if ours else outer_left)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_left:
            left = outer_left - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), outer_interval)


def classify(exc: BaseException) -> str:
    if isinstance(exc, (OpTimeout, TimeoutError)):
        return "timeout"
    if isinstance(exc, PlacementError):
        return "placement-refused"
    if isinstance(exc, UnsupportedOpError):
        return "unsupported"
    return "other-exception"


def first_line(exc: BaseException) -> str:
    """The exception's first line; for a PlacementError, and the collective its fix costs."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}"[:220]
    if isinstance(exc, PlacementError):
        line += f" [fix: {fix_collective(str(exc))}]"
    return line


def fix_collective(message: str) -> str:
    """What the first fix of a PlacementError message moves (its ``# all_gather`` note)."""
    for line in message.splitlines():
        if line.strip().startswith("fix:"):
            _, sep, cost = line.partition("   # ")
            return cost.strip() if sep else "redistribute"
    return "no fix named"


# one op ------------------------------------------------------------------------------------------
def run_op(op, mesh) -> dict:
    """``{config: Outcome}`` for one OpInfo (see module doc)."""
    torch.manual_seed(0)  # the same samples whatever ran before
    try:
        samples = first_samples(op)
    except Exception as exc:  # noqa: BLE001 - a sample generator that fails on cpu
        return {c: Outcome("skipped", f"no samples: {first_line(exc)}", False) for c in CONFIGS}
    results = {}
    for config in CONFIGS:
        results[config] = _run_config(op, samples, mesh, config)
    return results


def _run_config(op, samples, mesh, config) -> Outcome:
    outcomes, pending, got = [], [], None
    for sample in samples:
        try:
            inp, args, kwargs = cloned(sample)
            expected = op.op(inp, *args, **kwargs)
        except Exception:  # noqa: BLE001 - torch itself refuses this sample: nothing to compare
            continue
        try:
            parts = distributed(sample, mesh, config)
            if parts is None:
                continue
            with dtorch.CommDebugMode() as comm:
                got = call(op, parts)
            pending.append((got, expected, _fetch(got), not random_sample(op, sample),
                            comm.get_total_counts()))
        except BaseException as exc:  # noqa: BLE001 - OpTimeout too: it is what we classify
            if isinstance(exc, KeyboardInterrupt):
                raise
            outcomes.append(Outcome(classify(exc), first_line(exc), True))
    compare = is_compared(op)
    for got, expected, futures, drawn_alike, collectives in pending:
        outcomes.append(_check(got, expected, futures, compare and drawn_alike)._replace(
            collectives=collectives))
    del pending, got  # frees this op's DTensors now, so a failed free is this op's error
    if any(o.category == "other-exception" for o in outcomes):
        gc.collect()  # a remote error's traceback holds the DTensors in a cycle
    sync = _synchronize()
    if not outcomes:
        return Outcome("skipped", "no sample torch runs", False)
    worst = min(outcomes + [sync], key=lambda o: WORST_FIRST.index(o.category))
    if sync.category != "ok":  # an error only synchronize saw: the op's, not one sample's
        outcomes = [o if o.category != "ok" else sync for o in outcomes]
    return Outcome(worst.category, worst.reason, compare, tuple(outcomes))


def _fetch(got) -> list:
    """Start reading every DTensor in the result (pipelined: all requests go out at once)."""
    return [x.to_torch_async() if isinstance(x, dtorch.DTensor) else None
            for x in pytree.tree_leaves(got)]


def _check(got, expected, futures, compare: bool) -> Outcome:
    """Compare one sample's result with torch's (structure always; values when ``compare``)."""
    got_leaves, got_spec = pytree.tree_flatten(got)
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    values = []
    for leaf, future in zip(got_leaves, futures):
        try:
            values.append(future.get(timeout=OP_TIMEOUT_S) if future is not None else leaf)
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, KeyboardInterrupt):
                raise
            return Outcome(classify(exc), first_line(exc), compare)
    if got_spec != exp_spec:
        return Outcome("differs", f"result structure {got_spec} != torch's {exp_spec}", compare)
    for i, (g, e) in enumerate(zip(values, exp_leaves)):
        why = _leaf_differs(g, e, compare)
        if why:
            return Outcome("differs", f"output {i}: {why}"[:220], compare)
    return Outcome("ok", "", compare)


def _leaf_differs(got, expected, compare: bool) -> str | None:
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"got {type(got).__name__}, torch gives a tensor"
        if got.shape != expected.shape or got.dtype != expected.dtype:
            return (f"shape/dtype {tuple(got.shape)} {got.dtype} != torch's "
                    f"{tuple(expected.shape)} {expected.dtype}")
        if not compare:
            return None
        try:
            torch.testing.assert_close(got, expected.detach().resolve_conj().resolve_neg(),
                                       rtol=1e-4, atol=1e-5, equal_nan=True,
                                       check_layout=False)
        except AssertionError as exc:
            return " ".join(str(exc).split())[:160]
        return None
    if isinstance(got, dtorch.DTensor):
        return f"got a DTensor, torch gives {type(expected).__name__}"
    if compare and got != expected and not (got != got and expected != expected):
        return f"{got!r} != torch's {expected!r}"
    return None


def _synchronize(attempts: int = 5) -> Outcome:
    """The first error the reads did not see (an instruction whose output nobody read, a
    failed free); every pending error is drained, so none is blamed on the next op."""
    first = Outcome("ok", "", True)
    for _ in range(attempts):
        try:
            timed(dtorch.synchronize, OP_TIMEOUT_S)
            return first
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, KeyboardInterrupt):
                raise
            if first.category == "ok":
                first = Outcome(classify(exc), "at synchronize: " + first_line(exc), True)
    return first


# the whole database ------------------------------------------------------------------------------
def run_all(mesh, ops=None) -> dict:
    """``{(op name, config): Outcome}`` for every runnable OpInfo."""
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in ops if ops is not None else runnable_ops():
            for config, outcome in run_op(op, mesh).items():
                results[(full_name(op), config)] = outcome
    return results


# tests -------------------------------------------------------------------------------------------
pytestmark = pytest.mark.timeout(900)  # the module fixture runs the whole database (~2 min)


@pytest.fixture(scope="module")
def results(cluster):
    return run_all(dtorch.init_device_mesh("cpu", 4))


def _failures(results, config, categories=("differs", "other-exception", "timeout")):
    return {name: o for (name, c), o in results.items() if c == config and o.category in categories}


def test_all_replicate_inputs_give_torchs_result(results):
    print("\n" + docs_section(results))
    assert _failures(results, "replicate") == {}
    assert ok_fraction(results, "replicate") >= 0.95


@pytest.mark.parametrize("config", CONFIGS[1:])
def test_sharded_inputs_never_differ_hang_or_crash(results, config):
    assert _failures(results, config) == {}


def test_timed_hands_pytest_timeouts_timer_back():
    """A hang after ``timed`` must still end at pytest-timeout's limit (the old ``timed``
    disarmed its timer after the first op)."""
    left_before = signal.getitimer(signal.ITIMER_REAL)[0]
    assert left_before > 0, "pytest-timeout (signal method) arms ITIMER_REAL for each test"
    assert timed(lambda: 7) == 7
    left_after = signal.getitimer(signal.ITIMER_REAL)[0]
    assert 0 < left_after <= left_before
    assert signal.getsignal(signal.SIGALRM) is not _alarm


def test_timed_ends_a_hung_call(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "OP_TIMEOUT_S", 0.2)
    with pytest.raises(OpTimeout):  # a call that would not end for an hour
        timed(time.sleep, 3600)
    assert signal.getitimer(signal.ITIMER_REAL)[0] > 0  # pytest-timeout's timer is armed again


def plans_collectives(op) -> bool:
    """Whether dtorch may plan collectives for this OpInfo's callable: a composite (attention:
    its collectives are its algorithm) or a call re-expressed as DTensor ops
    (``registry.decomposed``: loss reductions, reductions along a sharded dim), or a
    ``torch.masked`` function (Python code calling such ops: ``masked.cumsum`` calls
    ``torch.cumsum``)."""
    from dtorch.ops import registry
    entry = registry.lookup(op.op)
    return (op.op in registry.DECOMPOSED or (entry is not None and entry.family == "attention")
            or getattr(op.op, "__module__", "").startswith("torch.masked"))


@pytest.mark.parametrize("config", CONFIGS)
def test_only_composites_issue_collectives(results, config):
    by_name = {full_name(op): op for op in runnable_ops()}
    talking = {name for (name, c), o in results.items() if c == config
               and any(s.collectives for s in o.samples)}
    assert {name for name in talking if not plans_collectives(by_name[name])} == set()


def test_docs_table_is_current(results):
    assert docs_section(results) in DOC.read_text(), (
        "docs/ops.md's op_db table is stale: .venv/bin/python tests/test_op_db.py")


if __name__ == "__main__":
    dtorch.init(n_workers=4)
    names = set(sys.argv[1:])
    chosen = [op for op in runnable_ops() if not names or full_name(op) in names]
    found = run_all(dtorch.init_device_mesh("cpu", 4), chosen)
    print(docs_section(found))
    if not names:
        write_docs(found)
    dtorch.shutdown()
