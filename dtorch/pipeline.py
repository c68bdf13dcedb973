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


SCHEDULES = ("1F1B", "GPipe")


def stage_order(num_micro: int, num_stages: int, stage: int, schedule: str = "1F1B") -> list:
    """The order stage ``stage`` runs micro-batches' forwards ("F", k) and backwards ("B", k)
    in. 1F1B: ``num_stages - stage - 1`` forwards to fill the pipeline, then one forward and
    one backward in turn, then the backwards left (a stage keeps at most ``num_stages -
    stage`` micro-batches' activations); GPipe: every forward, then every backward.

    >>> stage_order(4, 2, 0)
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('F', 3), ('B', 2), ('B', 3)]
    >>> stage_order(4, 2, 1)
    [('F', 0), ('B', 0), ('F', 1), ('B', 1), ('F', 2), ('B', 2), ('F', 3), ('B', 3)]
    """
    for name, value in (("num_micro", num_micro), ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}")
    if schedule == "GPipe":
        return [("F", k) for k in range(num_micro)] + [("B", k) for k in range(num_micro)]
    if schedule != "1F1B":
        raise ValueError(f"schedule={schedule!r}: choose one of {SCHEDULES}")
    warmup = min(num_stages - stage - 1, num_micro)
    order = [("F", k) for k in range(warmup)]
    for k in range(warmup, num_micro):
        order += [("F", k), ("B", k - warmup)]
    return order + [("B", k) for k in range(num_micro - warmup, num_micro)]


def issue_order(num_micro: int, num_stages: int, schedule: str = "1F1B") -> list[tuple]:
    """One stream for the controller that gives every stage its ``stage_order``: events
    ``(kind, micro-batch, stage)`` sorted by when they could start if a backward took twice
    a forward (each rank runs its instructions in stream order, so a stage's own order is
    kept, and every event comes after what it needs).

    >>> issue_order(2, 2)
    [('F', 0, 0), ('F', 1, 0), ('F', 0, 1), ('B', 0, 1), ('B', 0, 0), ('F', 1, 1), ('B', 1, 1), ('B', 1, 0)]
    """
    orders = [stage_order(num_micro, num_stages, s, schedule) for s in range(num_stages)]
    done: dict = {}
    free = [0.0] * num_stages
    nxt = [0] * num_stages
    events = []
    while any(nxt[s] < len(orders[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            if nxt[s] == len(orders[s]):
                continue
            kind, k = orders[s][nxt[s]]
            needs = [("F", k, s - 1)] if kind == "F" and s > 0 else []
            if kind == "B":
                needs = [("F", k, s)] + ([("B", k, s + 1)] if s < num_stages - 1 else [])
            if any(n not in done for n in needs):
                continue
            start = max([free[s]] + [done[n] for n in needs])
            done[(kind, k, s)] = free[s] = start + (1.0 if kind == "F" else 2.0)
            events.append((start, s if kind == "F" else -s, (kind, k, s)))
            nxt[s] += 1
            progressed = True
        if not progressed:  # pragma: no cover - every schedule here is deadlock-free
            raise RuntimeError(f"the {schedule} schedule deadlocks")
    return [e for _, _, e in sorted(events)]


def pipeline_backward(stages, micro_batches, loss_fn, schedule: str = "1F1B") -> list:
    """Train on ``micro_batches`` through a pipeline of ``stages`` (callables: ``stages[0]``
    takes a micro-batch, each later one the output of the one before; ``loss_fn(output,
    micro_batch)`` returns a 0-dim loss DTensor). Each stage's forward and backward of each
    micro-batch is issued in ``schedule``'s order for that stage (``issue_order``): stage
    ``s`` runs the backward of micro-batch ``k`` while stage ``s + 1`` runs a later forward.
    Between stages the activation is cut (``detach().requires_grad_()``) and its gradient
    handed back (``backward(gradient=)``). Each loss is divided by ``len(micro_batches)``,
    so ``.grad`` accumulates the gradient of the mean loss (one batch's, for means over
    equal micro-batches). Returns the losses (unscaled, detached DTensors); nothing of a
    micro-batch's graph outlives its backward. Example::

        stages = [lambda mb: first_half(mb[0]), lambda h: second_half(h.redistribute(...))]
        losses = dtorch.pipeline_backward(stages, batches, lambda out, mb: F.mse_loss(out, mb[1]))
        opt.step(); opt.zero_grad()
    """
    from .tensor import DTensor
    stages, micro_batches = list(stages), list(micro_batches)
    n, last = len(micro_batches), len(stages) - 1
    inputs: dict = {}   # (k, s): the cut activation stage s started from
    outputs: dict = {}  # (k, s): what stage s gave (the last: the loss)
    losses: dict = {}
    for kind, k, s in issue_order(n, len(stages), schedule):
        if kind == "F":
            x = micro_batches[k] if s == 0 else _cut(outputs[(k, s - 1)], k, s)
            inputs[(k, s)] = x
            out = stages[s](x)
            if s == last:
                out = _checked_loss(loss_fn(out, micro_batches[k]), k, DTensor)
                losses[k] = out.detach()
            outputs[(k, s)] = out
        else:
            out = outputs.pop((k, s))
            if s == last:
                (out / n).backward()
            else:
                _hand_back(out, inputs.pop((k, s + 1)))
            if s == 0:
                inputs.pop((k, 0))
    return [losses[k] for k in range(n)]


def _cut(h, k: int, s: int):
    """Stage ``s``'s input: the previous stage's output as a leaf of its own graph (an
    output that does not require grad, a frozen stage's, goes on as it is)."""
    from .tensor import DTensor
    if not isinstance(h, DTensor):
        raise TypeError(f"stage {s - 1} gave micro-batch {k} a {type(h).__name__}; a stage "
                        f"must return the DTensor activation the next one takes")
    return h.detach().requires_grad_() if h.requires_grad else h


def _hand_back(out, cut) -> None:
    """Stage ``s``'s backward from the gradient its output's cut received (none when the
    next stage did not use it differentiably); the gradient is dropped once handed on."""
    from .autograd import backward
    if not out.requires_grad or cut.grad is None:
        return
    g, cut.grad = cut.grad, None
    backward([out], [g])


def _checked_loss(loss, k: int, DTensor):
    if not isinstance(loss, DTensor) or loss.ndim != 0:
        shape = tuple(getattr(loss, "shape", ()))
        raise TypeError(f"loss_fn must return a 0-dim loss DTensor; micro-batch {k} gave a "
                        f"{type(loss).__name__} of shape {shape}: reduce it (e.g. .mean())")
    if not loss.requires_grad:
        raise RuntimeError(f"micro-batch {k}'s loss does not require grad (no parameter "
                           f"took part, or torch.no_grad() is on)")
    return loss
