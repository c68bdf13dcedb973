"""``LlamaForCausalLM`` on a DeviceMesh: DP, TP, PP and CP from the mesh's dim names.

Written with dtorch.nn in seed 004's style; the same module and parameter names as Hugging
Face's ``LlamaForCausalLM``, so ``load_state_dict(hf_model.state_dict())`` loads as it is.

- ``tp``: q/k/v/gate/up are column parallel, o/down row parallel with a Replicate output (one
  all_reduce each), query and kv heads split across tp, the embedding sharded on its feature
  dim, the output head sharded on the vocabulary (logits gathered; kept sharded for the
  loss when ``labels`` are given);
- ``dp``: the batch is ``Shard(0)``;
- ``pp``: ``mesh.unbind("pp")`` stages, layers by ``assign_layers_to_stages``, activations
  moved point to point between stages;
- ``ring_cp`` / ``ulysses_cp`` (``ulysess_cp``): the sequence is ``Shard(1)`` of the hidden
  states (``Shard(2)`` of Q/K/V), and ``F.scaled_dot_product_attention`` runs ring or Ulysses
  attention.

Example::

    model = LlamaForCausalLM(config, device_mesh=init_device_mesh("cpu", (2, 2),
                                                                  mesh_dim_names=("pp", "tp")))
    model.load_state_dict(hf_model.state_dict())
    logits = model(input_ids).logits                 # a DTensor [batch, seq, vocab]
    out = model(input_ids, labels=input_ids)         # Hugging Face's shifted loss, -100 ignored
    out.loss.backward()                              # out.logits stay Shard(-1) on tp
    tokens = model.generate(input_ids, max_new_tokens=8)   # greedy, a torch LongTensor

With ``labels`` the loss is loss parallel on tp (``F.cross_entropy`` on the vocabulary-sharded
logits: no all_gather of the logits, 3 all_reduces of per-row scalars, a backward with no tp
collective) and a mean over the batch on dp (one all_reduce of the count of labels that are
not -100).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..factories import distribute_tensor
from ..graph import Graph
from ..pipeline import assign_layers_to_stages
from ..placement import Replicate, Shard
from ..tensor import DTensor
from .. import nn
from ..graph import mesh_or_default
from .llama_config import llama_settings
from . import pretrained
from .outputs import CausalLMOutput
from .rope import cos_sin, cos_sin_at, inverse_frequencies

CP_DIMS = ("ring_cp", "ulysses_cp", "ulysess_cp")
IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"


def activation_placements(mesh, sequence_sharded: bool = True) -> list:
    """Placements of ``[batch, seq, ...]`` activations: batch on dp, sequence on the cp dims."""
    names = mesh.mesh_dim_names or ("",) * mesh.ndim
    return [Shard(0) if n == "dp" else Shard(1) if n in CP_DIMS and sequence_sharded
            else Replicate() for n in names]


def _tp_size(mesh) -> int:
    idx = mesh.dim_name_index("tp") if mesh.mesh_dim_names else None
    return 1 if idx is None else mesh.shape[idx]


class LlamaKVCache:
    """Per layer, the keys and values seen so far: ``[batch, kv_heads, seen, head_dim]``
    DTensors sharded like the attention's K/V (batch on dp, heads on tp)."""

    def __init__(self):
        self.keys: dict[int, DTensor] = {}
        self.values: dict[int, DTensor] = {}
        self.length = 0

    def update(self, layer: int, k, v):
        """Append this step's ``k``/``v``; returns the whole keys and values."""
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def gather_sequence(self) -> None:
        """Make the cached sequence Replicate on the cp dims (decoding appends one token)."""
        for table in (self.keys, self.values):
            for layer, t in table.items():
                names = t.device_mesh.mesh_dim_names or ()
                dims = {n: Replicate() for n in names if n in CP_DIMS}
                if dims:
                    table[layer] = t.redistribute_by_dict(placements_dict=dims)


