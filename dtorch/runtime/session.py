"""The process-wide session: ``dtorch.init / cluster_info / synchronize / shutdown / restart``.

The first DTensor op calls ``init()`` with defaults. Example::

    >>> import dtorch                                       # doctest: +SKIP
    >>> dtorch.init(n_workers=4)                            # doctest: +SKIP
    >>> dtorch.cluster_info()["ranks"]                      # doctest: +SKIP
    4
"""

from __future__ import annotations

import atexit
import os
import secrets
import time

from .. import config
from ..errors import ClusterError
from .fanout import fanout_setting
from .controller import Controller
from . import messages as m

_controller: Controller | None = None
_init_args: dict | None = None

# Callbacks ``hook(event, info)`` told about cluster starts (the Jupyter kernel's progress
# display and worker-output forwarding): "starting" (info: n_workers, address, device_type),
# then "ready" (info: controller, seconds) or "failed" (info: error). A hook never breaks init.
start_hooks: list = []
# fn(controller) -> how many of its live DTensors a cache holds (not the user's: cached
# constants); a different cluster may replace one whose only live DTensors these are
cache_holders: list = []


def _notify(event: str, **info) -> None:
    for hook in list(start_hooks):
        try:
            hook(event, info)
        except Exception:  # noqa: BLE001 - a display problem must not stop the cluster
            pass


def _collective_timeout() -> float:
    return float(os.environ.get("DTORCH_COLLECTIVE_TIMEOUT", "60"))


def init(n_workers: int | None = None, address: str | None = None,
         device_type: str | None = None, dry_run: bool = False,
         scheduler_file: str | None = None, **dask_kwargs) -> Controller:
    """Start the embedded cluster (or join ``address``, or the scheduler a ``dask scheduler
    --scheduler-file`` wrote) and bring up one rank per worker.

    ``security``: the embedded cluster's TLS (default on; ``False`` for plain TCP), or a
    ``distributed.security.Security`` for a ``tls://`` cluster (without it, Dask's
    configuration's certificates, e.g. ``DASK_DISTRIBUTED__COMM__TLS__CA_FILE``, are used).
    ``device_type`` is ``"cpu"`` unless given. Calling it again with arguments the running
    cluster satisfies (same size, device type, address) returns it; asking for a different
    cluster while DTensors are alive raises, otherwise the old one is shut down first.
    ``dry_run=True`` starts no workers: batches for ``n_workers`` ranks are built and measured
    (``dtorch.rank_stats()``), not sent (see :mod:`dtorch.runtime.dry_run`).
    """
    global _controller, _init_args
    from .cluster import check_dask_kwargs  # Dask is imported when a cluster is asked for
    if scheduler_file is not None:
        address = _address_in(scheduler_file, address)
    if device_type not in (None, "cpu", "cuda"):
        raise ClusterError(f"device_type must be 'cpu' or 'cuda'; got {device_type!r}")
    check_dask_kwargs(dask_kwargs, remote=address is not None)
    args = dict(n_workers=n_workers, address=address, device_type=device_type, **dask_kwargs)
    if dry_run:
        args["dry_run"] = True
    if _controller is not None and not _controller.closed:
        if _same_cluster(_controller, n_workers, address, device_type, dask_kwargs, dry_run):
            return _controller
        alive = _controller.live_tensors - sum(h(_controller) for h in cache_holders)
        if alive > 0:
            raise ClusterError(
                f"dtorch is already running {_controller.world} {_controller.device_type} ranks "
                f"with {alive} DTensors alive; delete them or call "
                f"dtorch.shutdown() before dtorch.init(...) with a different cluster")
        shutdown()
    if dry_run:
        from .dry_run import DryRunController
        _controller = DryRunController(n_workers or config.default_workers(),
                                       device_type or "cpu", fanout_setting())
        config.set_running_world_size(_controller.world)
        _init_args = args
        return _controller
    started = time.monotonic()
    _notify("starting", n_workers=n_workers, address=address, device_type=device_type)
    _init_args = args  # restart() retries these, also after a start that failed
    try:
        _controller = _start(n_workers, address, device_type or "cpu", dask_kwargs)
    except BaseException as exc:
        _notify("failed", error=exc)
        raise
    _notify("ready", controller=_controller, seconds=time.monotonic() - started)
    return _controller


