"""CancelledSet: which job attempts a worker must drop (a migration cancels only the attempt it
replaces; a client's cancel covers every attempt)."""

from shared.transport.worker import CancelledSet


def test_cancel_of_every_attempt_covers_all():
    s = CancelledSet()
    s.add("r")
    assert s.covers("r", 0) and s.covers("r", 5)
    assert not s.covers("other", 0)


def test_cancel_of_one_attempt_covers_it_and_earlier_only():
    s = CancelledSet()
    s.add("r", 1)
    assert s.covers("r", 0) and s.covers("r", 1)
    assert not s.covers("r", 2)  # the resubmitted attempt must still run
    s.add("r", 0)  # an older targeted cancel arriving late narrows nothing
    assert s.covers("r", 1) and not s.covers("r", 2)
    s.add("r")  # then the client goes away: everything
    assert s.covers("r", 2)
    s.add("r", 3)
    assert s.covers("r", 9)


def test_bounded_fifo():
    s = CancelledSet(capacity=3)
    for i in range(5):
        s.add(f"r{i}")
    assert not s.covers("r0", 0) and not s.covers("r1", 0)
    assert all(s.covers(f"r{i}", 0) for i in (2, 3, 4))
