"""KV transfer micro-benchmark: one prompt's blocks into the store and back out, shm vs network.

    python -m services.kvstore.bench                       # 125 SmolLM2 bf16 blocks ≈ a 2,000-token prompt
    python -m services.kvstore.bench --blocks 32 --repeat 20
    python -m services.kvstore.bench --store kv-h1 --nats nats://10.0.0.1:4222 --paths network --json out.json
                                                           # a running store (another host, say)

Starts its own nats-server and valkey-server on free ports and the store as a separate process
(`python -m services.kvstore`), like a worker would see it. Reports the median of --repeat runs of

    write   allocate + write_blocks + commit      (what prefill pays)
    read    lookup + read_blocks + release        (what decode pays)

next to a plain memcpy and a checksum (`kv_client.checksum`) of the same bytes on this machine, for scale.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np
import torch

from shared.kvcache.block_hash import block_keys
from shared.transport import nats_bus
from shared.transport.kv_client import KVStoreClient, KVStoreError, checksum
from shared.transport.servers import start_nats, start_valkey

SMOLLM2_BLOCK = (30, 2, 16, 3, 64)  # [L, 2, block_size, Hkv, Dh]: 368,640 bytes in bf16


async def _wait_attached(nc, store: str, use_shm: bool, proc: subprocess.Popen | None) -> KVStoreClient:
    deadline = time.monotonic() + 60
    while True:
        client = KVStoreClient(nc, store, use_shm=use_shm, timeout=30)
        try:
            await client.attach()
            return client
        except KVStoreError:
            if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def _one_round(client: KVStoreClient, data: torch.Tensor, keys: list[bytes], out: torch.Tensor):
    t0 = time.perf_counter()
    alloc = await client.allocate(len(keys))
    checksums = await client.write_blocks(alloc.lease_id, alloc.slots, data)
    await client.commit(alloc.lease_id, alloc.slots, keys, checksums)
    t1 = time.perf_counter()
    await client.release(alloc.lease_id)
    t2 = time.perf_counter()
    hit = await client.lookup(keys)
    await client.read_blocks(hit.lease_id, hit.blocks, out)
    await client.release(hit.lease_id)
    t3 = time.perf_counter()
    assert len(hit.blocks) == len(keys) and torch.equal(out.view(torch.uint8), data.view(torch.uint8))
    return t1 - t0, t3 - t2


async def _bench(args, nats_url: str, store: str, proc: subprocess.Popen | None) -> dict:
    data = torch.randn(args.blocks, *SMOLLM2_BLOCK).to(torch.bfloat16)
    out = torch.empty_like(data)
    nbytes = data.numel() * data.element_size()
    src, dst = data.view(torch.uint8).numpy(), out.view(torch.uint8).numpy()
    copy_s = _median_time(lambda: np.copyto(dst, src), args.repeat)
    sum_s = _median_time(lambda: [checksum(memoryview(row)) for row in src], args.repeat)
    print(f"{args.blocks} blocks × {nbytes // args.blocks:,} B = {nbytes / 2**20:.1f} MiB; for scale: "
          f"memcpy {1e3 * copy_s:.1f} ms ({nbytes / copy_s / 2**30:.2f} GiB/s), "
          f"checksum {1e3 * sum_s:.1f} ms ({nbytes / sum_s / 2**30:.2f} GiB/s)")
    results = {"blocks": args.blocks, "bytes": nbytes, "memcpy_s": copy_s, "checksum_s": sum_s, "paths": {}}
    nc = await nats_bus.connect(nats_url, "kvstore-bench")
    try:
        for use_shm in (path == "shm" for path in args.paths.split(",")):
            client = await _wait_attached(nc, store, use_shm, proc)
            path = "shm" if client.shm_attached else "network"
            if use_shm and not client.shm_attached:
                raise SystemExit(f"kvstore {store}'s shared memory is not reachable from here (another host?)")
            writes, reads = [], []
            for r in range(args.repeat + 1):
                # fresh keys each round: every write is a miss, every read a hit
                keys = block_keys(list(range(16 * args.blocks)), 16, f"bench-{path}-{r}")
                w, rd = await _one_round(client, data, keys, out)
                if r:  # the first round warms up
                    writes.append(w)
                    reads.append(rd)
            w, rd = statistics.median(writes), statistics.median(reads)
            print(f"{path:8s} write+commit {1e3 * w:7.1f} ms ({nbytes / w / 2**30:5.2f} GiB/s)   "
                  f"lookup+read {1e3 * rd:7.1f} ms ({nbytes / rd / 2**30:5.2f} GiB/s)")
            results["paths"][path] = {"write_s": w, "read_s": rd, "write_gib_s": nbytes / w / 2**30,
                                      "read_gib_s": nbytes / rd / 2**30}
            await client.close()
    finally:
        await nc.close()
    return results


def _write(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.kvstore.bench")
    p.add_argument("--blocks", type=int, default=125)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--paths", default="shm,network", help="which transfer paths, in order")
    p.add_argument("--store", default=None, help="a running kvstore to measure (default: start one, and its servers)")
    p.add_argument("--nats", default=None, help="with --store: its NATS (URL list)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.store:
        if not args.nats:
            p.error("--store needs --nats")
        _write(args.json, asyncio.run(_bench(args, args.nats, args.store, None)))
        return 0
    work = tempfile.mkdtemp(prefix="pdserve-kvbench-")
    nats_server, valkey_server = start_nats(workdir=f"{work}/nats"), start_valkey(workdir=f"{work}/valkey")
    store = f"bench-{uuid.uuid4().hex[:8]}"
    block_bytes = 2 * torch.Size(SMOLLM2_BLOCK).numel()
    proc = subprocess.Popen([sys.executable, "-m", "services.kvstore", "--store", store, "--block-bytes",
                             str(block_bytes), "--layout", "L30.2.16.H3.D64.bfloat16", "--num-slots",
                             str(2 * args.blocks), "--nats", nats_server.url, "--redis", valkey_server.url,
                             "--log-level", "WARNING"])
    try:
        _write(args.json, asyncio.run(_bench(args, nats_server.url, store, proc)))
    finally:
        proc.terminate()
        proc.wait(10)
        nats_server.stop()
        valkey_server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
