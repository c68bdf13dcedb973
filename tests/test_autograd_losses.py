"""Losses on sharded inputs, on a real 4-rank cluster, against plain torch on one device:
values, gradients and exact collective counts (controller and workers' ledgers agree,
tests/ledgers.py).

- batch-sharded ("dp") losses with uneven shards and ignored targets, every reduction:
  ``reduction="none"`` keeps ``Shard(0)`` with no collective; ``"sum"`` and ``"mean"`` need none
  except a mean divided by a count only the data knows (the weights of the targets that are not
  ``ignore_index``; an ``mse_loss``/``l1_loss`` weight's sum): one all_reduce of that scalar;
  the backward of any of them communicates nothing;
- loss parallel: ``F.cross_entropy`` on logits sharded on the class dim: three all_reduces on
  that mesh dim (row max, sum of exponentials, target logit; one more with label smoothing),
  none in backward, also beside a batch on dp and on ``(batch, seq, vocab)`` logits flattened;
- bad inputs: a clear error on the controller before anything is sent, the cluster usable.
"""

import pytest
import torch
import torch.nn.functional as F

import dtorch
import dtorch.nn.functional as DF
from dtorch import Partial, Replicate, Shard, init_device_mesh
from dtorch.errors import MixedTensorError
from dtorch.runtime import session
from ledgers import counted

R = Replicate()
N = 7  # rows over 4 ranks: 2, 2, 2, 1


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _targets(n, classes, ignore=-100, seed=3):
    t = torch.randint(0, classes, (n,), generator=_gen(seed))
    t[1] = ignore
    t[-1] = ignore  # the last rank's only row is ignored
    return t


class Case:
    """A loss call: the torch function, its tensors (name -> (tensor, placements, grad?)) and
    keyword arguments; ``reduced`` is the forward's collective count for "mean"."""

    def __init__(self, func, tensors, kwargs=None, mean_counts=None, routed=False):
        self.func, self.tensors, self.kwargs = func, tensors, kwargs or {}
        self.mean_counts = mean_counts or {}
        # torch's F.l1_loss drops weight= on the way to __torch_function__ (torch 2.13):
        # dtorch.nn.functional.l1_loss goes to dispatch directly and keeps it
        self.dtorch_func = getattr(DF, func.__name__) if routed else func


def _float(*shape, seed=0, fn=None):
    t = torch.randn(*shape, generator=_gen(seed), dtype=torch.float64)
    return fn(t) if fn is not None else t


S0 = [Shard(0)]


