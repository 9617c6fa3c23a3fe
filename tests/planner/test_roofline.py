"""The roofline profiles: tensor-parallel all-reduces priced, and the shipped files are what the code writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.planner.roofline import PRESETS, roofline_profile

PROFILES = Path(__file__).parents[2] / "shared/sim/profiles"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_shipped_roofline_files_are_what_the_presets_give(preset):
    assert json.loads((PROFILES / f"roofline-{preset}.json").read_text()) == \
        json.loads(json.dumps(roofline_profile(PRESETS[preset]).to_json()))


def test_one_gpu_has_no_all_reduce_and_a_group_pays_two_a_layer():
    spec = PRESETS["llama3-8b-h100"]
    assert spec.gpus == 1
    one = roofline_profile(spec)
    assert one.prefill.per_token_s == pytest.approx(2 * spec.params / (spec.peak_flops * spec.mfu))
    tp8 = PRESETS["llama3-70b-tp8-h100"]
    p = roofline_profile(tp8)
    compute = 2 * tp8.params / (8 * tp8.peak_flops * tp8.mfu)
    ring = 2 * tp8.layers * (2 * 7 / 8) * tp8.hidden * 2 / tp8.allreduce_busbw  # 12.7 µs a token
    assert p.prefill.per_token_s == pytest.approx(compute + ring)
    assert p.prefill.base_s - p.decode.base_s == 0
    assert p.prefill.base_s == pytest.approx(tp8.weight_bytes / (8 * tp8.peak_bw * tp8.mbu) + tp8.step_overhead_s
                                             + 2 * tp8.layers * tp8.allreduce_latency_s)


def test_half_the_group_is_cheaper_per_gpu_for_prefill_and_dearer_for_decode():
    """Prefill is compute: per GPU, a TP4 worker's token costs less than a TP8 worker's (less of the
    all-reduce). Decode reads the weights each step: a TP8 worker amortizes them over more
    sequences within a 40 ms step, and holds more KV, so it carries more per GPU."""
    tp8, tp4 = (roofline_profile(PRESETS[f"llama3-70b-tp{g}-h100"]) for g in (8, 4))
    gpu_s = {g: p.prefill.per_token_s * g for g, p in ((8, tp8), (4, tp4))}
    assert gpu_s[4] < gpu_s[8] * 0.9
    ctx = 8000

    def per_gpu(p, g):
        d = p.decode
        batch = (0.040 - d.base_s) / (d.per_seq_s + ctx * d.per_ctx_token_s)
        batch = min(batch, p.limits.num_kv_blocks * 16 / ctx)
        return batch / g

    assert per_gpu(tp8, 8) > 1.3 * per_gpu(tp4, 4)
