"""Ports handed out by `free_port`: never one this process reserved for a server it starts later."""

from __future__ import annotations

import random

from shared.transport import servers


def test_a_reserved_port_is_never_handed_out(monkeypatch):
    reserved = servers.free_port()  # a port free on this machine now, so only the reservation can keep it out
    servers._handed_out.discard(reserved)
    servers.reserve_port(reserved)
    picks = iter([reserved, reserved, reserved + 1 if reserved + 1 < servers._ephemeral_low() else reserved - 1])
    monkeypatch.setattr(random, "randrange", lambda *_: next(picks))
    port = servers.free_port()
    assert port != reserved
    assert port in servers._handed_out