def cases():
    x, y = _float(N, 3), _float(N, 3, seed=1)
    p, q = _float(N, 3, fn=torch.sigmoid), _float(N, 3, seed=1, fn=torch.sigmoid)
    logp, tq = _float(N, 4, fn=lambda t: t.log_softmax(-1)), _float(N, 4, seed=1,
                                                                    fn=lambda t: t.softmax(-1))
    w3, w5 = _float(3, seed=5).abs() + 0.5, _float(5, seed=6).abs() + 0.5
    w_elem = _float(N, 3, seed=7).abs()
    logits, targets = _float(N, 5), _targets(N, 5)
    probs = _float(N, 5, seed=2, fn=lambda t: t.softmax(-1))
    logits3, targets3 = _float(N, 5, 2), torch.stack([_targets(N, 5, seed=8),
                                                      _targets(N, 5, seed=9)], 1)
    one = {"all_reduce": 1}
    pair = {"input": (x, S0, True), "target": (y, S0, False)}
    return {
        "mse": Case(F.mse_loss, pair),
        "mse_weight": Case(F.mse_loss, {**pair, "weight": (w_elem, S0, False)}, mean_counts=one),
        "l1": Case(F.l1_loss, pair),
        "l1_weight": Case(F.l1_loss, {**pair, "weight": (w_elem, S0, False)}, mean_counts=one,
                          routed=True),
        "smooth_l1": Case(F.smooth_l1_loss, pair, {"beta": 0.5}),
        "huber": Case(F.huber_loss, pair, {"delta": 0.7}),
        "huber_weight": Case(F.huber_loss, {**pair, "weight": (w_elem, S0, False)}),
        "bce": Case(F.binary_cross_entropy, {"input": (p, S0, True), "target": (q, S0, False),
                                             "weight": (w3, [R], False)}),
        "bce_logits": Case(F.binary_cross_entropy_with_logits,
                           {**pair, "target": (q, S0, False), "weight": (w3, [R], False),
                            "pos_weight": (w3.flip(0), [R], False)}),
        "kl_div": Case(F.kl_div, {"input": (logp, S0, True), "target": (tq, S0, False)}),
        "kl_div_log_target": Case(F.kl_div, {"input": (logp, S0, True),
                                             "target": (tq.log(), S0, False)},
                                  {"log_target": True}),
        "nll": Case(F.nll_loss, {"input": (logits.log_softmax(-1), S0, True),
                                 "target": (targets, S0, False)}, mean_counts=one),
        "nll_weight_ignore_2": Case(F.nll_loss, {"input": (logits.log_softmax(-1), S0, True),
                                                 "target": (targets.clamp(min=0), S0, False),
                                                 "weight": (w5, [R], False)},
                                    {"ignore_index": 2}, mean_counts=one),
        "ce": Case(F.cross_entropy, {"input": (logits, S0, True),
                                     "target": (targets, S0, False)}, mean_counts=one),
        "ce_replicate_target": Case(F.cross_entropy, {"input": (logits, S0, True),
                                                      "target": (targets, [R], False)},
                                    mean_counts={}),
        "ce_weight_smoothing": Case(F.cross_entropy, {"input": (logits, S0, True),
                                                      "target": (targets, S0, False),
                                                      "weight": (w5, [R], False)},
                                    {"label_smoothing": 0.1}, mean_counts=one),
        "ce_probabilities": Case(F.cross_entropy, {"input": (logits, S0, True),
                                                   "target": (probs, S0, False),
                                                   "weight": (w5, [R], False)},
                                 {"label_smoothing": 0.2}),
        "ce_3d": Case(F.cross_entropy, {"input": (logits3, S0, True),
                                        "target": (targets3, S0, False)},
                      {"label_smoothing": 0.1}, mean_counts=one),
    }


CASES = cases()
REDUCTIONS = ["none", "sum", "mean"]
PARAMS = [(name, r) for name in CASES for r in REDUCTIONS] + [
    ("kl_div", "batchmean"), ("kl_div_log_target", "batchmean")]


def _dtensors(case, mesh):
    out = {}
    for name, (t, placements, grad) in case.tensors.items():
        out[name] = dtorch.tensor(t, device_mesh=mesh, placements=placements,
                                  requires_grad=grad)
    return out


def _torch_leaves(case):
    return {name: t.clone().requires_grad_(grad) for name, (t, _, grad) in case.tensors.items()}


def _scalar(loss):
    return loss.sum() if loss.ndim else loss


def _grads(leaves):
    return {n: t.grad for n, t in leaves.items() if t.requires_grad}


@pytest.mark.parametrize("name, reduction", PARAMS, ids=[f"{n}-{r}" for n, r in PARAMS])
def test_batch_sharded_loss_matches_torch(live, name, reduction):
    case, mesh = CASES[name], init_device_mesh("cpu", 4, mesh_dim_names=("dp",))
    kwargs = {**case.kwargs, "reduction": reduction}
    ref_in = _torch_leaves(case)
    want = case.func(**ref_in, **kwargs)
    _scalar(want).backward()
    inputs = _dtensors(case, mesh)
    dtorch.synchronize()
    loss, counts = counted(lambda: case.dtorch_func(**inputs, **kwargs))
    assert counts == (case.mean_counts if reduction == "mean" else {})
    if reduction == "none":
        assert loss.placements == (Shard(0),)
    torch.testing.assert_close(loss.to_torch(), want.detach())
    total = _scalar(loss)
    dtorch.synchronize()
    _, counts = counted(lambda: total.backward())
    assert counts == {}
    for n, g in _grads(ref_in).items():
        assert inputs[n].grad.placements == (Shard(0),)
        torch.testing.assert_close(inputs[n].grad.to_torch(), g)


