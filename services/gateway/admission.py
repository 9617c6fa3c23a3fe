"""Admission: at most `limit` requests in flight in this gateway; the next one is refused at once
(429) rather than queued, so a client's retry policy — not an invisible queue — absorbs bursts."""

from __future__ import annotations

from services.gateway.errors import too_many_requests


class Admission:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0  # admitted and not yet answered in full
        self.awaiting_first_token = 0  # of those, dispatched and still without a token

    def admit(self) -> Ticket:
        if self.in_flight >= self.limit:
            raise too_many_requests(self.limit)
        self.in_flight += 1
        return Ticket(self)


class Ticket:
    """One admitted request's place; `release()` is idempotent so every exit path may call it."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._released = False
        self._awaiting = False

    def dispatched(self) -> None:
        if not self._released and not self._awaiting:
            self._awaiting = True
            self._admission.awaiting_first_token += 1

    def first_token(self) -> None:
        if self._awaiting:
            self._awaiting = False
            self._admission.awaiting_first_token -= 1

    def release(self) -> None:
        if self._released:
            return
        self.first_token()
        self._released = True
        self._admission.in_flight -= 1
