"""The GPU check (issue 17, item 3): one script to run on a device machine, writing its results
under $OUT (or --out). Each part is independent: a part that fails records its error and the
others still run, so one short device session gives every answer it can.

    python scripts/gpu_check.py --device cuda --out "$OUT"             # on the H200
    python scripts/gpu_check.py --device cpu --quick --out /tmp/gpu    # here: the same code, Triton interpreted

Parts:
  env      torch / triton / CUDA versions, the device's name and memory (nvidia-smi when present)
  kernels  the Triton paged-attention kernel on the device against the torch reference, for every
           case of tests/kernels/test_paged_attention.py (decode, prefill chunks, GQA ratios, mixed
           batches) plus SmolLM2's own shape in bf16; max error per case, and the kernel's time
  engine   the engine on the device against the CPU fp32 reference: the tiny random model's greedy
           tokens (and on CUDA, its decode steps from captured graphs against the eager ones), and — when the default model file is on the machine — the README question's
           first 16 greedy tokens in the default precision
Not here yet (they need what the device machine lacks today: pdserve's non-torch dependencies and
the 98 MB model file, over the 64 MiB a run may carry): the whole `pdserve up` stack on the GPU and
the decode/prefill/KV-transfer benchmark. BENCHMARKS.md's GPU section says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def part_env(device: str) -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "device": device,
           "cuda_available": torch.cuda.is_available()}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        out |= {"cuda": torch.version.cuda, "name": props.name, "memory_gib": props.total_memory / 2**30}
        try:
            out["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            pass
    return out


def part_kernels(device: str, quick: bool) -> dict:
    import torch

    from shared.kernels import paged_attention
    from tests.kernels.test_paged_attention import CASES, GQA, make_batch

    cases = dict(list(CASES.items())[:2]) if quick else CASES
    heads_list = GQA[:1] if quick else GQA
    results, worst = {}, 0.0
    for name, specs in cases.items():
        for heads in heads_list:
            args = make_batch(specs, 16, *heads, head_dim=32)
            moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
            expected = paged_attention(*args, backend="torch")
            got = paged_attention(*moved, backend="triton").cpu()
            err = (got.double() - expected.double()).abs().max().item()
            results[f"{name}/hq{heads[0]}_hkv{heads[1]}"] = err
            worst = max(worst, err)
    # SmolLM2's shape (Hq 9, Hkv 3, D 64), bf16 as the GPU engine runs it: error and time. (The
    # Triton interpreter cannot do bf16 — it stores float bit patterns as numbers, 0x2F800000 =
    # 796917760 — so on CPU the same shape runs in fp16; only a GPU answers for bf16.)
    half = torch.bfloat16 if device.startswith("cuda") else torch.float16
    args = make_batch(CASES["mixed"], 16, 9, 3, head_dim=64, dtype=half)
    moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    expected = paged_attention(*args, backend="torch").double()
    got = paged_attention(*moved, backend="triton")
    bf16_err = (got.cpu().double() - expected).abs().max().item()
    timing = None
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            paged_attention(*moved, backend="triton")
        torch.cuda.synchronize()
        timing = (time.perf_counter() - t0) / 50
    return {"max_abs_err_fp32": worst, "cases": results, "smollm2_half_dtype": str(half),
            "smollm2_half_max_abs_err": bf16_err, "smollm2_half_seconds": timing,
            "ok": worst < 1e-3 and bf16_err < 5e-2}


def part_engine(device: str, quick: bool) -> dict:
    from shared.config import EngineConfig, SpecConfig
    from shared.engine.engine import LLMEngine
    from shared.model.sampling_params import SamplingParams
    from tests.model_utils import tiny_model

    greedy = SamplingParams(temperature=0.0, max_tokens=8 if quick else 24, ignore_eos=True)
    prompts = [[1, 5, 9, 13, 17], list(range(2, 40)), [7] * 20]
    out: dict = {}
    config = {"num_kv_blocks": 64, "kv_cache_dtype": "float32", "speculative": SpecConfig(mode="off")}
    reference = LLMEngine(tiny_model(seed=3), None, EngineConfig(**config))
    ref_tokens = [o.new_token_ids for o in reference.generate(prompts, greedy)]
    model = tiny_model(seed=3).to(device)
    on_device = LLMEngine(model, None, EngineConfig(**config, device=device))  # decode graphs on CUDA
    dev_tokens = [o.new_token_ids for o in on_device.generate(prompts, greedy)]
    eager = LLMEngine(model, None, EngineConfig(**config, device=device, fused_forward=False))
    eager_tokens = [o.new_token_ids for o in eager.generate(prompts, greedy)]
    graphs = on_device.runner.graphs
    out["tiny_model"] = {"reference": ref_tokens, "device": dev_tokens, "equal": ref_tokens == dev_tokens,
                         "device_eager": eager_tokens, "graphs_equal_eager": dev_tokens == eager_tokens,
                         "decode_graphs": None if graphs is None else
                         {"buckets": graphs.buckets, "capture_seconds": graphs.capture_seconds}}
    from shared.model.hub import default_model_path
    path = default_model_path()
    if path is not None and Path(path).exists() and not quick:
        from shared.model.chat_template import render_chat
        exact = LLMEngine.from_config(EngineConfig(model=str(path), num_kv_blocks=128, quantization="none",
                                                   kv_cache_dtype="float32", speculative=SpecConfig(mode="off")))
        tok = exact.tokenizer
        ids = tok.encode(render_chat(tok.chat_template, [{"role": "user", "content": "What is the capital of France?"}]),
                         add_special_tokens=False)
        params = SamplingParams(temperature=0.0, max_tokens=16)
        [ref] = exact.generate([ids], params)
        dev = LLMEngine.from_config(EngineConfig(model=str(path), num_kv_blocks=128, device=device,
                                                 dtype="bfloat16" if device.startswith("cuda") else "float32",
                                                 speculative=SpecConfig(mode="off")))
        [got] = dev.generate([ids], params)
        out["default_model"] = {"reference": ref.text, "device": got.text,
                                "first_tokens_equal": ref.new_token_ids[:8] == got.new_token_ids[:8]}
    else:
        out["default_model"] = "skipped: the model file is not on this machine" if not quick else "skipped: --quick"
    return out


PARTS = {"env": part_env, "kernels": part_kernels, "engine": part_engine}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--quick", action="store_true", help="a few cases only (the CPU self-check)")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            fn = PARTS[name]
            result = fn(args.device) if name == "env" else fn(args.device, args.quick)
            status = "ok"
        except Exception as exc:  # noqa: BLE001 - a failing part is a result; the others still run
            result, status = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}, "error"
        if status == "ok" and result.get("ok") is False:
            status = "failed"  # it ran, and its numbers are wrong
        result = {"status": status, "seconds": time.perf_counter() - t0, **result}
        (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
        summary[name] = status
        print(f"{name}: {status} ({result['seconds']:.1f} s)", flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if all(s == "ok" for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