class LlamaAttention(nn.Module):
    def __init__(self, s, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = (s.num_attention_heads, s.num_key_value_heads,
                                                    s.head_dim)
        bias = s.attention_bias
        self.q_proj = nn.ColumnParallelLinear(s.hidden_size, self.heads * s.head_dim, bias)
        self.k_proj = nn.ColumnParallelLinear(s.hidden_size, self.kv_heads * s.head_dim, bias)
        self.v_proj = nn.ColumnParallelLinear(s.hidden_size, self.kv_heads * s.head_dim, bias)
        self.o_proj = nn.RowParallelLinearWithReplicateOutput(self.heads * s.head_dim,
                                                              s.hidden_size, bias)

    def forward(self, h, cos, sin, cache=None, mask=None):
        b, length = h.shape[0], h.shape[1]
        q = self.q_proj(h).view(b, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             is_causal=mask is None and length > 1,
                                             scale=self.head_dim ** -0.5,
                                             enable_gqa=self.heads != self.kv_heads)
        out = out.transpose(1, 2).reshape(b, length, self.heads * self.head_dim)
        return self.o_proj(out)


def rotate(x, cos, sin):
    """``x * cos + rotate_half(x) * sin`` (Hugging Face's ``apply_rotary_pos_emb``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaMLP(nn.Module):
    def __init__(self, s):
        super().__init__()
        bias = s.mlp_bias
        self.gate_proj = nn.ColumnParallelLinear(s.hidden_size, s.intermediate_size, bias)
        self.up_proj = nn.ColumnParallelLinear(s.hidden_size, s.intermediate_size, bias)
        self.down_proj = nn.RowParallelLinearWithReplicateOutput(s.intermediate_size,
                                                                 s.hidden_size, bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, s, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(s, layer_idx)
        self.mlp = LlamaMLP(s)
        self.input_layernorm = nn.RMSNorm(s.hidden_size, eps=s.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(s.hidden_size, eps=s.rms_norm_eps)

    def forward(self, h, cos, sin, cache=None, mask=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding on the first stage, decoder layers spread over the stages, norm on the last."""

    def __init__(self, s, stages, stage_of):
        super().__init__()
        guard = Graph.default_graph().device_mesh_guard
        with guard(stages[0]):
            self.embed_tokens = nn.EmbeddingWithReplicateOutput(s.vocab_size, s.hidden_size,
                                                                s.pad_token_id)
        self.layers = nn.ModuleList()
        for i in range(s.num_hidden_layers):
            with guard(stages[stage_of[i]]):
                self.layers.append(LlamaDecoderLayer(s, i))
        with guard(stages[-1]):
            self.norm = nn.RMSNorm(s.hidden_size, eps=s.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Hugging Face's ``LlamaForCausalLM`` on ``device_mesh``; see module doc."""

    def __init__(self, config, device_mesh=None):
        super().__init__()
        s = llama_settings(config)
        self.config = s
        self.config_source = config  # as given: what save_pretrained writes
        self.device_mesh = mesh_or_default(device_mesh)
        self.stages = self.device_mesh.unbind("pp")
        self.stage_of = assign_layers_to_stages(s.num_hidden_layers, len(self.stages))
        tp = _tp_size(self.stages[0])
        for name, n in (("num_attention_heads", s.num_attention_heads),
                        ("num_key_value_heads", s.num_key_value_heads)):
            if n % tp:
                raise nn.ModuleError(f"{name}={n} does not split over tp={tp}: use a tp size "
                                     f"that divides {n}")
        self.model = LlamaModel(s, self.stages, self.stage_of)
        with Graph.default_graph().device_mesh_guard(self.stages[-1]):
            self.lm_head = nn.ColumnParallelLinear(s.hidden_size, s.vocab_size, False)
        self._inv_freq, self._rope_scaling = inverse_frequencies(s)
        self._rope_cache: dict = {}

    from_pretrained = classmethod(pretrained.from_pretrained)
    save_pretrained = pretrained.save_pretrained

    def _rope(self, stage, start: int, length: int, sequence_sharded: bool):
        """cos/sin ``[1, 1, L, head_dim]`` on ``stage`` (Replicate: sliced locally under cp)."""
        key = (stage, start, length, sequence_sharded)
        if key not in self._rope_cache:
            if len(self._rope_cache) > 64:
                self._rope_cache.clear()
            cos, sin = cos_sin(self._inv_freq, self._rope_scaling, start, length)
            rep = [Replicate()] * stage.ndim
            self._rope_cache[key] = tuple(distribute_tensor(t[None, None], stage, rep)
                                          for t in (cos, sin))
        return self._rope_cache[key]

    def _per_row(self, stage, keys, position_ids, start: int, ids_shape) -> tuple:
        """cos/sin ``[batch, 1, seq, head_dim]`` at each row's positions and the boolean
        attention mask ``[batch, 1, seq, seen + seq]`` (causal, padded keys masked: what
        transformers gives SDPA), batch on dp; the mask is None without padding."""
        place = activation_placements(stage, False)
        rows, length = ids_shape
        positions = position_ids if position_ids is not None else \
            torch.arange(start, start + length)[None]
        cos, sin = (t[:, None] for t in cos_sin_at(self._inv_freq, self._rope_scaling,
                                                     positions))
        cos, sin = (distribute_tensor(t.expand(rows, -1, -1, -1).contiguous(), stage, place)
                    for t in (cos, sin))
        if keys is None:
            return cos, sin, None
        causal = torch.ones(length, start + length, dtype=torch.bool).tril(start)
        mask = causal[None, None] & keys[:, None, None, :]
        return cos, sin, distribute_tensor(mask, stage, place)

    def _check_no_cp(self, what: str) -> None:
        names = set(self.device_mesh.mesh_dim_names or ())
        if names & set(CP_DIMS):
            raise NotImplementedError(
                f"LlamaForCausalLM: {what} cannot go with the context-parallel dims "
                f"{sorted(names & set(CP_DIMS))} (each rank's block of the sequence would need "
                f"its rows' masks and positions); use a mesh without them, or right-pad the "
                f"batch without a mask (causal attention never looks ahead) and set the pads' "
                f"labels to -100")

    def _tokens(self, input_ids, sequence_sharded: bool):
        stage = self.stages[0]
        if isinstance(input_ids, DTensor):
            if input_ids.device_mesh != stage:
                input_ids = input_ids.redistribute(device_mesh=stage)
            return input_ids
        ids = torch.as_tensor(input_ids)
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq]; got shape {tuple(ids.shape)}")
        return distribute_tensor(ids, stage, activation_placements(stage, sequence_sharded))

    def forward(self, input_ids, attention_mask=None, labels=None, *, position_ids=None,
                cache: LlamaKVCache | None = None) -> CausalLMOutput:
        """transformers' ``forward``: ``.logits`` ``[batch, seq, vocab]`` (a DTensor on the last
        stage, Replicate on tp; ``Shard(-1)`` there when ``labels`` are given) and, given
        ``labels`` ``[batch, seq]``, ``.loss`` (see :func:`causal_lm_loss`). ``attention_mask``
        ``[batch, seen + seq]`` (1: attend, 0: padding) masks the padded keys as transformers
        does; ``position_ids`` ``[batch, seq]`` (default: the positions in the sequence) set
        each row's rotary positions. Neither goes with a context-parallel dim."""
        start = cache.length if cache is not None else 0
        keys = _padding_mask(attention_mask, _shape(input_ids), start)
        if position_ids is not None:
            position_ids = _positions(position_ids, _shape(input_ids))
        if labels is not None and _shape(labels) != _shape(input_ids):
            raise ValueError(f"labels must have input_ids' shape {_shape(input_ids)}; got "
                             f"{_shape(labels)}")
        per_row = keys is not None or position_ids is not None
        if per_row:
            self._check_no_cp("an attention_mask with padding or position_ids")
        sequence_sharded = start == 0
        ids = self._tokens(input_ids, sequence_sharded)
        length = ids.shape[1]
        h = self.model.embed_tokens(ids)
        extras: dict = {}  # stage -> (cos, sin, mask) when rows differ
        for i, layer in enumerate(self.model.layers):
            stage = self.stages[self.stage_of[i]]
            h = h.redistribute(device_mesh=stage)
            if per_row:
                if stage not in extras:
                    extras[stage] = self._per_row(stage, keys, position_ids, start, ids.shape)
                cos, sin, mask = extras[stage]
                h = layer(h, cos, sin, cache, mask)
                continue
            cos, sin = self._rope(stage, start, length, sequence_sharded)
            h = layer(h, cos, sin, cache)
        if cache is not None:
            cache.length += length
        h = self.model.norm(h.redistribute(device_mesh=self.stages[-1]))
        return self._output(self.lm_head(h), labels, sequence_sharded)

    def pipeline_stages(self) -> list:
        """One callable per pipeline stage, for :func:`dtorch.pipeline_backward`: the first
        takes input ids ``[batch, seq]`` (a torch tensor or a DTensor), each one but the last
        ends by sending its hidden states to the next stage, the last returns the logits
        (vocabulary-sharded on tp, as with ``labels=``); score them with :meth:`lm_loss`::

            losses = dtorch.pipeline_backward(model.pipeline_stages(), ids.chunk(4),
                                              model.lm_loss)
        """
        return [functools.partial(self._stage_forward, s) for s in range(len(self.stages))]

    def _stage_forward(self, s: int, x):
        stage = self.stages[s]
        h = self.model.embed_tokens(self._tokens(x, True)) if s == 0 else x
        cos, sin = self._rope(stage, 0, h.shape[1], True)
        for i, layer in enumerate(self.model.layers):
            if self.stage_of[i] == s:
                h = layer(h.redistribute(device_mesh=stage), cos, sin, None)
        if s + 1 < len(self.stages):
            return h.redistribute(device_mesh=self.stages[s + 1])
        return self.lm_head(self.model.norm(h))

    def lm_loss(self, logits, labels):
        """The loss ``forward(ids, labels=labels)`` gives, from the last stage's logits:
        Hugging Face's shifted next-token loss (-100 ignored)."""
        return causal_lm_loss(logits, self._shifted_labels(labels, True))

    def _output(self, logits, labels, sequence_sharded: bool) -> CausalLMOutput:
        """Without labels, the logits gathered on tp; with them, the loss of the logits as
        the head left them (the vocabulary sharded on tp: loss parallel)."""
        if labels is None:
            return CausalLMOutput(logits=logits.redistribute_by_dict(
                placements_dict={"tp": Replicate()}))
        shifted = self._shifted_labels(labels, sequence_sharded)
        return CausalLMOutput(loss=causal_lm_loss(logits, shifted), logits=logits)

    def _shifted_labels(self, labels, sequence_sharded: bool):
        """Hugging Face's shift (token ``i`` predicts label ``i + 1``; the last predicts
        nothing): a torch tensor is shifted here and sent like the activations; a DTensor is
        shifted on the ranks. Both on the last stage."""
        stage = self.stages[-1]
        if isinstance(labels, DTensor):
            if labels.device_mesh != stage:
                labels = labels.redistribute(device_mesh=stage)
            return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
        shifted = F.pad(torch.as_tensor(labels), (0, 1), value=IGNORE_INDEX)[..., 1:]
        return distribute_tensor(shifted.contiguous(), stage,
                                 activation_placements(stage, sequence_sharded))

    def _load_from_state_dict(self, state_dict, prefix, *args):
        head, embed = prefix + "lm_head.weight", prefix + "model.embed_tokens.weight"
        if self.config.tie_word_embeddings and head not in state_dict and embed in state_dict:
            state_dict[head] = state_dict[embed]  # a tied checkpoint may omit the head
        super()._load_from_state_dict(state_dict, prefix, *args)

    @torch.no_grad()
    def generate(self, inputs=None, max_new_tokens: int | None = None, *, input_ids=None,
                 attention_mask=None, do_sample: bool = False, max_length: int | None = None,
                 eos_token_id=None, pad_token_id=None, **sampling):
        """Greedy decoding with a sharded KV cache, called as transformers' ``generate``:
        returns ``[batch, seq + new]`` token ids, the same as ``generate(do_sample=False)``
        (finished rows padded). ``max_new_tokens`` (or ``max_length``; transformers' default
        ``max_length=20``), ``attention_mask`` (a left-padded batch: its pads masked, each
        row's positions counted from its first token, as transformers does), ``eos_token_id``,
        ``pad_token_id``; sampling and beam search raise."""
        ids = _generate_inputs(inputs, input_ids)
        _check_greedy(do_sample, sampling)
        keys = _padding_mask(attention_mask, tuple(ids.shape), 0)
        max_new_tokens = _new_tokens(max_new_tokens, max_length, ids.shape[1])
        eos = _ids(eos_token_id if eos_token_id is not None else self.config.eos_token_id)
        pad = pad_token_id if pad_token_id is not None else (
            self.config.pad_token_id if self.config.pad_token_id is not None else
            (eos[0] if eos else None))
        cache = LlamaKVCache()
        mask = positions = None
        if keys is not None:  # transformers' position_ids: each row counts its own tokens
            mask = keys.long()
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        logits = self(ids, attention_mask=mask, position_ids=positions, cache=cache).logits
        cache.gather_sequence()
        done = torch.zeros(ids.shape[0], dtype=torch.bool)
        out = ids
        for step in range(max_new_tokens):
            # argmax on the ranks: [batch, seq] ids come back, not [batch, seq, vocab] logits
            nxt = logits.argmax(-1).to_torch()[:, -1]
            if eos:
                nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
                done |= torch.isin(nxt, torch.tensor(eos))
            out = torch.cat([out, nxt[:, None]], dim=1)
            if (eos and bool(done.all())) or step == max_new_tokens - 1:
                break
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                positions = positions[:, -1:] + 1
            logits = self(nxt[:, None], attention_mask=mask, position_ids=positions,
                          cache=cache).logits
        return out


def causal_lm_loss(logits, shifted_labels):
    """transformers' ``ForCausalLMLoss`` on DTensors: ``F.cross_entropy`` of the float logits
    with -100 ignored, the mean over the labelled tokens (loss parallel where the vocabulary
    is sharded). transformers flattens to ``[tokens, vocab]``; here the logits are
    ``[batch, vocab, seq]`` (torch's ``(N, C, d1)`` form: the same mean), so a batch on dp and
    a sequence on a cp dim stay sharded as they are."""
    return F.cross_entropy(logits.float().transpose(1, 2), shifted_labels,
                           ignore_index=IGNORE_INDEX)


def _shape(tokens) -> tuple[int, ...]:
    return tuple(tokens.shape) if hasattr(tokens, "shape") else tuple(torch.as_tensor(
        tokens).shape)


def _padding_mask(attention_mask, ids_shape, start: int):
    """transformers' ``attention_mask`` ``[batch, start + seq]`` as a boolean key mask, or
    None when it masks nothing (None or all ones)."""
    if attention_mask is None:
        return None
    mask = torch.as_tensor(attention_mask.to_torch() if isinstance(attention_mask, DTensor)
                           else attention_mask)
    want = (ids_shape[0], start + ids_shape[1])
    if tuple(mask.shape) != want:
        raise ValueError(f"attention_mask must be [batch, seen + seq] = {list(want)} (the "
                         f"cached tokens and these); got {list(mask.shape)}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask holds 1 (attend) and 0 (padding) only")
    return None if bool((mask == 1).all()) else mask.bool()


def _positions(position_ids, ids_shape) -> torch.Tensor:
    """transformers' ``position_ids``: ``[batch or 1, seq]``, checked on the controller."""
    rows, length = ids_shape[0], ids_shape[-1]
    pos = torch.as_tensor(position_ids.to_torch() if isinstance(position_ids, DTensor)
                          else position_ids)
    if pos.dim() != 2 or pos.shape[0] not in (1, rows) or pos.shape[1] != length:
        raise ValueError(f"position_ids must be [batch or 1, seq] = [{rows} or 1, {length}]; "
                         f"got {list(pos.shape)}")
    return pos


def _generate_inputs(inputs, input_ids) -> torch.Tensor:
    """The prompt ``[batch, seq]`` of a ``generate`` call (``inputs`` or ``input_ids=``)."""
    if (inputs is None) == (input_ids is None):
        raise TypeError("generate() takes the prompt once: generate(input_ids) or "
                        "generate(input_ids=...)")
    ids = inputs if inputs is not None else input_ids
    ids = torch.as_tensor(ids.to_torch() if isinstance(ids, DTensor) else ids)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq]; got shape {tuple(ids.shape)}")
    return ids


