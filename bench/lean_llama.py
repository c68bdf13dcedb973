"""A lean Llama in plain ``torch.nn``: ``dtorch/models/llama.py`` op for op, without dtorch.

The reference side of the Llama benches runs this model, so both sides execute the same model
definition and a ratio measures the framework, not the model code (transformers' generic
``LlamaForCausalLM`` adds mask building, output objects and cache plumbing). The same structure
and the same Hugging Face parameter names as dtorch's model (``load_state_dict(hf.state_dict())``
loads as it is): an embedding, per layer ``RMSNorm`` -> q/k/v projections -> rotary ->
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=...)`` -> o projection -> residual,
``RMSNorm`` -> SwiGLU MLP -> residual; the final ``RMSNorm`` and ``lm_head``.

Two things differ from dtorch's code, both to run under PyTorch's ``parallelize_module``
unchanged: the head counts come from the projections' outputs (``view(b, L, -1, head_dim)``:
a ColwiseParallel projection hands back this rank's heads as a plain tensor), and a pipeline
stage is this model with the modules it does not hold set to None (``stage``).

Default rotary only (no rope scaling), no KV cache: the benches' configs need no more.

>>> cfg = dict(vocab_size=32, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
...            intermediate_size=24, num_hidden_layers=2)
>>> LeanLlamaForCausalLM(cfg)(torch.zeros(1, 5, dtype=torch.long)).shape
torch.Size([1, 5, 32])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _get(config, name, default=None):
    """``config[name]`` of a dict or ``config.name`` of a ``transformers.LlamaConfig``."""
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    return default if value is None else value


def rope_theta(config) -> float:
    """The rotary base: ``rope_parameters`` (transformers v5), ``rope_theta`` (v4), 10000."""
    params = _get(config, "rope_parameters") or _get(config, "rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise NotImplementedError(f"the lean Llama has default rotary only, not {kind!r}")
    return float(params.get("rope_theta", _get(config, "rope_theta", 10000.0)))


class Settings:
    """The config fields the lean model reads (the defaults are transformers' LlamaConfig's)."""

    def __init__(self, config):
        self.vocab_size = int(_get(config, "vocab_size"))
        self.hidden_size = int(_get(config, "hidden_size"))
        self.intermediate_size = int(_get(config, "intermediate_size"))
        self.num_hidden_layers = int(_get(config, "num_hidden_layers"))
        self.heads = int(_get(config, "num_attention_heads"))
        self.kv_heads = int(_get(config, "num_key_value_heads", self.heads))
        self.head_dim = int(_get(config, "head_dim", self.hidden_size // self.heads))
        self.eps = float(_get(config, "rms_norm_eps", 1e-6))
        self.rope_theta = rope_theta(config)
        self.pad_token_id = _get(config, "pad_token_id")


def rotate(x, cos, sin):
    """``x * cos + rotate_half(x) * sin`` (as dtorch's model and Hugging Face's)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    def __init__(self, s: Settings):
        super().__init__()
        self.head_dim, self.gqa = s.head_dim, s.heads != s.kv_heads
        self.q_proj = nn.Linear(s.hidden_size, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden_size, bias=False)

    def forward(self, h, cos, sin):
        b, length, e = h.shape[0], h.shape[1], self.head_dim
        q = self.q_proj(h).view(b, length, -1, e).transpose(1, 2)
        k = self.k_proj(h).view(b, length, -1, e).transpose(1, 2)
        v = self.v_proj(h).view(b, length, -1, e).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=length > 1, scale=e ** -0.5,
                                             enable_gqa=self.gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


class LlamaMLP(nn.Module):
    def __init__(self, s: Settings):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, s: Settings):
        super().__init__()
        self.self_attn = LlamaAttention(s)
        self.mlp = LlamaMLP(s)
        self.input_layernorm = nn.RMSNorm(s.hidden_size, eps=s.eps)
        self.post_attention_layernorm = nn.RMSNorm(s.hidden_size, eps=s.eps)

    def forward(self, h, cos, sin):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, s: Settings):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size, s.pad_token_id)
        self.layers = nn.ModuleList(LlamaDecoderLayer(s) for _ in range(s.num_hidden_layers))
        self.norm = nn.RMSNorm(s.hidden_size, eps=s.eps)


class LeanLlamaForCausalLM(nn.Module):
    """``forward(ids) -> logits [batch, seq, vocab]``; see the module doc.

    A pipeline stage (``stage(first, last)``) without the embedding takes hidden states
    ``[batch, seq, hidden]`` instead of ids, and one without ``lm_head`` returns hidden states.
    """

    def __init__(self, config):
        super().__init__()
        self.settings = s = Settings(config)
        self.model = LlamaModel(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        exponent = torch.arange(0, s.head_dim, 2, dtype=torch.int64).float() / s.head_dim
        self.inv_freq = 1.0 / (s.rope_theta ** exponent)
        self._rope_cache: dict = {}

    def stage(self, layers: slice, first: bool, last: bool) -> "LeanLlamaForCausalLM":
        """This model cut to a pipeline stage: the decoder layers ``layers``, the embedding if
        ``first``, the final norm and ``lm_head`` if ``last`` (the others dropped). In place."""
        self.model.layers = nn.ModuleList(self.model.layers[layers])
        if not first:
            self.model.embed_tokens = None
        if not last:
            self.model.norm = self.lm_head = None
        return self

    def _rope(self, length: int):
        """cos/sin ``[1, 1, L, head_dim]``, cached per length (dtorch's model caches them too)."""
        if length not in self._rope_cache:
            positions = torch.arange(length, dtype=torch.float32)
            freqs = positions[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_cache[length] = (emb.cos()[None, None], emb.sin()[None, None])
        return self._rope_cache[length]

    def forward(self, x):
        h = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x
        cos, sin = self._rope(h.shape[1])
        for layer in self.model.layers:
            h = layer(h, cos, sin)
        if self.lm_head is None:
            return h
        return self.lm_head(self.model.norm(h))
