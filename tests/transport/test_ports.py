"""Ports handed out by `free_port`: never one this process reserved for a server it starts later."""

from __future__ import annotations

import random

from shared.transport import servers


def test_a_reserved_port_is_never_handed_out(monkeypatch):
    reserved = servers.free_port()  # a port free on this machine now, so only the reservation can keep it out
    servers._handed_out.discard(reserved)
    servers.reserve_port(reserved)
    draw = random.randrange
    picks = iter([reserved, reserved])  # the reserved port drawn twice, then random ones (a neighbour of it
    # may be in use, or handed out already to an earlier test of this process: a run of the suite drew one)
    monkeypatch.setattr(random, "randrange", lambda *a: next(picks, None) or draw(*a))
    port = servers.free_port()
    assert port != reserved
    assert port in servers._handed_out
