"""The write-behind backlog between a replica (or the router) and the metrics store: a stalled
store never makes the caller wait, the backlog stays within its bound and counts what it drops,
and once the store answers again every row under the bound reaches it, in order."""

from __future__ import annotations

from concurrent.futures import Future

from protocol.backlog import StoreBacklog


class ManualStore:
    """A store whose writes finish only when the test says so."""

    def __init__(self):
        self.writes: list[tuple[list[int], Future]] = []
        self.rows: list[int] = []

    def send(self, rows: list[int]) -> Future:
        future: Future = Future()
        self.writes.append((rows, future))
        return future

    def finish_all(self, fail: bool = False) -> None:
        for rows, future in self.writes:
            if not future.done():
                if fail:
                    future.set_exception(OSError("disk full"))
                else:
                    self.rows += rows
                    future.set_result(None)


def test_a_stalled_store_never_blocks_and_one_write_is_in_flight():
    store = ManualStore()
    backlog = StoreBacklog(store.send, batch=4, limit=1000)
    for i in range(20):
        backlog.add([i])  # returns at once although no write ever finishes
    assert [rows for rows, _ in store.writes] == [[0, 1, 2, 3]]
    assert backlog.waiting == 16
    store.finish_all()
    backlog.pump()
    assert [len(rows) for rows, _ in store.writes] == [4, 16]  # the waiting rows go out together


def test_past_the_bound_the_oldest_rows_are_dropped_and_counted():
    store = ManualStore()
    backlog = StoreBacklog(store.send, batch=2, limit=10)
    for i in range(32):
        backlog.add([i])
    assert backlog.waiting == 10 and backlog.dropped == 32 - 2 - 10
    store.finish_all()
    backlog.flush(timeout=1)  # the futures finish at once now: flush writes the rest
    store.finish_all()
    backlog.flush(timeout=1)
    assert store.rows == [0, 1] + list(range(22, 32))
    assert backlog.waiting == 0


def test_refused_writes_are_counted_and_flush_gives_up_on_a_stalled_store():
    store = ManualStore()
    backlog = StoreBacklog(store.send, batch=3, limit=100)
    backlog.add(range(3))
    store.finish_all(fail=True)
    backlog.add(range(3, 5))
    backlog.flush(timeout=0.05)  # the second write never finishes: flush returns, rows stay counted
    assert backlog.failed == 3
    assert store.writes[-1][0] == [3, 4] and not store.writes[-1][1].done()
