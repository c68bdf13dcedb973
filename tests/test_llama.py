"""dtorch's LlamaForCausalLM against Hugging Face transformers' on one device: the same weights
through ``load_state_dict(hf.state_dict())``, logits within 1e-4 and greedy ``generate`` token
for token, under DP / TP / PP meshes on 4 ranks and 3-D meshes on 8 ranks (real clusters)."""

import pytest
import torch

import dtorch
from dtorch import init_device_mesh
from dtorch.models import LlamaForCausalLM
from dtorch.runtime import session

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=101, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=176, num_hidden_layers=5, eos_token_id=None)
MESHES_4 = [((4,), ("tp",)), ((2, 2), ("dp", "tp")), ((2, 2), ("pp", "tp")),
            ((2, 2), ("dp", "pp")), ((4,), ("pp",)), ((4,), ("dp",)),
            ((2, 2), ("tp", "ring_cp")), ((2, 2), ("dp", "ulysses_cp")),
            ((2, 2), ("ulysses_cp", "ring_cp")), ((4,), ("ring_cp",)), ((2, 2), ("pp", "ring_cp")),
            ((2, 2), ("ulysess_cp", "tp"))]


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(1))


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def expected_counts(names, layers=5):
    """Per forward: tp gathers the embedding and the logits and all-reduces o_proj and
    down_proj; pp moves between stages; Ulysses is 4 all_to_alls per attention (q, k, v in,
    the output back); the ring shifts K/V cp - 1 times per attention, and alone (causal, one
    block per rank) balances the work with 4 zig-zag all_to_alls."""
    sizes = dict(zip(names, MESH_SHAPES[names]))
    counts = {}
    if "tp" in names:
        counts.update(all_gather=2, all_reduce=2 * layers)
    if "pp" in names:
        counts["send_recv"] = sizes["pp"] - 1
    if "ulysses_cp" in names or "ulysess_cp" in names:
        counts["all_to_all"] = 4 * layers
    if "ring_cp" in names:
        counts["send_recv"] = counts.get("send_recv", 0) + (sizes["ring_cp"] - 1) * layers
        if "all_to_all" not in counts:  # causal ring alone: zig-zag in (q, k, v) and out
            counts["all_to_all"] = 4 * layers
    return counts


MESH_SHAPES = {names: shape for shape, names in MESHES_4}


@pytest.mark.parametrize("shape, names", MESHES_4, ids=["x".join(n) for _, n in MESHES_4])
def test_logits_match_transformers(live, hf_model, tokens, shape, names):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = LlamaForCausalLM(hf_model.config, device_mesh=mesh)
    assert list(model.state_dict()) == list(hf_model.state_dict())
    model.load_state_dict(hf_model.state_dict())
    with dtorch.CommDebugMode() as mode:
        logits = model(tokens).logits
    assert mode.get_comm_counts() == expected_counts(names)
    assert torch.allclose(logits.to_torch(), hf_logits(hf_model, tokens), atol=1e-4)


@pytest.mark.parametrize("shape, names", [((2, 2), ("pp", "tp")), ((4,), ("tp",)),
                                          ((2, 2), ("ulysses_cp", "ring_cp")),
                                          ((2, 2), ("tp", "ring_cp"))])
def test_greedy_generate_matches_transformers(live, hf_model, tokens, shape, names):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = LlamaForCausalLM(hf_model.config, device_mesh=mesh)
    model.load_state_dict(hf_model.state_dict())
    got = model.generate(tokens, max_new_tokens=6)
    want = hf_model.generate(tokens, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)


