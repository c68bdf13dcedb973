"""The deferred poison check (dtorch.runtime.poison_check), on simulated ranks in threads.

Each thread is one rank's PoisonWindow; ``exchange`` is a real MAX reduction across them, so
several ranks settle together exactly as the workers do over torch.distributed.
"""

import threading

import torch

from dtorch.runtime.poison_check import PoisonWindow


def settle_together(windows):
    """Run settle() on every window at once; returns each rank's doomed values."""
    n = len(windows)
    barrier = threading.Barrier(n)
    slots = [None] * n
    results = [None] * n

    def exchange(rank):
        def run(flags):
            slots[rank] = flags.clone()
            barrier.wait()
            flags.copy_(torch.stack(slots).amax(0))
            barrier.wait()
        return run

    def body(rank):
        results[rank] = windows[rank].settle(exchange(rank))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results


def test_nothing_poisoned_means_nothing_doomed_and_a_fresh_window():
    ws = [PoisonWindow(r) for r in range(3)]
    for w in ws:
        w.collective("all_gather", src=1, out=2, poisoned=False, member=True)
        w.derive([3], w.depends([2]))
    assert settle_together(ws) == [{}, {}, {}]
    assert not any(w.pending or w.tracked() for w in ws)


def test_peers_of_a_poisoned_rank_are_doomed_and_so_is_what_they_computed():
    ws = [PoisonWindow(r) for r in range(3)]
    for w in ws:
        w.collective("all_reduce", src=1, out=2, poisoned=w.rank == 2, member=True)
        w.derive([3], w.depends([2]))
        w.derive([4], w.depends([1]))  # from the input only: clean
    got = settle_together(ws)
    assert all(g == {2: (2, "all_reduce"), 3: (2, "all_reduce")} for g in got)


def test_a_placeholder_that_travels_through_two_collectives_takes_two_rounds():
    # rank 2 fails; collective 0 on ranks (1, 2) hands rank 1 zeros; collective 1 on ranks
    # (0, 1) carries rank 1's result to rank 0, which shared no collective with rank 2
    ws = [PoisonWindow(r) for r in range(3)]
    ws[0].collective("all_gather", src=10, out=None, poisoned=False, member=False)
    ws[1].collective("all_gather", src=10, out=11, poisoned=False, member=True)
    ws[2].collective("all_gather", src=10, out=11, poisoned=True, member=True)
    ws[0].collective("send_recv", src=11, out=12, poisoned=False, member=True)
    ws[1].collective("send_recv", src=11, out=12, poisoned=False, member=True)
    ws[2].collective("send_recv", src=11, out=None, poisoned=False, member=False)
    got = settle_together(ws)
    assert got[0] == {12: (1, "send_recv")}
    assert got[1] == {11: (2, "all_gather"), 12: (2, "all_gather")}
    assert got[2] == {11: (2, "all_gather")}


def test_freed_values_are_forgotten():
    w = PoisonWindow(0)
    w.collective("all_to_all", src=1, out=2, poisoned=True, member=True)
    w.forget(2)
    assert w.settle(None) == {}
