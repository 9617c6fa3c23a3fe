"""A profile for hardware this machine does not have, from its spec sheet and the model's shape
(a roofline estimate, labelled as such in the file: `meta.kind = "roofline"`).

    prefill   compute-bound: 2·params FLOPs a token, 4·layers·hidden FLOPs per attention pair,
              at `mfu` of peak; plus one read of the weights a step
    decode    bandwidth-bound: the weights once a step, each sequence's KV once a step, at `mbu`
              of peak bandwidth; plus 2·params FLOPs per sequence at `decode_mfu`
    transfer  a fixed latency + bytes ÷ link bandwidth, per GPU times the worker's GPUs (same host:
              `shm_gbps`; other host: `net_gbps`): each GPU of an HGX/DGX H100 has its own PCIe
              link and its own 400 Gb/s NIC, and a KV transfer engine (Mooncake's, NIXL) uses them
              all
    tensor    a worker of `gpus` > 1 GPUs (Megatron-style tensor parallel) all-reduces its activations
    parallel  twice a layer (after attention, after the MLP): each costs `allreduce_latency_s` plus, for
              a ring, 2·(g − 1)/g of the tokens' bytes (hidden × 2 a token) over `allreduce_busbw`
              (NCCL's bus bandwidth), not overlapped with compute. So a step of T tokens (prefill) or
              T sequences (decode) gains 2·layers·latency + T·2·layers·2(g−1)/g·hidden·2/busbw. For 70B
              at TP8 that is +28% on a prefill token and 2.5 ms on a decode step of 100: what makes a
              smaller tensor-parallel group cheaper per GPU for prefill (`pdserve plan --prefill-profile`)

`pdserve profile` measures the machine it runs on; this is for planning a fleet of GPUs from here.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

from shared.sim.cost import DecodeFit, EngineLimits, LinearFit, PrefillFit, Profile, TransferFit


@dataclass(frozen=True)
class RooflineSpec:
    name: str = "llama-3-8b on h100-sxm (roofline)"
    params: float = 8.03e9
    layers: int = 32
    hidden: int = 4096
    kv_bytes_per_token: int = 131_072  # 32 layers × 8 KV heads × 128 dims × K,V × 2 bytes
    weight_bytes: float = 16.06e9  # bf16
    peak_flops: float = 989e12  # H100 SXM dense bf16
    peak_bw: float = 3.35e12  # HBM3 bytes/s
    hbm_bytes: float = 80e9
    mfu: float = 0.5
    decode_mfu: float = 0.3
    mbu: float = 0.7
    step_overhead_s: float = 0.002  # scheduling, launch, sampling per step
    shm_gbps: float = 50.0  # GB/s a GPU within a host (PCIe Gen5 x16 to pinned host memory)
    # GB/s a GPU between hosts: one 400 Gb/s NIC a GPU, at what Mooncake's transfer engine reached over
    # 8 of them (190 GB/s: Qin et al., 2024), ~half the line rate
    net_gbps: float = 23.75
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    prefill_max_inflight: int = 8
    kvstore_slots: int = 200_000  # host memory for the prefix cache, in blocks
    gpus: int = 1  # GPUs one worker spans (tensor parallel): peak figures above are per GPU
    # one all-reduce among the worker's GPUs (NVLink within an 8-GPU H100 host): a small message's time,
    # and the bus bandwidth a large one gets (nccl-tests' busbw; ~360 GB/s on H100 SXM without NVLS)
    allreduce_latency_s: float = 8e-6
    allreduce_busbw: float = 360e9

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if name != "name" and not value > 0:
                raise ValueError(f"roofline spec: {name} must be positive")


PRESETS = {
    "llama3-8b-h100": RooflineSpec(),
    # 70B on a tensor-parallel group of 8 H100s: one worker = 8 GPUs (80 layers × 8 KV heads × 128 × K,V × 2 B)
    "llama3-70b-tp8-h100": RooflineSpec(name="llama-3-70b tp8 on 8× h100-sxm (roofline)", params=70.6e9, layers=80,
                                        hidden=8192, kv_bytes_per_token=327_680, weight_bytes=141.2e9, gpus=8,
                                        mfu=0.4, mbu=0.6, step_overhead_s=0.004, prefill_max_inflight=8,
                                        max_num_seqs=256),
}
# the same model on half the GPUs: 35 GB of weights a GPU leave 45 GB for KV (at TP2, 2.8 GB: too little
# for a 32k-token prompt)
PRESETS["llama3-70b-tp4-h100"] = replace(PRESETS["llama3-70b-tp8-h100"], gpus=4,
                                         name="llama-3-70b tp4 on 4× h100-sxm (roofline)")


def roofline_profile(spec: RooflineSpec) -> Profile:
    block_bytes = 16 * spec.kv_bytes_per_token
    flops, bw, hbm = spec.peak_flops * spec.gpus, spec.peak_bw * spec.gpus, spec.hbm_bytes * spec.gpus
    weights_s = spec.weight_bytes / (bw * spec.mbu)
    g = spec.gpus
    allreduces = 2 * spec.layers if g > 1 else 0  # a step's, each over every token's activations
    comm_base_s = allreduces * spec.allreduce_latency_s
    comm_token_s = allreduces * 2 * (g - 1) / g * spec.hidden * 2 / spec.allreduce_busbw
    prefill = PrefillFit(base_s=weights_s + spec.step_overhead_s + comm_base_s,
                         per_token_s=2 * spec.params / (flops * spec.mfu) + comm_token_s,
                         per_attn_pair_s=4 * spec.layers * spec.hidden / (flops * spec.mfu), per_seq_s=0.0)
    decode = DecodeFit(base_s=weights_s + spec.step_overhead_s + comm_base_s,
                       per_seq_s=2 * spec.params / (flops * spec.decode_mfu) + comm_token_s,
                       per_ctx_token_s=spec.kv_bytes_per_token / (bw * spec.mbu))
    kv_blocks = int((hbm * 0.9 - spec.weight_bytes) / block_bytes)
    transfer = {path: TransferFit(LinearFit(1e-3, 1 / (gbps * 1e9)), LinearFit(1e-3, 1 / (gbps * 1e9)))
                for path, gbps in (("shm", spec.shm_gbps * spec.gpus), ("network", spec.net_gbps * spec.gpus))}
    limits = EngineLimits(max_num_batched_tokens=spec.max_num_batched_tokens, max_num_seqs=spec.max_num_seqs,
                          num_kv_blocks=kv_blocks, prefill_max_inflight=spec.prefill_max_inflight,
                          kv_bytes_per_block=block_bytes, kvstore_slots=spec.kvstore_slots, gpus_per_worker=spec.gpus)
    return Profile(prefill, decode, transfer, limits, meta={"kind": "roofline", "model": spec.name,
                                                            "spec": spec.__dict__})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.planner.roofline", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama3-8b-h100", choices=sorted(PRESETS))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    Path(args.out).write_text(json.dumps(roofline_profile(PRESETS[args.preset]).to_json(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
