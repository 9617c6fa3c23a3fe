"""Fixtures shared by the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.model.hub import pull_default_model


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The real SmolLM2-135M-Instruct GGUF (pulled once into the cache, offline afterwards)."""
    return pull_default_model()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    """A real `nats-server -js` on a free port for the whole session."""
    from shared.transport.servers import start_nats

    server = start_nats(workdir=tmp_path_factory.mktemp("nats"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory):
    """A real `valkey-server` on a free port for the whole session."""
    from shared.transport.servers import start_valkey

    server = start_valkey(workdir=tmp_path_factory.mktemp("valkey"))
    yield server
    server.stop()
