"""Backward through dtorch's LlamaForCausalLM against transformers' on one device, on a real
4-rank cluster: the same weights, ``model(ids, labels=ids).loss`` (Hugging Face's shifted
next-token loss) within 1e-5, every parameter's gradient within 1e-4
of its largest value under TP, DP x TP, PP x TP, DP x PP, DP x Ulysses, TP x ring and ring
meshes (the gradients keep each parameter's placements), and on 8 ranks DP x TP x PP."""

import pytest
import torch

import dtorch
from dtorch import init_device_mesh
from dtorch.models import LlamaForCausalLM

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=101, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=176, num_hidden_layers=2, eos_token_id=None)
MESHES = [((4,), ("tp",)), ((2, 2), ("dp", "tp")), ((2, 2), ("pp", "tp")),
          ((2, 2), ("dp", "pp")), ((2, 2), ("dp", "ulysses_cp")), ((2, 2), ("tp", "ring_cp")),
          ((4,), ("ring_cp",))]
MESHES_8 = [((2, 2, 2), ("dp", "tp", "pp"))]


@pytest.fixture(scope="module")
def reference():
    """transformers' model, its loss and gradients (float64)."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).double()
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = hf(ids, labels=ids).loss
    loss.backward()
    return hf, ids, loss.detach(), {n: p.grad for n, p in hf.named_parameters()}


def _model(hf, shape, names):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = LlamaForCausalLM(hf.config, device_mesh=mesh)
    model.load_state_dict(hf.state_dict())
    return model.double()


def _check_gradients(reference, shape, names):
    """Loss within 1e-5, every parameter's gradient within 1e-4 of its largest value, in the
    parameter's own placements."""
    hf, ids, want_loss, want = reference
    model = _model(hf, shape, names)
    loss = model(ids, labels=ids).loss
    torch.testing.assert_close(loss.to_torch(), want_loss, atol=1e-5, rtol=0)
    loss.backward()
    params = dict(model.named_parameters())
    assert set(params) == set(want)
    for name, p in params.items():
        assert p.grad is not None, name
        assert p.grad.placements == p.placements, name
        got, ref = p.grad.to_torch(), want[name]
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max(), name


@pytest.mark.parametrize("shape, names", MESHES, ids=["x".join(n) for _, n in MESHES])
def test_llama_gradients_match_transformers(live, reference, shape, names):
    _check_gradients(reference, shape, names)


@pytest.mark.timeout(600)  # 8 worker processes on this machine's cores
@pytest.mark.parametrize("shape, names", MESHES_8, ids=["x".join(n) for _, n in MESHES_8])
def test_llama_gradients_match_transformers_on_8_ranks(other_cluster, reference, shape, names):
    other_cluster(n_workers=8)
    _check_gradients(reference, shape, names)


@pytest.mark.parametrize("shape, names", [((2, 2), ("pp", "tp")), ((2, 2), ("dp", "pp"))],
                         ids=["ppxtp", "dpxpp"])
def test_micro_batches_through_the_pipeline_stages_give_the_whole_batch_gradients(
        live, reference, shape, names):
    """``dtorch.pipeline_backward(model.pipeline_stages(), ids.chunk(2), model.lm_loss)``:
    two micro-batches of one sequence, in 1F1B order, accumulate transformers' gradients of
    the whole batch; the losses are each micro-batch's, the stages' activations sent on point
    to point (one send and one gradient back per micro-batch)."""
    hf, ids, want_loss, want = reference
    model = _model(hf, shape, names)
    stages = model.pipeline_stages()
    assert len(stages) == 2
    with dtorch.CommDebugMode() as mode:
        losses = dtorch.pipeline_backward(stages, ids.chunk(2), model.lm_loss)
    assert mode.get_comm_counts()["send_recv"] == 2 * 2
    for loss, part in zip(losses, ids.chunk(2)):
        torch.testing.assert_close(loss.to_torch(), hf(part, labels=part).loss.detach(),
                                   atol=1e-5, rtol=0)
    for name, p in model.named_parameters():
        got, ref = p.grad.to_torch(), want[name]
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max(), name