def test_all_replicate_loss_runs_on_every_rank(live):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("dp",))
    x, t = _float(N, 5), _targets(N, 5)
    dx = dtorch.tensor(x, device_mesh=mesh, requires_grad=True)
    loss, counts = counted(lambda: F.cross_entropy(dx, dtorch.tensor(t, device_mesh=mesh)))
    assert counts == {} and loss.placements == (R,)
    xr = x.clone().requires_grad_()
    F.cross_entropy(xr, t).backward()
    loss.backward()
    torch.testing.assert_close(loss.to_torch(), F.cross_entropy(x, t))
    torch.testing.assert_close(dx.grad.to_torch(), xr.grad)


@pytest.mark.parametrize("make", [
    lambda: torch.nn.MSELoss(), lambda: torch.nn.HuberLoss(delta=0.5),
    lambda: torch.nn.KLDivLoss(reduction="batchmean"), lambda: torch.nn.CrossEntropyLoss(
        label_smoothing=0.1)], ids=["MSELoss", "HuberLoss", "KLDivLoss", "CrossEntropyLoss"])
def test_torch_loss_modules_on_even_shards(live, make):
    """torch.nn's loss modules call F.*; on even shards a mean is Partial('avg')."""
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("dp",))
    x = _float(8, 5)
    y = torch.randint(0, 5, (8,)) if isinstance(make(), torch.nn.CrossEntropyLoss) else \
        _float(8, 5, seed=1, fn=lambda t: t.softmax(-1))
    xr = x.clone().requires_grad_()
    want = make()(xr, y)
    want.backward()
    dx = dtorch.tensor(x, device_mesh=mesh, placements=S0, requires_grad=True)
    dy = dtorch.tensor(y, device_mesh=mesh, placements=S0)
    dtorch.synchronize()
    loss, counts = counted(lambda: make()(dx, dy))
    assert counts == ({"all_reduce": 1} if y.dtype == torch.int64 else {})
    torch.testing.assert_close(loss.to_torch(), want.detach())
    dtorch.synchronize()
    _, counts = counted(lambda: loss.backward())
    assert counts == {}
    torch.testing.assert_close(dx.grad.to_torch(), xr.grad)


def test_legacy_reduction_arguments_are_honoured(live):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("dp",))
    x, y, t = _float(N, 5), _float(N, 5, seed=1), _targets(N, 5)
    dx, dy, dt_ = (dtorch.tensor(v, device_mesh=mesh, placements=S0) for v in (x, y, t))
    with pytest.warns(UserWarning):
        got = [F.mse_loss(dx, dy, reduce=False), F.cross_entropy(dx, dt_, size_average=False)]
        want = [F.mse_loss(x, y, reduce=False), F.cross_entropy(x, t, size_average=False)]
    assert got[0].placements == (Shard(0),)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.to_torch(), w)


# loss parallel -----------------------------------------------------------------------------
LP = [  # (mesh shape, names, logits placements, target placements, classes)
    ((4,), ("tp",), [Shard(1)], [R], 10),          # 3, 3, 3, 1 classes per rank
    ((4,), ("tp",), [Shard(-1)], [R], 6),          # 2, 2, 2, 0: one rank holds no class
    ((2, 2), ("dp", "tp"), [Shard(0), Shard(1)], [Shard(0), R], 10),
]
LP_IDS = ["tp4", "tp4-empty-shard", "dp2xtp2"]


def _lp_reference(x, t, kwargs):
    xr = x.clone().requires_grad_()
    want = F.cross_entropy(xr, t, **kwargs)
    _scalar(want).backward()
    return want.detach(), xr.grad


def _lp_expected(names, reduction, smoothing):
    tp = 3 + (1 if smoothing else 0)
    dp = 1 if ("dp" in names and reduction == "mean") else 0
    return {("all_reduce", "tp"): tp, **({("all_reduce", "dp"): dp} if dp else {})}


def _by_dim(records):
    out = {}
    for r in records:
        out[(r.kind, r.mesh_dim_name)] = out.get((r.kind, r.mesh_dim_name), 0) + 1
    return out


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("extra", [{}, {"weight": True, "label_smoothing": 0.1},
                                   {"label_smoothing": 0.2}],
                         ids=["plain", "weight-smoothing", "smoothing"])