def _address_in(scheduler_file, address: str | None) -> str:
    """The scheduler address a ``--scheduler-file`` holds (ClusterError when unreadable)."""
    import json
    if address is not None:
        raise ClusterError("give address= or scheduler_file=, not both")
    try:
        return json.loads(open(scheduler_file).read())["address"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ClusterError(f"cannot read a scheduler address from {scheduler_file!r} ({exc}); "
                           f"it is the file `dask scheduler --scheduler-file` writes") from exc


def _same_cluster(c: Controller, n_workers, address, device_type, dask_kwargs,
                  dry_run: bool = False) -> bool:
    """Whether init(...) asks for what is already running (unspecified means "any")."""
    if dry_run != bool((_init_args or {}).get("dry_run")):
        return False
    if dask_kwargs and dask_kwargs != {k: v for k, v in (_init_args or {}).items()
                                       if k not in ("n_workers", "address", "device_type",
                                                    "dry_run")}:
        return False
    if address is not None and address != (_init_args or {}).get("address"):
        return False
    return device_type in (None, c.device_type) and n_workers in (None, c.world)


def _start(n_workers, address, device_type, dask_kwargs) -> Controller:
    from .cluster import connect, local_threads, place_rank_actors, start_local_cluster, \
        worker_addresses
    backend = "nccl" if device_type == "cuda" else "gloo"
    fanout = fanout_setting()  # a bad DTORCH_FANOUT fails here, before anything starts
    started = time.monotonic()
    if address is not None:
        client, cluster = connect(address, **dask_kwargs), None
        workers = worker_addresses(client, n_workers)
        if n_workers is not None:
            workers = workers[:n_workers]
        threads = None
    else:
        if n_workers is None:
            n_workers = _default_gpu_count() if device_type == "cuda" else config.default_workers()
        if not start_hooks:  # a hook (the Jupyter kernel) shows its own progress
            print(f"dtorch: starting {n_workers} local workers ...", end="", flush=True)
        client, cluster = start_local_cluster(n_workers, **dask_kwargs)
        workers = worker_addresses(client, n_workers)
        threads = local_threads(n_workers)
    try:
        ranks = place_rank_actors(client, backend, _collective_timeout(),
                                  secrets.randbits(48), workers, threads, fanout)
    except BaseException:
        client.close()
        if cluster is not None:
            cluster.close()
        raise
    if address is None and not start_hooks:
        print(f" ready in {time.monotonic() - started:.1f}s", flush=True)
    controller = Controller(client, cluster, ranks, device_type, backend, fanout=fanout)
    config.set_running_world_size(len(ranks))
    atexit.unregister(shutdown)
    atexit.register(shutdown)  # after Dask's own exit hooks were registered, so it runs first
    return controller


def _default_gpu_count() -> int:
    import torch
    n = torch.cuda.device_count()
    if n == 0:
        raise ClusterError("device_type='cuda' but this machine has no GPU; use device_type='cpu'")
    return n


def get_controller() -> Controller:
    """The running controller, starting the default cluster on first use."""
    if _controller is None or _controller.closed:
        return init()
    return _controller


def is_running() -> bool:
    return _controller is not None and not _controller.closed


def synchronize(timeout: float | None = None) -> None:
    """Flush and wait until every rank executed everything issued; raise remote errors."""
    if is_running():
        _controller.synchronize(timeout)


def flush() -> None:
    """Ship pending instructions without waiting (the kernel calls this after each cell)."""
    if is_running():
        _controller.flush()


def manual_seed(seed: int) -> None:
    """Seed every rank: random factories then match ``torch.manual_seed(seed)`` on one device;
    dropout masks restart from ``(seed, counter 0)`` (see dtorch.random)."""
    from .. import random as stream
    c = get_controller()
    stream.reset(seed)
    c.issue(m.Seed(int(seed)))


def cluster_info() -> dict:
    """Ranks, their Dask worker addresses, devices, backend and dashboard link; ``links``: the
    cost model's fits (``dtorch.measure_links``; empty until measured), one dict per
    collective kind, group size and number of groups, with ``alpha_us``, ``beta_ns_per_byte``,
    ``bandwidth_gb_s`` and the measured ``points``."""
    from .links import current_model
    c = get_controller()
    link = getattr(c.client, "dashboard_link", None) if c.cluster is not None else None
    model = current_model(c)
    return {"ranks": c.world, "backend": c.backend, "device_type": c.device_type,
            "workers": {info.rank: info.address for info in c.ranks},
            "devices": {info.rank: info.device for info in c.ranks},
            "scheduler": c.client.scheduler.address, "dashboard": link,
            "embedded": c.cluster is not None, "live_tensors": c.live_tensors,
            "links": model.rows() if model is not None else []}


def rank_stats() -> list[dict]:
    """Per rank: tensors held and their bytes, collectives run, instructions, process RSS,
    ``random_values`` (the values dropout masks drew there: only the rank's own blocks),
    ``running`` (the instruction the rank is in right now, e.g. ``'Call(sleep)'``, or None),
    ``beside_reductions`` (instructions the rank ran while a gradient bucket's all_reduce was
    in flight, summed over the buckets: the backward work that overlapped them),
    ``in_flight`` (all_reduces posted and not yet finished: 0 between steps),
    ``interpreter_cpu_s`` / ``process_cpu_s`` (CPU seconds of the rank's interpreter thread /
    of its whole worker process), ``replayed`` and ``programs`` (instructions run from
    prepared programs, and how many programs the rank holds), ``fused`` (of those, run inside
    a compiled stretch: ``DTORCH_FUSE=1``), ``relayed`` (relay messages the rank forwarded),
    ``comm_seconds`` (``{"kind dim": seconds}`` the rank spent inside redistribute steps and
    composite ops' all_to_alls of this world; gradient buckets and context parallelism's ring
    shifts overlap compute and are not in it).
    It answers now, even while a rank is still running earlier work: call
    ``dtorch.synchronize()`` first for counts that include everything issued.

    >>> [s["bytes"] for s in dtorch.rank_stats()]              # doctest: +SKIP
    [400, 400, 400, 400]
    """
    return get_controller().stats()


def shutdown() -> None:
    """Stop the ranks and the embedded cluster; DTensors made before become unusable."""
    global _controller
    c, _controller = _controller, None
    config.set_running_world_size(None)
    if c is not None:
        c.close()


def restart() -> Controller:
    """A fresh world with the arguments of the last ``init`` (after a lost worker, or once
    the network problem a failed start reported is fixed)."""
    args = dict(_init_args or {})
    shutdown()
    return init(**args)


atexit.register(shutdown)