GREEDY_DEFAULTS = {"num_beams": 1, "num_return_sequences": 1, "use_cache": True}


def _check_greedy(do_sample: bool, sampling: dict) -> None:
    """Only greedy decoding: ``do_sample=True``, beams and sampling knobs raise, by name."""
    if do_sample:
        raise NotImplementedError("LlamaForCausalLM.generate decodes greedily only; pass "
                                  "do_sample=False (or leave it out)")
    unsupported = sorted(k for k, v in sampling.items() if GREEDY_DEFAULTS.get(k, object()) != v)
    if unsupported:
        raise NotImplementedError(
            f"LlamaForCausalLM.generate does not support {', '.join(unsupported)}: it takes "
            f"max_new_tokens / max_length, attention_mask, do_sample=False, eos_token_id and "
            f"pad_token_id (greedy decoding, its own KV cache)")


def _new_tokens(max_new_tokens, max_length, prompt_length: int) -> int:
    """How many tokens to generate: ``max_new_tokens``, else ``max_length`` minus the prompt
    (transformers' default ``max_length`` is 20)."""
    if max_new_tokens is not None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1; got {max_new_tokens}")
        return int(max_new_tokens)
    length = 20 if max_length is None else int(max_length)
    if length <= prompt_length:
        raise ValueError(f"max_length={length} leaves no room after the {prompt_length}-token "
                         f"prompt; pass max_new_tokens")
    return length - prompt_length


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
