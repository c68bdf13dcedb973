"""Pipeline-stage helpers.

>>> assign_layers_to_stages(4, 2)
[0, 0, 1, 1]
>>> assign_layers_to_stages(5, 2)
[0, 0, 0, 1, 1]
"""

from __future__ import annotations


def assign_layers_to_stages(num_layers: int, num_stages: int) -> list[int]:
    """Stage number of each layer; layers split evenly, earlier stages take the extra ones."""
    for name, value in (("num_layers", num_layers), ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}")
    if num_stages > num_layers:
        raise ValueError(f"cannot spread {num_layers} layers over {num_stages} stages: every "
                         f"stage needs a layer; use at most {num_layers} stages")
    base, extra = divmod(num_layers, num_stages)
    out: list[int] = []
    for stage in range(num_stages):
        out += [stage] * (base + (1 if stage < extra else 0))
    return out
