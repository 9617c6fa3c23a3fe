"""The GPU check script (scripts/gpu_check.py) is prepared here, where no GPU is: its CPU mode runs
the same code (Triton interpreted), so a device session never starts with a script that cannot run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_every_part_on_cpu(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check.py"), "--device", "cpu", "--quick",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads((tmp_path / "summary.json").read_text()) == {"env": "ok", "kernels": "ok", "engine": "ok"}
    kernels = json.loads((tmp_path / "kernels.json").read_text())
    assert kernels["ok"] and kernels["max_abs_err_fp32"] < 1e-4 and len(kernels["cases"]) == 2
    engine = json.loads((tmp_path / "engine.json").read_text())
    assert engine["tiny_model"]["equal"] and len(engine["tiny_model"]["device"][0]) == 8
    assert engine["tiny_model"]["graphs_equal_eager"]
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["device"] == "cpu" and env["torch"]
