"""The CPU extension's build cache survives a process killed while building."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from shared.kernels import cpu_ext
from shared.model.hub import pdserve_home


def test_a_stale_build_lock_does_not_hang_the_next_start():
    """torch's build lock file, left behind by a process killed mid-build, used to make every later
    start wait on it forever; the next load must go ahead (and leave the extension usable)."""
    ok, why = cpu_ext.cpu_supported()
    if not ok:
        pytest.skip(f"no CPU extension on this machine: {why}")
    assert cpu_ext.load() is not None  # built (or found) once
    assert cpu_ext.is_built()  # what `pdserve up` asks (torch-free) before it starts the workers
    build_dir = pdserve_home() / "ext" / f"cpu-{cpu_ext._build_key(torch.__version__)}"
    (build_dir / "lock").touch()  # what a killed builder leaves
    code = "from shared.kernels import cpu_ext; import sys; sys.exit(0 if cpu_ext.load() is not None else 1)"
    done = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (build_dir / "lock").exists()
