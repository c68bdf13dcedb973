"""Hugging Face checkpoints for ``dtorch.models``: ``from_pretrained`` reads a
``model.safetensors`` file or a sharded directory (``model.safetensors.index.json``) with
every rank reading only its own block of each tensor (``safetensors_blocks``: the block's
byte runs, on the rank, from the file: never the whole tensor or file, never through the
controller); and
``save_pretrained`` writes what transformers' ``from_pretrained`` reads (``config.json`` and
``model.safetensors``, gathered one tensor at a time). Example::

    model = dtorch.models.LlamaForCausalLM.from_pretrained("path/", device_mesh=mesh)
    model.save_pretrained("out/")      # transformers.LlamaForCausalLM.from_pretrained("out/")
"""

from __future__ import annotations

import json
import os

import torch

from .. import layout
from ..runtime import messages as m
from .safetensors_blocks import read_block, read_header

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def weight_files(path: str) -> dict[str, str]:
    """``{tensor name: file}`` of a Hugging Face model directory (one file or sharded).

    >>> import tempfile; d = tempfile.mkdtemp()
    >>> try:
    ...     weight_files(d)
    ... except FileNotFoundError as e:
    ...     print(str(e).split(";")[0].split(": ")[-1])
    neither model.safetensors nor model.safetensors.index.json
    """
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, SINGLE)
    if os.path.exists(single):
        return {k: single for k in read_header(single)}
    raise FileNotFoundError(f"no Hugging Face weights in {path}: neither {SINGLE} nor {INDEX}; "
                            f"give a directory transformers' save_pretrained wrote (.bin "
                            f"checkpoints are not read)")


def read_rank_block(coord, *, file: str, key: str, shape: tuple, mesh, placements, dtype):
    """Rank side: this rank's block of tensor ``key`` read from ``file`` (only the block's
    bytes are touched), cast to ``dtype``; zeros where a Partial('sum') holds nothing."""
    block = layout.rank_block(shape, mesh, placements, coord)
    if not layout.holds_value(mesh, placements, coord):
        return torch.zeros(block.shape, dtype=dtype)
    return read_block(file, _header(file)[key], block.slices()).to(dtype)


_HEADERS: dict = {}  # (file, size, mtime) -> header, on a rank while it reads a checkpoint


def _header(file: str) -> dict:
    st = os.stat(file)
    key = (file, st.st_size, st.st_mtime_ns)
    if key not in _HEADERS:
        if len(_HEADERS) > 64:
            _HEADERS.clear()
        _HEADERS[key] = read_header(file)
    return _HEADERS[key]


def from_pretrained(cls, path, device_mesh=None, **config_overrides):
    """``cls(config, device_mesh)`` with every parameter read on the ranks from the
    checkpoint at ``path`` (its ``config.json``, with ``config_overrides``)."""
    from ..local_call import run_local
    from ..tensor import DTensor
    from ..spec import make_spec
    path = os.fspath(path)
    files = weight_files(path)
    model = cls(_config(path, config_overrides), device_mesh=device_mesh)
    for key, current in _checked_targets(model, files, path).items():
        if isinstance(current, DTensor):
            spec = make_spec(current.shape, current.dtype, current.device_mesh,
                             current.placements)
            value, = run_local(read_rank_block, (m.Coord(spec.mesh),),
                               {"file": files[key], "key": key, "shape": spec.shape,
                                "mesh": spec.mesh, "placements": spec.placements,
                                "dtype": spec.dtype}, [spec], mesh=spec.mesh)
        else:  # a plain tensor of the model: read here, whole
            info = read_header(files[key])[key]
            value = read_block(files[key], info, tuple(slice(0, n) for n in info.shape))
        model.load_state_dict({key: value}, strict=False)  # one at a time: each initial
    return model                                          # value is freed as it is replaced


def _checked_targets(model, files: dict, path: str) -> dict:
    """The model's tensors to read, once every key and shape is checked against the files'
    headers (no weight is read before; the model's own init has been sent)."""
    import warnings
    shapes = _shapes(files)
    tied = getattr(model.config, "tie_word_embeddings", False)
    targets, missing = {}, []
    for key, current in model.state_dict().items():
        if key not in files:
            if not (tied and key == "lm_head.weight"):  # a tied head is the embedding
                missing.append(key)
            continue
        if key not in shapes:
            raise KeyError(f"{path}'s index puts {key} in {os.path.basename(files[key])}, "
                           f"which does not hold it: the directory is damaged")
        if shapes[key] != tuple(current.shape):
            raise ValueError(f"{key} has shape {shapes[key]} in {path}, the model "
                             f"{tuple(current.shape)}: the config does not match the weights")
        targets[key] = current
    if missing:
        raise KeyError(f"{path} has no {', '.join(missing[:5])}"
                       f"{f' (and {len(missing) - 5} more)' if len(missing) > 5 else ''}: "
                       f"the weights are another model's")
    unused = sorted(set(files) - set(targets) - {"lm_head.weight"})
    if unused:
        warnings.warn(f"{path} holds {len(unused)} tensors the model has no place for, e.g. "
                      f"{unused[:3]} (not read)", stacklevel=3)
    return targets


def _config(path: str, overrides: dict):
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise FileNotFoundError(f"no config.json in {path}; give the directory transformers' "
                                f"save_pretrained wrote")
    try:
        from transformers import AutoConfig
    except ImportError:  # a dict of the same fields serves as well
        with open(config_file) as f:
            return {**json.load(f), **overrides}
    return AutoConfig.from_pretrained(path, **overrides)


def _shapes(files: dict) -> dict[str, tuple]:
    """Every tensor's shape, from the files' headers (no tensor data read)."""
    return {key: info.shape for file in sorted(set(files.values()))
            for key, info in read_header(file).items()}


def save_pretrained(model, path) -> None:
    """Write ``config.json`` and ``model.safetensors`` (each tensor gathered to the
    controller in turn) as transformers' ``save_pretrained`` does."""
    from safetensors.torch import save_file
    from ..tensor import DTensor
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for key, value in model.state_dict().items():
        tensor = value.to_torch() if isinstance(value, DTensor) else value
        tensors[key] = tensor.detach().contiguous()
    config = model.config_source
    if getattr(model.config, "tie_word_embeddings", False):
        head, embedding = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
        if head is not None and embedding is not None and torch.equal(head, embedding):
            del tensors["lm_head.weight"]  # still tied: transformers ties it again
        else:  # trained apart (dtorch's head is a parameter of its own): written, untied
            config = _untied(config)
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(path)
    else:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(dict(config), f, indent=2)
    save_file(tensors, os.path.join(path, SINGLE), metadata={"format": "pt"})


def _untied(config):
    """A copy of ``config`` with ``tie_word_embeddings=False``."""
    import copy
    if isinstance(config, dict):
        return {**config, "tie_word_embeddings": False}
    config = copy.deepcopy(config)
    config.tie_word_embeddings = False
    return config
