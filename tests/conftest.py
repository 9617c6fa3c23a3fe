"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.model.hub import pull_default_model


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The real SmolLM2-135M-Instruct GGUF (pulled once into the cache, offline afterwards)."""
    return pull_default_model()