@pytest.mark.parametrize("shape, names, xp, tpl, classes", LP, ids=LP_IDS)
def test_loss_parallel_matches_torch(live, shape, names, xp, tpl, classes, extra, reduction):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    x, t = _float(N + 1, classes), _targets(N + 1, classes)
    kwargs = {"reduction": reduction, "label_smoothing": extra.get("label_smoothing", 0.0)}
    w = _float(classes, seed=6).abs() + 0.5 if extra.get("weight") else None
    want, want_grad = _lp_reference(x, t, {**kwargs, "weight": w})
    dx = dtorch.tensor(x, device_mesh=mesh, placements=xp, requires_grad=True)
    dt_ = dtorch.tensor(t, device_mesh=mesh, placements=tpl)
    dw = None if w is None else dtorch.tensor(w, device_mesh=mesh)
    dtorch.synchronize()
    with dtorch.CommDebugMode() as mode:
        loss, counts = counted(lambda: F.cross_entropy(dx, dt_, weight=dw, **kwargs))
    assert _by_dim(mode.get_comm_records()) == _lp_expected(names, reduction,
                                                            kwargs["label_smoothing"] > 0)
    torch.testing.assert_close(loss.to_torch(), want)
    total = _scalar(loss)
    dtorch.synchronize()
    _, counts = counted(lambda: total.backward())
    assert counts == {}  # softmax minus one-hot, on each rank's own classes
    assert dx.grad.placements == dx.placements
    torch.testing.assert_close(dx.grad.to_torch(), want_grad)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_parallel_with_every_target_ignored_is_nan_with_zero_gradients(live, smoothing):
    """torch: the mean over no target is 0/0 (NaN), and every logit's gradient is 0."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x, t = _float(N + 1, 10), torch.full((N + 1,), -100)
    want, want_grad = _lp_reference(x, t, {"label_smoothing": smoothing})
    assert want.isnan() and torch.equal(want_grad, torch.zeros_like(x))
    dx = dtorch.tensor(x, device_mesh=mesh, placements=[Shard(0), Shard(1)], requires_grad=True)
    dt_ = dtorch.tensor(t, device_mesh=mesh, placements=[Shard(0), R])
    loss = F.cross_entropy(dx, dt_, label_smoothing=smoothing)
    assert loss.to_torch().isnan()
    loss.backward()
    torch.testing.assert_close(dx.grad.to_torch(), want_grad)


def test_loss_parallel_target_out_of_range_raises_like_torch(live):
    """A target no rank's classes hold is torch's error on every rank (no silent loss), the
    cluster usable after."""
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("tp",))
    x, t = _float(N, 10), _targets(N, 10)
    t[3] = 10
    with pytest.raises(IndexError, match="out of bounds"):
        F.cross_entropy(x, t)
    dx = dtorch.tensor(x, device_mesh=mesh, placements=[Shard(1)])
    dt_ = dtorch.tensor(t, device_mesh=mesh, placements=[R])
    with pytest.raises(dtorch.RemoteError, match="Target 10 is out of bounds"):
        F.cross_entropy(dx, dt_).to_torch()
    with pytest.raises(dtorch.RemoteError, match="out of bounds"):
        dtorch.synchronize()  # the other ranks' failures of the same op
    ok = dtorch.tensor(_targets(N, 10), device_mesh=mesh, placements=[R])
    torch.testing.assert_close(F.cross_entropy(dx, ok).to_torch(),
                               F.cross_entropy(x, _targets(N, 10)))


def test_loss_parallel_on_flattened_3d_logits(live):
    """(batch, seq, vocab) logits sharded on the vocabulary, flattened as users (and Hugging
    Face's loss) do: ``logits.view(-1, vocab)``, ``labels.view(-1)``."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = _float(2, 5, 11)
    t = torch.randint(0, 11, (2, 5), generator=_gen(4))
    t[0, 2] = -100
    want, want_grad = _lp_reference(x.view(-1, 11), t.view(-1), {})
    dx = dtorch.tensor(x, device_mesh=mesh, placements=[Shard(0), Shard(2)], requires_grad=True)
    dt_ = dtorch.tensor(t, device_mesh=mesh, placements=[Shard(0), R])
    dtorch.synchronize()
    with dtorch.CommDebugMode() as mode:
        loss, _ = counted(lambda: F.cross_entropy(dx.view(-1, 11), dt_.view(-1)))
    assert _by_dim(mode.get_comm_records()) == {("all_reduce", "tp"): 3,
                                               ("all_reduce", "dp"): 1}
    torch.testing.assert_close(loss.to_torch(), want)
    dtorch.synchronize()
    _, counts = counted(lambda: loss.backward())
    assert counts == {}
    torch.testing.assert_close(dx.grad.to_torch(), want_grad.view(2, 5, 11))


# bad inputs --------------------------------------------------------------------------------
def _sent():
    c = session.get_controller()
    return c.issued, c.flushes


def refused(fn, exc, match):
    before = _sent()
    with pytest.raises(exc, match=match):
        fn()
    assert _sent() == before, "a refused call sent something to the workers"


def test_bad_loss_inputs_are_refused_before_anything_is_sent(live):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("dp",))
    x = dtorch.tensor(_float(N, 5), device_mesh=mesh, placements=S0, requires_grad=True)
    t = _targets(N, 5)
    t_s0 = dtorch.tensor(t, device_mesh=mesh, placements=S0)
    t_rep = dtorch.tensor(t, device_mesh=mesh)
    y = dtorch.tensor(_float(N, 5), device_mesh=mesh, placements=S0)
    w_s0 = dtorch.tensor(torch.ones(5), device_mesh=mesh, placements=S0)
    logits = dtorch.tensor(_float(N, 5), device_mesh=mesh, placements=[Shard(1)])
    probabilities = dtorch.tensor(torch.rand(N, 5), device_mesh=mesh)
    dtorch.synchronize()
    refused(lambda: F.cross_entropy(x, t_s0, reduction="avg"), ValueError,
            "reduction='avg' is not one of")
    refused(lambda: F.mse_loss(x, y, reduction="batchmean"), ValueError, "is not one of")
    refused(lambda: F.cross_entropy(x, t_s0, weight=w_s0), dtorch.PlacementError,
            "class weight must be Replicate")
    partial = x.sum(0)  # Partial("sum") on dp
    other = partial.detach()
    dtorch.synchronize()
    refused(lambda: F.mse_loss(partial, other), dtorch.PlacementError,
            "Partial")
    refused(lambda: F.mse_loss(x, torch.randn(N, 5, requires_grad=True)), MixedTensorError,
            "gradient would be lost")  # a plain target is a constant, unless it wants a grad
    torch.testing.assert_close(F.cross_entropy(x, t).to_torch(),
                               F.cross_entropy(_float(N, 5), t))
    refused(lambda: F.cross_entropy(logits, t_s0), dtorch.PlacementError,
            r"target.redistribute\(placements=\[Replicate\(\)\]\)")
    refused(lambda: F.cross_entropy(logits, probabilities), dtorch.PlacementError,
            "class-index targets")
    refused(lambda: F.nll_loss(logits, t_rep), dtorch.PlacementError, "loss parallel")
    usable = F.cross_entropy(x, t_s0)
    assert usable.placements == (Partial("sum"),)
    torch.testing.assert_close(usable.to_torch(), F.cross_entropy(_float(N, 5), t))
    assert usable.item() == pytest.approx(F.cross_entropy(_float(N, 5), t).item())