def test_eos_stops_rows_like_transformers(live, hf_model, tokens):
    """A row that emits eos is padded afterwards; decoding ends when every row is done."""
    want_free = hf_model.generate(tokens, max_new_tokens=6, do_sample=False)
    eos = int(want_free[0, 13])  # the token row 0 emits second: it becomes "eos"
    want = hf_model.generate(tokens, max_new_tokens=6, do_sample=False, eos_token_id=eos,
                             pad_token_id=0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = LlamaForCausalLM(hf_model.config, device_mesh=mesh)
    model.load_state_dict(hf_model.state_dict())
    assert torch.equal(model.generate(tokens, 6, eos_token_id=eos, pad_token_id=0), want)


def test_generate_takes_transformers_arguments(live, hf_model, tokens):
    """input_ids=, attention_mask (all ones), do_sample=False, max_length as transformers'
    generate takes them; sampling, beams and a malformed mask raise by name before decoding."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = LlamaForCausalLM(hf_model.config, device_mesh=mesh)
    model.load_state_dict(hf_model.state_dict())
    ones = torch.ones_like(tokens)
    want = hf_model.generate(input_ids=tokens, attention_mask=ones, do_sample=False,
                             max_length=tokens.shape[1] + 3)
    got = model.generate(input_ids=tokens, attention_mask=ones, do_sample=False,
                         max_length=tokens.shape[1] + 3, num_beams=1)
    assert torch.equal(got, want)
    for kwargs, match in (({"do_sample": True}, "greedily"), ({"num_beams": 2}, "num_beams"),
                          ({"temperature": 0.7, "top_k": 5}, "temperature, top_k"),
                          ({"max_length": tokens.shape[1]}, "no room"),
                          ({"max_new_tokens": 0}, "at least 1")):
        with pytest.raises((NotImplementedError, ValueError), match=match):
            model.generate(tokens, **kwargs)
    for bad, match in ((ones[:, 1:], r"\[batch, seen \+ seq\] = \[2, 12\]"),
                       (ones * 2, "1 \\(attend\\) and 0")):
        with pytest.raises(ValueError, match=match):
            model.generate(tokens, attention_mask=bad, max_new_tokens=2)
    with pytest.raises(TypeError, match="prompt once"):
        model.generate(tokens, input_ids=tokens)


def _left_padded(tokens):
    """Row 0 left-padded by 3 (pad id 0, masked), row 1 whole: a batch of two prompts."""
    ids, mask = tokens.clone(), torch.ones_like(tokens)
    ids[0, :3], mask[0, :3] = 0, 0
    return ids, mask


@pytest.mark.parametrize("shape, names", [((2, 2), ("dp", "tp")), ((2, 2), ("pp", "tp")),
                                          ((4,), ("dp",))])
def test_a_padded_batch_matches_transformers(live, hf_model, tokens, shape, names):
    """attention_mask with padding: the logits (pads included), the loss with the pads'
    labels -100, and generate on the left-padded prompts (each row's positions counted from
    its first token) are transformers'."""
    ids, mask = _left_padded(tokens)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = LlamaForCausalLM(hf_model.config, device_mesh=mesh)
    model.load_state_dict(hf_model.state_dict())
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        want = hf_model(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(model(ids, attention_mask=mask).logits.to_torch(), want.logits,
                               atol=1e-4, rtol=0)
    loss = model(ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(loss.to_torch(), want.loss, atol=1e-5, rtol=0)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=5)
    assert torch.equal(got, hf_model.generate(ids, attention_mask=mask, max_new_tokens=5,
                                              do_sample=False))
    # the padded row alone, unpadded, generates the same tokens (the pads change nothing)
    alone = model.generate(tokens[:1, 3:], max_new_tokens=5)
    assert torch.equal(got[0, 3:], alone[0])


def test_position_ids_as_transformers_takes_them(live, hf_model, tokens):
    """position_ids [1, seq] (broadcast over the batch) or [batch, seq] give transformers'
    logits on dp x tp; a wrong shape raises before anything is sent."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = LlamaForCausalLM(hf_model.config, device_mesh=mesh)
    model.load_state_dict(hf_model.state_dict())
    for positions in (torch.arange(3, 15)[None], torch.stack([torch.arange(12),
                                                              torch.arange(5, 17)])):
        with torch.no_grad():
            want = hf_model(tokens, position_ids=positions).logits
        torch.testing.assert_close(model(tokens, position_ids=positions).logits.to_torch(),
                                   want, atol=1e-4, rtol=0)
    dtorch.synchronize()
    before = session.get_controller().issued
    with pytest.raises(ValueError, match=r"position_ids must be \[batch or 1, seq\]"):
        model(tokens, position_ids=torch.arange(11)[None])
    assert session.get_controller().issued == before


def test_padding_with_a_context_parallel_dim_is_refused(live, hf_model, tokens):
    ids, mask = _left_padded(tokens)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "ring_cp"))
    model = LlamaForCausalLM(hf_model.config, device_mesh=mesh)
    with pytest.raises(NotImplementedError, match=r"context-parallel dims \['ring_cp'\]"):
        model(ids, attention_mask=mask)
    torch.testing.assert_close(model(ids, attention_mask=torch.ones_like(mask)).logits
                               .to_torch(), model(ids).logits.to_torch())


def test_tied_embeddings_and_rope_scaling(live, tokens):
    torch.manual_seed(2)
    config = transformers.LlamaConfig(**{**CONFIG, "tie_word_embeddings": True,
                                         "num_hidden_layers": 2,
                                         "rope_parameters": {"rope_type": "linear",
                                                             "factor": 2.0,
                                                             "rope_theta": 5000.0}})
    hf = transformers.LlamaForCausalLM(config).eval()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = LlamaForCausalLM(config, device_mesh=mesh)
    state = dict(hf.state_dict())
    state.pop("lm_head.weight")  # a tied checkpoint may leave the head out
    model.load_state_dict(state)
    assert torch.allclose(model(tokens).logits.to_torch(), hf_logits(hf, tokens), atol=1e-4)


def test_a_dict_config_and_dtensor_input_work(live, hf_model, tokens):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("tp",))
    model = LlamaForCausalLM(CONFIG, device_mesh=mesh)
    model.load_state_dict(hf_model.state_dict())
    ids = dtorch.distribute_tensor(tokens, mesh, [dtorch.Replicate()])
    assert torch.allclose(model(ids).logits.to_torch(), hf_logits(hf_model, tokens), atol=1e-4)


def test_heads_that_do_not_split_over_tp_raise(live):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("tp",))
    with pytest.raises(dtorch.nn.ModuleError, match="num_key_value_heads=2 does not split"):
        LlamaForCausalLM({**CONFIG, "num_key_value_heads": 2}, device_mesh=mesh)
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        LlamaForCausalLM({**CONFIG, "hidden_act": "gelu"}, device_mesh=mesh)


MESHES_8 = [((2, 2, 2), ("dp", "tp", "pp")), ((2, 2, 2), ("pp", "tp", "dp")),
            ((2, 2, 2), ("tp", "pp", "ring_cp"))]
COUNTS_8 = {"dp": {"all_gather": 2, "all_reduce": 10, "send_recv": 1},
            "ring_cp": {"all_gather": 2, "all_reduce": 10, "send_recv": 1 + 5, "all_to_all": 20}}


@pytest.mark.timeout(400)
def test_three_d_meshes_on_eight_ranks(other_cluster, hf_model, tokens):
    other_cluster(n_workers=8)
    for shape, names in MESHES_8:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model = LlamaForCausalLM(hf_model.config, device_mesh=mesh)
        model.load_state_dict(hf_model.state_dict())
        with dtorch.CommDebugMode() as mode:
            logits = model(tokens).logits
        assert mode.get_comm_counts() == COUNTS_8[names[-1] if "ring_cp" in names else "dp"]
        assert torch.allclose(logits.to_torch(), hf_logits(hf_model, tokens), atol=1e-4)
    assert torch.equal(model.generate(tokens, 4),
                       hf_model.generate(tokens, max_new_tokens=4, do_sample=False))
