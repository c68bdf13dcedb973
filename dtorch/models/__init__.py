"""Complete models written with dtorch.nn (seed 004's Llama).

``from dtorch.models import LlamaForCausalLM`` needs no ``transformers``; its config may be a
``transformers.LlamaConfig`` or a dict with the same fields.
"""

from .llama import LlamaForCausalLM, LlamaKVCache

__all__ = ["LlamaForCausalLM", "LlamaKVCache"]