# LlamaForCausalLM(labels=...) ---------------------------------------------------------------
LLAMA = dict(vocab_size=101, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=176, num_hidden_layers=2, eos_token_id=None)
LLAMA_MESHES = [((4,), ("tp",)), ((2, 2), ("dp", "tp")), ((2, 2), ("pp", "tp")),
                ((2, 2), ("dp", "pp")), ((2, 2), ("dp", "ulysses_cp")), ((4,), ("ring_cp",)),
                ((2, 2), ("tp", "ring_cp"))]  # on ring meshes, the ring's backward


@pytest.fixture(scope="module")
def hf_llama():
    """transformers' model (float64), tokens, labels with -100s, its loss and gradients."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).double()
    ids = torch.randint(0, 101, (2, 12), generator=_gen(1))
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt that is not trained on
    out = hf(ids, labels=labels)
    out.loss.backward()
    return hf, ids, labels, out.loss.detach(), out.logits.detach(), {
        n: p.grad for n, p in hf.named_parameters()}


def _llama(hf, shape, names):
    from dtorch.models import LlamaForCausalLM
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = LlamaForCausalLM(hf.config, device_mesh=mesh)
    model.load_state_dict(hf.state_dict())
    return model.double(), mesh


def _loss_costs(names):
    """What the loss adds to a forward's collectives (per (kind, mesh dim name)): loss parallel
    replaces the logits' all_gather on tp by 3 all_reduces of per-row scalars; the count of
    labelled tokens is all_reduced on each dim the tokens are sharded on (the batch on dp, the
    sequence on a cp dim)."""
    costs = {}
    if "tp" in names:
        costs.update({("all_gather", "tp"): -1, ("all_reduce", "tp"): 3})
    for name in ("dp", "ulysses_cp", "ring_cp"):
        if name in names:
            costs[("all_reduce", name)] = 1
    return costs


def _plus(counts, delta):
    out = dict(counts)
    for k, n in delta.items():
        out[k] = out.get(k, 0) + n
    return {k: n for k, n in out.items() if n}


LABEL_CASES = [(shape, names, False) for shape, names in LLAMA_MESHES] + [
    (shape, names, True) for shape, names in LLAMA_MESHES[:2]]


@pytest.mark.parametrize("shape, names, as_dtensor", LABEL_CASES,
                         ids=["x".join(n) + ("-dtensor-labels" if d else "")
                              for _, n, d in LABEL_CASES])
def test_llama_labels_loss_and_gradients_match_transformers(live, hf_llama, shape, names,
                                                            as_dtensor):
    hf, ids, labels, want_loss, want_logits, want = hf_llama
    model, mesh = _llama(hf, shape, names)
    if as_dtensor:
        labels = dtorch.distribute_tensor(labels, mesh, [Shard(0) if n == "dp" else R
                                                         for n in names])
    dtorch.synchronize()
    with dtorch.CommDebugMode() as plain:
        model(ids)
    with dtorch.CommDebugMode() as mode:
        out = model(ids, labels=labels)
    assert _by_dim(mode.get_comm_records()) == _plus(_by_dim(plain.get_comm_records()),
                                                     _loss_costs(names))
    if "tp" in names:  # the logits live on the last stage's mesh
        tp = out.logits.device_mesh.mesh_dim_names.index("tp")
        assert out.logits.placements[tp] == Shard(2)
    torch.testing.assert_close(out.loss.to_torch(), want_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits.to_torch(), want_logits, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad.placements == p.placements, name
        got, ref = p.grad.to_torch(), want[name]
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max(), name


@pytest.mark.parametrize("shape, names", LLAMA_MESHES[:2], ids=["tp", "dpxtp"])
def test_llama_labels_loss_adds_no_backward_collective(live, hf_llama, shape, names):
    """The backward of model(ids, labels=...).loss runs exactly the collectives of the
    backward of an elementwise loss of the gathered logits (the parameters' own): the loss
    parallel backward communicates nothing, nor does the mean over dp."""
    hf, ids, labels, _, _, _ = hf_llama
    model, _ = _llama(hf, shape, names)
    plain = (model(ids).logits.tanh() ** 2).mean()
    dtorch.synchronize()
    with dtorch.CommDebugMode() as reference:
        counted(lambda: plain.backward())
    model.zero_grad()
    loss = model(ids, labels=labels).loss
    dtorch.synchronize()
    with dtorch.CommDebugMode() as mode:
        counted(lambda: loss.backward())
    assert _by_dim(mode.get_comm_records()) == _by_dim(reference.get_comm_records())


def test_llama_output_without_labels_and_bad_inputs(live, hf_llama):
    hf, ids, labels, _, want_logits, _ = hf_llama
    model, _ = _llama(hf, (4,), ("tp",))
    out = model(ids, attention_mask=torch.ones_like(ids))
    assert out.loss is None and out.keys() == ["logits"] and out[0] is out.logits
    assert out.logits.placements == (R,)
    torch.testing.assert_close(out.logits.to_torch(), want_logits, atol=1e-5, rtol=1e-5)
    dtorch.synchronize()
    refused(lambda: model(ids, attention_mask=torch.ones_like(ids)[:, 1:]), ValueError,
            r"attention_mask must be \[batch, seen \+ seq\]")
    refused(lambda: model(ids, labels=labels[:, :5]), ValueError, "labels must have")
    torch.testing.assert_close(model(ids).logits.to_torch(), want_logits, atol=1e-5, rtol=1e-5)
