"""Dry-run mode: the same controller, planner and rules with no workers.

``dtorch.init(n_workers=1024, dry_run=True)`` builds every batch as a real run would and
counts, per rank, the batches, instructions and bytes it would receive; nothing is sent, so
plans for meshes far bigger than this machine can be measured. Reading a value raises
:class:`DryRunError`. Example::

    dtorch.init(n_workers=1024, dry_run=True)
    x = dtorch.ones(1024, 8, device_mesh=dtorch.init_device_mesh("cpu", 1024),
                    placements=[dtorch.Shard(0)])
    y = (x * 2 + 1).relu()
    dtorch.synchronize()                 # builds the batches
    dtorch.rank_stats()[1023]            # {'rank': 1023, 'batches': 1, 'instructions': 5, ...}
    y.to_torch()                         # DryRunError: no values in dry-run mode
"""

from __future__ import annotations

from concurrent.futures import Future

from ..errors import DTorchError
from .channel import Batch, encode
from .rank_info import RankInfo
from .controller import Controller
from .fanout import Relay


class DryRunError(DTorchError):
    """A value was asked for in dry-run mode."""


class DryRunController(Controller):
    """Builds and measures batches for ``world`` ranks without sending them."""

    def __init__(self, world: int, device_type: str = "cpu", fanout: int = 0):
        ranks = [RankInfo(r, f"dry-run://rank-{r}", "dry-run", None, None) for r in range(world)]
        super().__init__(None, None, ranks, device_type, fanout=fanout)
        self._batches = [0] * world
        self._instructions = [0] * world
        self._bytes = [0] * world
        self._staged_bytes = [0] * world
        self.sent_messages = 0  # what the controller itself wrote: messages and their bytes,
        self.sent_bytes = 0  # staged shards excluded (a Batch per rank, or a Relay per head)

    def _messages(self, batches, staged, ack):
        """Count what each rank would receive, then build the controller's messages."""
        sizes: dict[int, int] = {}  # ranks of one class share a batch: measured once
        for rank, batch in batches.items():
            self._batches[rank] += 1
            self._instructions[rank] += batch.instructions
            size = sizes.get(id(batch))
            if size is None:
                size = sizes[id(batch)] = batch.nbytes
            self._bytes[rank] += size
            if staged.get(rank):
                self._staged_bytes[rank] += sum(w.data.nbytes for w in staged[rank].values())
        return super()._messages(batches, staged, ack)

    def _expect(self, rank, req) -> Future:
        """Nothing answers: a flush that waits for delivery is delivered at once."""
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _write(self, rank, message) -> None:
        """Count a message the controller would write and its bytes, staged shards left out
        (what a flush of ops costs the controller, per world size)."""
        if type(message) is Batch:
            message = message._replace(staged=None)
        elif type(message) is Relay:
            message = message._replace(routes=tuple(r[:5] + (None,) for r in message.routes))
        self.sent_messages += 1
        self.sent_bytes += sum(memoryview(part).nbytes for part in encode(message))

    def request(self, make, ranks):
        raise DryRunError("dtorch runs in dry-run mode (dtorch.init(dry_run=True)): no rank "
                          "computes anything, so values cannot be read; start a real cluster "
                          "with dtorch.init() to read them")

    def synchronize(self, timeout=None) -> None:
        self.flush()

    def stats(self) -> list[dict]:
        self.flush()
        return [{"rank": r, "batches": self._batches[r], "instructions": self._instructions[r],
                 "bytes": self._bytes[r], "staged_bytes": self._staged_bytes[r]}
                for r in range(self.world)]

    def close(self) -> None:
        self.closed = True
        self._pool.shutdown(wait=False)
