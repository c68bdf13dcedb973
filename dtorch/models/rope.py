"""Rotary position embeddings, computed on the controller exactly as Hugging Face does
(float32 ``positions x inv_freq``, ``cat(freqs, freqs)``, cos/sin times the attention scaling).

>>> inv, scale = inverse_frequencies(_Cfg)
>>> inv.shape, scale
(torch.Size([4]), 1.0)
>>> cos, sin = cos_sin(inv, scale, 0, 2)
>>> tuple(cos.shape), float(cos[0, 0])
((2, 8), 1.0)
"""

from __future__ import annotations

import torch


def inverse_frequencies(settings) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)``; rope scaling types use transformers' functions."""
    if settings.rope_type == "default":
        dim = settings.head_dim
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (settings.rope_theta ** exponent), 1.0
    if settings.rope_type == "dynamic":
        raise NotImplementedError("dynamic rope scaling changes with the sequence length; "
                                  "dtorch's Llama supports default, linear, llama3, yarn and "
                                  "longrope scaling")
    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError as exc:
        raise ImportError(f"rope_type {settings.rope_type!r} needs the transformers package "
                          f"(pip install transformers)") from exc
    inv, scale = ROPE_INIT_FUNCTIONS[settings.rope_type](settings.source, "cpu")
    return inv.float(), float(scale)


def cos_sin(inv_freq: torch.Tensor, scaling: float, start: int, length: int):
    """cos and sin ``[length, head_dim]`` for positions ``start .. start + length - 1``."""
    return cos_sin_at(inv_freq, scaling, torch.arange(start, start + length))


def cos_sin_at(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor):
    """cos and sin ``[..., head_dim]`` for the positions ``[...]`` (each row its own, as
    transformers' ``position_ids`` of a padded batch).

    >>> cos, _ = cos_sin_at(torch.ones(2), 1.0, torch.tensor([[0, 1], [0, 0]]))
    >>> tuple(cos.shape), float(cos[1, 1, 0])
    ((2, 2, 4), 1.0)
    """
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


class _Cfg:  # for the doctest
    head_dim, rope_theta, rope_type = 8, 10000.0, "default"
