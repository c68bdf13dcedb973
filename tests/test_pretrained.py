"""Hugging Face checkpoints: ``dtorch.models.LlamaForCausalLM.from_pretrained`` on a sharded
safetensors directory written by transformers' ``save_pretrained`` gives transformers'
logits, and each rank reads about 1/tp of the files (measured from outside dtorch: the
rank process's ``read_bytes`` on a cold page cache); ``save_pretrained`` writes what
transformers reads back."""

from __future__ import annotations

import os

import pytest
import torch

import dtorch
from dtorch import init_device_mesh
from dtorch.models import LlamaForCausalLM
from dtorch.runtime import session

transformers = pytest.importorskip("transformers")

# big MLP blocks (gate/up Shard(0) rows, down Shard(1) rows of 32 KB), a small vocabulary:
# almost every byte is in a tensor whose rank blocks span whole pages
CONFIG = dict(vocab_size=128, hidden_size=256, intermediate_size=8192, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
              rms_norm_eps=1e-6, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    path = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(path, max_shard_size="10MB")  # a sharded directory
    assert (path / "model.safetensors.index.json").exists()
    return path, model


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def _drop_from_page_cache(files) -> None:
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_from_pretrained_reads_each_rank_s_blocks_and_gives_transformers_logits(live, hf_dir):
    path, hf = hf_dir
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("tp",))
    files = sorted(str(p) for p in path.glob("*.safetensors"))
    total = sum(os.path.getsize(f) for f in files)
    c = session.get_controller()
    workers = [r.address for r in c.ranks]
    _drop_from_page_cache(files)
    before = c.client.run(_read_bytes, workers=workers)
    model = LlamaForCausalLM.from_pretrained(path, device_mesh=mesh)
    dtorch.synchronize()
    after = c.client.run(_read_bytes, workers=workers)
    shares = [(after[w] - before[w]) / total for w in workers]
    assert all(0.15 < s < 0.4 for s in shares), shares  # about 1/4 each, not the whole
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 9))
    torch.testing.assert_close(model(tokens).logits.to_torch(), _logits(hf, tokens),
                               atol=1e-4, rtol=1e-4)


def test_save_pretrained_is_what_transformers_reads(live, hf_dir, tmp_path):
    path, hf = hf_dir
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = LlamaForCausalLM.from_pretrained(path, device_mesh=mesh)
    model.save_pretrained(tmp_path / "out")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 9))
    torch.testing.assert_close(_logits(back, tokens), _logits(hf, tokens), atol=1e-5, rtol=1e-5)


def test_what_from_pretrained_refuses(live, hf_dir, tmp_path):
    path, _ = hf_dir
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("tp",))
    c = session.get_controller()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        LlamaForCausalLM.from_pretrained(tmp_path, device_mesh=mesh)
    other = {**CONFIG, "intermediate_size": 4096}
    before = c.issued
    LlamaForCausalLM(transformers.LlamaConfig(**other), device_mesh=mesh)
    init_only = c.issued - before
    before = c.issued
    with pytest.raises(ValueError, match="config does not match the weights"):
        LlamaForCausalLM.from_pretrained(path, device_mesh=mesh, intermediate_size=4096)
    assert c.issued - before == init_only  # the model's own init; no read was sent


def test_a_tied_checkpoint_loads_and_saves_tied_and_a_trained_head_untied(live, tmp_path):
    tied = dict(CONFIG, intermediate_size=64, tie_word_embeddings=True)
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tied)).eval()
    hf.save_pretrained(tmp_path / "tied")
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("tp",))
    model = LlamaForCausalLM.from_pretrained(tmp_path / "tied", device_mesh=mesh)
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 9))
    torch.testing.assert_close(model(tokens).logits.to_torch(), _logits(hf, tokens),
                               atol=1e-4, rtol=1e-4)
    model.save_pretrained(tmp_path / "same")  # the head still equals the embedding
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "same").eval()
    assert back.config.tie_word_embeddings
    torch.testing.assert_close(_logits(back, tokens), _logits(hf, tokens), atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # as if trained: dtorch's head is a parameter of its own
        model.lm_head.weight.mul_(2)
    model.save_pretrained(tmp_path / "apart")
    apart = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "apart").eval()
    assert not apart.config.tie_word_embeddings
    torch.testing.assert_close(apart.lm_head.weight, 2 * hf.lm_head.weight)
