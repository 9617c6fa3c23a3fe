"""`pdserve profile`: measure this machine and model, write the profile the simulator runs on.

    prefill   forward passes of prompt chunks: n tokens at offset s, one or several sequences
    decode    forward passes of B sequences × 1 token at context c (the KV read grows with B·c)
    engine    whole engine steps (schedule → run → sample → postprocess) vs the bare forward pass:
              the per-step and per-sequence bookkeeping the fit must carry too
    transfer  a prompt's KV blocks into a real kvstore and back out, shm and network paths

Forward passes run on synthetic block tables (the timing of attention does not depend on what the
KV holds), so no long prompt has to be prefilled first to time a decode step at context 2,048.
Each point is the median of a few repeats after a warm-up; the fits are least squares, clamped at
zero (see shared/sim/cost.py for the model). `--quick` measures a small grid (tests); `--stack` then
calibrates the fits against a real `pdserve up` (calibrate.py: what serving adds to a bare step).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from shared.config import EngineConfig
from shared.kernels import cpu_ext
from shared.sim.cost import DecodeFit, EngineLimits, LinearFit, PrefillFit, Profile, TransferFit

log = logging.getLogger("pdserve.profile")


@dataclass(frozen=True)
class ProfileConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)  # as the workers run it (shared/cli_args.py)
    quick: bool = False
    repeat: int = 3
    transfer: bool = True  # measure the kvstore paths (starts nats-server, valkey-server, a kvstore)
    stack: bool = False  # also calibrate against a real `pdserve up` (calibrate.py)

    def __post_init__(self) -> None:
        if self.repeat < 1:
            raise ValueError("profile: repeat must be >= 1")

    @property
    def prefill_grid(self) -> list[tuple[int, int, int]]:
        """(sequences, tokens each, offset) — single prompts, batches, and later chunks of long prompts."""
        if self.quick:
            return [(1, 32, 0), (1, 256, 0), (2, 128, 0), (1, 256, 512)]
        return [(1, 16, 0), (1, 64, 0), (1, 128, 0), (1, 256, 0), (1, 512, 0), (2, 128, 0), (4, 128, 0),
                (2, 256, 0), (1, 512, 512), (1, 512, 1536), (1, 256, 2560), (4, 32, 0)]

    @property
    def decode_grid(self) -> list[tuple[int, int]]:
        """(batch, context tokens each)."""
        if self.quick:
            return [(1, 128), (8, 128), (8, 512), (32, 256)]
        return [(b, c) for b in (1, 4, 16, 32, 64) for c in (128, 512)] + [(1, 2048), (8, 1024), (16, 2048), (48, 640)]


def _median_time(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fit(rows: list[list[float]], times: list[float]) -> list[float]:
    """Least squares with non-negative coefficients (drop a negative one and refit: few features)."""
    x, y = np.array(rows, dtype=float), np.array(times, dtype=float)
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            out = [0.0] * x.shape[1]
            for i, c in zip(active, coef):
                out[i] = max(0.0, float(c))
            return out
        active.pop(int(np.argmin(coef)))


class Profiler:
    def __init__(self, config: ProfileConfig):
        from shared.engine.engine import LLMEngine

        self.config = config
        blocks = 512 if config.quick else 2304  # enough for 64 × 512 tokens of synthetic context
        self.engine = LLMEngine.from_config(replace(config.engine, num_kv_blocks=blocks, max_num_seqs=64))
        self.device = config.engine.device
        self.bs = self.engine.config.block_size

    def _chunks(self, specs: list[tuple[int, int]]):
        """ScheduledChunks for (new tokens, offset) each, on block tables that wrap around the cache."""
        from shared.engine.model_runner import ScheduledChunk

        n_blocks, out, next_block = self.engine.config.num_kv_blocks, [], 0
        for n, start in specs:
            need = -(-(start + n) // self.bs)
            table = [(next_block + i) % n_blocks for i in range(need)]
            next_block = (next_block + need) % n_blocks
            out.append(ScheduledChunk([7] * n, start, table, num_logits=1))
        return out

    def _forward(self, chunks) -> None:
        import torch  # in the functions that measure: every `pdserve` command's parser reads this module

        logits = self.engine.runner.execute(chunks)
        torch.argmax(logits, dim=-1).tolist()  # greedy sampling, and a sync point on accelerators
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def prefill(self) -> tuple[PrefillFit, list[dict]]:
        rows, times, points = [], [], []
        for seqs, n, start in self.config.prefill_grid:
            chunks = self._chunks([(n, start)] * seqs)
            t = _median_time(lambda: self._forward(chunks), self.config.repeat)
            pairs = seqs * n * (start + n / 2)
            rows.append([1.0, seqs * n, pairs, seqs])
            times.append(t)
            points.append({"seqs": seqs, "tokens": n, "offset": start, "seconds": t})
            log.info("prefill %d × %d tokens at %d: %.1f ms", seqs, n, start, 1e3 * t)
        return PrefillFit(*_fit(rows, times)), points

    def decode(self) -> tuple[DecodeFit, list[dict]]:
        rows, times, points = [], [], []
        for batch, ctx in self.config.decode_grid:
            chunks = self._chunks([(1, ctx)] * batch)
            t = _median_time(lambda: self._forward(chunks), self.config.repeat)
            rows.append([1.0, batch, batch * (ctx + 1)])
            times.append(t)
            points.append({"batch": batch, "context": ctx, "seconds": t})
            log.info("decode batch %d at context %d: %.1f ms", batch, ctx, 1e3 * t)
        return DecodeFit(*_fit(rows, times)), points

    def engine_overhead(self, decode_fit: DecodeFit) -> dict[str, float]:
        """Whole engine steps of a real decode batch minus the fitted forward pass: the bookkeeping."""
        from shared.model.sampling_params import SamplingParams

        e, batch, prompt = self.engine, 8, 64
        params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            e.add_request(f"profile-{i}", [11 + i] * prompt, params)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in e.seqs.values()):
            e.step()
        steps = 3 if self.config.quick else 8
        t0 = time.perf_counter()
        for _ in range(steps):
            e.step()
        per_step = (time.perf_counter() - t0) / steps
        for i in range(batch):
            e.abort(f"profile-{i}")
        ctx = batch * (prompt + steps // 2)
        extra = max(0.0, per_step - (decode_fit.base_s + decode_fit.per_seq_s * batch + decode_fit.per_ctx_token_s * ctx))
        return {"batch": batch, "step_s": per_step, "per_seq_s": extra / batch}


# ---------------------------------------------------------------------------------- KV transfer


async def _transfer_points(nats_url: str, store: str, proc: subprocess.Popen, block_shape: tuple, sizes: list[int],
                           repeat: int) -> dict[str, list[dict]]:
    import nats
    import torch

    from services.kvstore.bench import _one_round, _wait_attached
    from shared.kvcache.block_hash import block_keys

    nc = await nats.connect(nats_url)
    points: dict[str, list[dict]] = {}
    try:
        for use_shm in (True, False):
            client = await _wait_attached(nc, store, use_shm, proc)
            path = "shm" if client.shm_attached else "network"
            for n in sizes:
                data = torch.randn(n, *block_shape).to(torch.bfloat16)
                out = torch.empty_like(data)
                writes, reads = [], []
                for r in range(repeat + 1):
                    keys = block_keys(list(range(16 * n)), 16, f"profile-{path}-{n}-{r}-{uuid.uuid4().hex[:6]}")
                    w, rd = await _one_round(client, data, keys, out)
                    if r:  # the first round warms up
                        writes.append(w)
                        reads.append(rd)
                nbytes = data.numel() * data.element_size()
                points.setdefault(path, []).append({"blocks": n, "bytes": nbytes, "write_s": statistics.median(writes),
                                                    "read_s": statistics.median(reads)})
                log.info("kv %s %d blocks: write %.1f ms, read %.1f ms", path, n, 1e3 * statistics.median(writes),
                         1e3 * statistics.median(reads))
            await client.close()
    finally:
        await nc.close()
    return points


def measure_transfer(block_shape: tuple, quick: bool) -> tuple[dict[str, TransferFit], dict[str, list[dict]]]:
    """A real nats-server + valkey-server + kvstore process, as a worker sees them."""
    from shared.transport.servers import start_nats, start_valkey

    sizes = [2, 16] if quick else [2, 16, 64, 160]
    work = tempfile.mkdtemp(prefix="pdserve-profile-")
    nats_server, valkey_server = start_nats(workdir=f"{work}/nats"), start_valkey(workdir=f"{work}/valkey")
    store = f"profile-{uuid.uuid4().hex[:8]}"
    layers, _, bs, heads, dim = block_shape
    block_bytes = 2 * math.prod(block_shape)
    proc = subprocess.Popen([sys.executable, "-m", "services.kvstore", "--store", store, "--block-bytes",
                             str(block_bytes), "--layout", f"L{layers}.2.{bs}.H{heads}.D{dim}.bfloat16",
                             "--num-slots", str(2 * max(sizes)), "--nats", nats_server.url,
                             "--redis", valkey_server.url, "--log-level", "WARNING"])
    try:
        points = asyncio.run(_transfer_points(nats_server.url, store, proc, block_shape, sizes, 2 if quick else 4))
    finally:
        proc.terminate()
        proc.wait(10)
        nats_server.stop()
        valkey_server.stop()
    fits = {}
    for path, pts in points.items():
        rows = [[1.0, p["bytes"]] for p in pts]
        fits[path] = TransferFit(LinearFit(*_fit(rows, [p["write_s"] for p in pts])),
                                 LinearFit(*_fit(rows, [p["read_s"] for p in pts])))
    return fits, points


def run_profile(config: ProfileConfig) -> dict[str, Any]:
    import torch

    t0 = time.perf_counter()
    prof = Profiler(config)
    mcfg = prof.engine.model.config
    prefill_fit, prefill_points = prof.prefill()
    decode_fit, decode_points = prof.decode()
    overhead = prof.engine_overhead(decode_fit)
    # the engine's bookkeeping per sequence and step belongs in the step time the simulator uses
    decode_fit = DecodeFit(decode_fit.base_s, decode_fit.per_seq_s + overhead["per_seq_s"], decode_fit.per_ctx_token_s)
    block_shape = (mcfg.num_layers, 2, prof.bs, mcfg.num_kv_heads, mcfg.head_dim)
    block_bytes = prof.engine.kv_cache.block_bytes
    if config.transfer:
        transfer, transfer_points = measure_transfer(block_shape, config.quick)
    else:  # a bare memcpy stands in (both directions), clearly labelled in the file
        transfer, transfer_points = {"shm": TransferFit(LinearFit(0.0, 1 / 5e9), LinearFit(0.0, 1 / 5e9))}, {}
    e = config.engine
    limits = EngineLimits(kv_bytes_per_block=block_bytes, max_num_batched_tokens=e.max_num_batched_tokens)
    meta = {"model": mcfg.name, "model_path": str(e.model or "default"), "device": e.device,
            "dtype": e.dtype, "quantization": e.quantization, "kv_dtype": str(prof.engine.kv_cache.data.dtype),
            "threads": torch.get_num_threads(),
            "machine": f"{platform.machine()} {os.cpu_count()} cores", "cpu": cpu_ext.cpu_name(),
            "isa": cpu_ext.cpu_isa() if e.device == "cpu" else "", "quick": config.quick,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "wall_s": round(time.perf_counter() - t0, 1), "transfer_measured": config.transfer}
    spec = prof.engine.spec
    draft_row_s = row_cost(spec.cost.rows, spec.cost.secs) if spec is not None else 0.0
    profile = Profile(prefill=prefill_fit, decode=decode_fit, transfer=transfer, limits=limits,
                      draft_row_s=draft_row_s, meta=meta)
    if config.stack:
        from services.planner.calibrate import calibrate_on_new_stack, engine_up_args

        del prof  # free the engine's memory before the stack's workers load theirs
        profile = calibrate_on_new_stack(profile, engine_up_args(config.engine))
    data = profile.to_json()
    data["prefill"]["points"] = prefill_points
    data["decode"]["points"] = decode_points
    data["engine_overhead"] = overhead
    data["kv_transfer_points"] = transfer_points
    return data


def row_cost(rows: list[int], secs: list[float], up_to: int = 16) -> float:
    """Seconds one more row adds to a step (a speculative draft verified: the engine's own table of
    step time by rows, measured at its start): the least-squares slope over the rows a decode
    batch of a few sequences verifies (1 … `up_to`); 0 if the table has no such line."""
    pts = [(r, t) for r, t in zip(rows, secs) if r <= up_to]
    if len(pts) < 2:
        return 0.0
    return max(0.0, statistics.linear_regression(*zip(*pts)).slope)


def add_profile_args(p: argparse.ArgumentParser) -> None:
    from shared.cli_args import add_engine_args

    add_engine_args(p)  # the engine exactly as the workers configure it (--model, --dtype, --threads …)
    p.set_defaults(threads=max(1, (os.cpu_count() or 2) // 2))  # as one worker of a 1 + 1 `pdserve up`
    p.add_argument("--quick", action="store_true", help="a small grid (seconds; for tests)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-transfer", dest="transfer", action="store_false",
                   help="skip the kvstore measurement (no servers started)")
    p.add_argument("--stack", action="store_true",
                   help="also calibrate on a real `pdserve up` (three short served runs): service overheads")
    p.add_argument("--out", default="-", help="profile JSON path ('-': stdout)")


def cmd_profile(args: argparse.Namespace) -> int:
    from shared.cli_args import engine_config

    config = ProfileConfig(engine=engine_config(args), quick=args.quick, repeat=args.repeat, transfer=args.transfer,
                           stack=args.stack)
    data = run_profile(config)
    text = json.dumps(data, indent=1)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        print(f"profile: {args.out} ({data['meta']['wall_s']} s)", file=sys.stderr)
    return 0
