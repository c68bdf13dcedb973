"""The fields of a Llama config dtorch reads, from a ``transformers.LlamaConfig`` or a dict.

>>> s = llama_settings({"vocab_size": 101, "hidden_size": 64, "num_attention_heads": 8,
...                     "num_key_value_heads": 4, "intermediate_size": 176,
...                     "num_hidden_layers": 5})
>>> s.head_dim, s.rope_theta, s.tie_word_embeddings
(8, 10000.0, False)
"""

from __future__ import annotations

from typing import Any, NamedTuple


class LlamaSettings(NamedTuple):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    pad_token_id: int | None
    eos_token_id: Any
    source: Any  # the config as given (rope scaling functions read it)


_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
             "mlp_bias": False, "pad_token_id": None, "eos_token_id": None, "hidden_act": "silu"}


def _get(config, name, default=None):
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def llama_settings(config) -> LlamaSettings:
    """Read and check a config; unknown activation or head counts that do not divide raise."""
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")
    missing = [n for n in need if _get(config, n) is None]
    if missing:
        raise ValueError(f"the Llama config lacks {missing}")
    heads = int(_get(config, "num_attention_heads"))
    kv_heads = int(_get(config, "num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of "
                         f"num_key_value_heads ({kv_heads})")
    act = _get(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: dtorch's Llama implements SwiGLU with 'silu' only")
    rope = _get(config, "rope_parameters") or _get(config, "rope_scaling") or {}
    theta = rope.get("rope_theta", _get(config, "rope_theta", 10000.0))
    hidden = int(_get(config, "hidden_size"))
    return LlamaSettings(
        vocab_size=int(_get(config, "vocab_size")), hidden_size=hidden,
        intermediate_size=int(_get(config, "intermediate_size")),
        num_hidden_layers=int(_get(config, "num_hidden_layers")), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=int(_get(config, "head_dim") or hidden // heads),
        rms_norm_eps=float(_get(config, "rms_norm_eps", _DEFAULTS["rms_norm_eps"])),
        rope_theta=float(theta), rope_type=rope.get("rope_type", rope.get("type", "default")),
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings", False)),
        attention_bias=bool(_get(config, "attention_bias", False)),
        mlp_bias=bool(_get(config, "mlp_bias", False)),
        pad_token_id=_get(config, "pad_token_id"), eos_token_id=_get(config, "eos_token_id"),
        source=config)
