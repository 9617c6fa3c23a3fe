"""The CPU extension (`cpu/*.cpp`): quantized matmul and the fused decode step, built on first use.

It is compiled for this machine's CPU (`-march=native`) with the compiler torch was built for, and
cached under `$PDSERVE_HOME/ext/` keyed by a hash of the sources, torch's version and the CPU, so
a cold start pays the build once (~1 min on 2 cores) and every later process loads it in
milliseconds. Concurrent first starts (a prefill and a decode worker) serialise on an flock, which
a process killed mid-build cannot leave held. It runs on AVX-512 (F, BW, VL and VNNI) or on AVX2
with FMA and F16C (`cpu/simd.h`: the same kernels, the same numbers lane for lane); where neither
is there, or the build fails, `load()` returns None once with a warning and the model runs its
torch path.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import time
from pathlib import Path
from types import ModuleType

from shared.model.hub import pdserve_home

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "cpu" / name for name in ("quant_matmul.cpp", "model_forward.cpp")]
_HEADERS = [Path(__file__).parent / "cpu" / name for name in ("quant_matmul.h", "simd.h")]


def cpu_supported() -> tuple[bool, str]:
    """Whether this CPU can run the extension, and why not."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False, "cannot read /proc/cpuinfo"
    missing = [f for f in ("avx2", "f16c", "fma") if f" {f}" not in flags]
    if missing:
        return False, f"CPU lacks {', '.join(missing)}"
    return True, ""


def cpu_isa() -> str:
    """The widest kernel path this CPU offers: "amx", "avx512-vnni", "avx2", or "torch" (the
    fallback). Step times measured on one hold for that kind only: a prefill step takes ~8× longer
    on an AVX2-only Zen 1 than with VNNI on a Zen 4."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return "torch"
    if {"amx_tile", "amx_int8"} <= flags:
        return "amx"
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        return "avx512-vnni"
    return "avx2" if cpu_supported()[0] else "torch"  # the extension's minimum, said once


def cpu_name() -> str:
    """The CPU's model name, family and model (a VM may show only the vendor's name)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown"
    name, family, model = (fields.get(k, "?") for k in ("model name", "cpu family", "model"))
    return f"{name} (family {family} model {model})"


def _build_key(torch_version: str) -> str:
    h = hashlib.sha256()
    for p in [*SOURCES, *_HEADERS]:
        h.update(p.read_bytes())
    h.update(torch_version.encode())
    try:
        model = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        h.update(model.encode())
    except (OSError, StopIteration):
        pass
    return h.hexdigest()[:16]


def _built_file(key: str) -> Path:
    return pdserve_home() / "ext" / f"cpu-{key}" / f"pdserve_cpu_{key}.so"


def is_built() -> bool:
    """Whether this machine's build is in the cache, told without importing torch (`pdserve up`
    asks before it starts the workers; by torch's installed version, which is torch.__version__)."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False
    return cpu_supported()[0] and _built_file(_build_key(version)).exists()


BUILD_SECONDS: float | None = None  # wall time of the build this process did (None: loaded from cache)


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, or None (with one warning) where it cannot run here."""
    global BUILD_SECONDS
    if os.environ.get("PDSERVE_NO_CPU_EXT"):
        log.info("PDSERVE_NO_CPU_EXT set: the CPU extension is off")
        return None
    ok, why = cpu_supported()
    if not ok:
        log.warning("CPU extension unavailable (%s): using the slower torch path", why)
        return None
    import torch
    from torch.utils import cpp_extension

    key = _build_key(torch.__version__)
    built = _built_file(key)
    build_dir = built.parent
    build_dir.mkdir(parents=True, exist_ok=True)
    if built.exists():  # the key names the sources, torch and the CPU: load it as it is
        with open(build_dir / "pdserve.lock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_SH)  # not while a builder (LOCK_EX, below) is writing it
            (build_dir / "lock").unlink(missing_ok=True)  # so torch's lock file, if any, is a dead builder's
            try:
                return _import(built, f"pdserve_cpu_{key}")
            except ImportError as exc:  # a broken file: build it again below
                log.warning("cached CPU extension %s did not load (%s): rebuilding", built, exc)
    cached = any(build_dir.glob("*.so"))
    if not cached:  # a first start is silent for a minute otherwise: say why
        log.warning("compiling pdserve's CPU kernels for this machine (first start only, ~1 min on 2 cores; "
                    "cached in %s)", build_dir)
    t0 = time.perf_counter()
    try:
        # torch serialises builds with a lock file that a process killed mid-build leaves behind, and
        # every later start would wait on it forever. An flock dies with its holder: whoever holds
        # it is the only one building, so a torch lock file seen then is stale.
        with open(build_dir / "pdserve.lock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            module = cpp_extension.load(
                name=f"pdserve_cpu_{key}",
                sources=[str(p) for p in SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as exc:  # a compiler or ninja missing, or a build error: say so once, run the torch path
        log.warning("CPU extension failed to build (%s): using the slower torch path", exc)
        return None
    if not cached:
        BUILD_SECONDS = time.perf_counter() - t0
        log.info("built the CPU extension in %.1f s (cached in %s)", BUILD_SECONDS, build_dir)
    return module


def _import(path: Path, name: str) -> ModuleType:
    """A built extension, straight from its file. Through `cpp_extension.load` ninja would rebuild
    it whenever another checkout (other source paths, another venv's torch headers) built it last:
    a silent minute at the start of `pdserve generate` in a fresh clone."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no loader for {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":  # `make model`: build the kernels once at install, not in a user's first request
    logging.basicConfig(level="INFO", format="%(message)s")
    ready = load() is not None
    print("pdserve CPU kernels: " + ("ready" if ready else "unavailable here (the torch path will run)")
          + (f", built in {BUILD_SECONDS:.0f} s" if BUILD_SECONDS is not None else ""))
