"""Hugging Face transformers' own models, unmodified, through ``parallelize_module`` with the
usual tensor-parallel plan (real 4-rank cluster): ``LlamaForCausalLM``, ``Qwen2ForCausalLM``
and ``MistralForCausalLM`` (tiny random configs) on tp2, tp4 and dp2 x tp2 (input ids
``Shard(0)`` on dp), each against a copy of the model on one device: logits within 1e-4,
exact collective counts, transformers' own ``generate`` (greedy, its own KV cache, a row that
stops at eos) token for token, no constant bytes on a repeated forward, ``.loss`` and its
gradients; and an error that names the op and the module when a config cannot be split."""

import copy

import pytest
import torch

import dtorch
from dtorch import (ColwiseParallel, PlacementError, Replicate, RowwiseParallel, Shard,
                    init_device_mesh, parallelize_module)
from ledgers import counted

transformers = pytest.importorskip("transformers")

R = Replicate()
LAYERS = 2
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=4)
MODELS = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
          "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
          "mistral": ("MistralConfig", "MistralForCausalLM")}
MESHES = {"tp2": ((2,), ("tp",)), "tp4": ((4,), ("tp",)), "dp2xtp2": ((2, 2), ("dp", "tp"))}
# torchtitan's / PyTorch's tutorial plan for a Llama decoder: heads and MLP columns on tp
TP_PLAN = {"model.layers.*.self_attn.q_proj": ColwiseParallel(),
           "model.layers.*.self_attn.k_proj": ColwiseParallel(),
           "model.layers.*.self_attn.v_proj": ColwiseParallel(),
           "model.layers.*.self_attn.o_proj": RowwiseParallel(),
           "model.layers.*.mlp.gate_proj": ColwiseParallel(),
           "model.layers.*.mlp.up_proj": ColwiseParallel(),
           "model.layers.*.mlp.down_proj": RowwiseParallel()}


def hf_model(kind, **overrides):
    config_cls, model_cls = (getattr(transformers, n) for n in MODELS[kind])
    torch.manual_seed(0)
    return model_cls(config_cls(**{**CONFIG, **overrides})).eval()


def parallel_copy(model, mesh_name):
    """``(converted deep copy, mesh, placements of the input ids)``."""
    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    converted = parallelize_module(copy.deepcopy(model), mesh, TP_PLAN)
    return converted, mesh, [Shard(0), R] if "dp" in names else [R]


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, CONFIG["vocab_size"], (2, 7),
                         generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_forward_and_generate_match_transformers(live, ids, kind, mesh_name):
    ref = hf_model(kind)
    model, mesh, placements = parallel_copy(ref, mesh_name)
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "DTorchLinear"
    assert list(model.state_dict()) == list(ref.state_dict())
    d_ids = dtorch.distribute_tensor(ids, mesh, placements)
    with torch.no_grad():
        logits, counts = counted(lambda: model(d_ids).logits)
        want = ref(ids).logits
    assert counts == {"all_reduce": 2 * LAYERS}  # o_proj and down_proj of every layer
    assert logits.placements == tuple(placements)
    assert torch.allclose(logits.to_torch(), want, atol=1e-4)

    with torch.no_grad(), dtorch.CommDebugMode() as mode:
        model(d_ids)  # the causal mask, positions and rotary tables are cached constants
    assert mode.get_constant_bytes() == 0

    # transformers' generate, greedy, with a row that stops early at "eos": the stop check
    # (unfinished.max() == 0 on batch-sharded rows) runs every step
    free = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                        do_sample=False, eos_token_id=None, pad_token_id=0)
    eos = int(free[0, ids.shape[1] + 1])
    kwargs = dict(max_new_tokens=5, do_sample=False, eos_token_id=eos, pad_token_id=0)
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert (want[0, ids.shape[1] + 2:] == 0).all()  # row 0 ended at eos, padded since
    mask = dtorch.distribute_tensor(torch.ones_like(ids), mesh, placements)
    got = model.generate(d_ids, attention_mask=mask, **kwargs)
    assert isinstance(got, dtorch.DTensor)
    assert torch.equal(got.to_torch(), want)

    # every row stops: two equal rows both emit eos, and decoding ends before the budget
    same = ids[:1].repeat(2, 1)
    want = ref.generate(same, attention_mask=torch.ones_like(same), **kwargs)
    assert want.shape[1] < ids.shape[1] + kwargs["max_new_tokens"]
    got = model.generate(dtorch.distribute_tensor(same, mesh, placements), attention_mask=mask,
                         **kwargs)
    assert torch.equal(got.to_torch(), want)


@pytest.mark.parametrize("mesh_name", ["tp2", "dp2xtp2"])
def test_loss_and_gradients_match_transformers(live, ids, mesh_name):
    ref = hf_model("llama")
    model, mesh, placements = parallel_copy(ref, mesh_name)
    d_ids = dtorch.distribute_tensor(ids, mesh, placements)
    loss = model(input_ids=d_ids, labels=d_ids).loss
    want = ref(input_ids=ids, labels=ids).loss
    assert torch.allclose(loss.to_torch(), want, atol=1e-5)
    loss.backward()
    want.backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.placements == p.placements, name
        assert torch.allclose(p.grad.to_torch(), grads[name].grad, atol=1e-5), name


def test_heads_that_do_not_split_name_the_op_and_the_module(live, ids):
    """2 key/value heads on 4 tp ranks: k_proj's columns split inside a head, and the view
    into heads raises naming Tensor.view and the attention module it ran in."""
    ref = hf_model("llama", num_key_value_heads=2)
    model, mesh, placements = parallel_copy(ref, "tp4")
    with pytest.raises(PlacementError) as info:
        model(dtorch.distribute_tensor(ids, mesh, placements))
    text = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert "Tensor.view" in text
    assert "model.layers.0.self_attn (LlamaAttention" in text
    logits = model.model.embed_tokens(dtorch.distribute_tensor(ids, mesh, placements))
    assert torch.allclose(logits.to_torch(), ref.model.embed_tokens(ids))  # still usable


def test_a_meta_device_model_gets_transformers_init_on_the_ranks(live, ids):
    """Built under ``torch.device("meta")``, the model is initialised on the ranks as
    transformers' own ``_init_weights`` does (N(0, initializer_range) projections and
    embeddings, ones for the norms, the rotary table copied), then loads real weights."""
    with torch.device("meta"):
        model = hf_model("llama")
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, TP_PLAN)
    ref = hf_model("llama")
    std = ref.config.initializer_range
    up = model.model.layers[0].mlp.up_proj.weight
    assert up.placements == (Shard(0),)
    assert abs(float(up.to_torch().std()) - std) < 0.2 * std
    assert abs(float(model.model.embed_tokens.weight.to_torch().std()) - std) < 0.2 * std
    assert torch.equal(model.model.norm.weight.to_torch(), torch.ones(CONFIG["hidden_size"]))
    assert torch.equal(model.model.rotary_emb.inv_freq.to_torch(), ref.model.rotary_emb.inv_freq)
    model.load_state_dict(ref.state_dict())
    d_ids = dtorch.distribute_tensor(ids, mesh, [R])
    with torch.no_grad():
        assert torch.allclose(model(d_ids).logits.to_torch(), ref(ids).logits, atol=1e-4)
