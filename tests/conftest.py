"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.model.hub import pull_default_model


def pytest_configure(config):
    """Under pytest-xdist (`make test`'s first phase) two test processes share the machine's cores,
    with the stacks other tests start beside them. A model run in the test process itself then keeps
    to one torch thread: with two, every op waits at a barrier for a thread the OS has given another
    process's core, and a tiny model's thousands of small ops took 14× their time alone (the chi-square
    test of speculative sampling: 75 s against 5.3 s). The services a test starts keep their own
    threads (what `pdserve up` gives them), and the serial phase runs with all of them."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


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
