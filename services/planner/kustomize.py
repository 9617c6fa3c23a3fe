"""A plan on Kubernetes: `pdserve plan ... --kustomize DIR` writes a kustomize overlay over one of
deploy/k8s's (default: production) that deploys the recommended configuration.

    DIR/kustomization.yaml   the base overlay; prefill and decode replicas at the plan's counts
    DIR/plan.yaml            the workers' chunk budget and jobs a prefill worker takes (env), the
                             gateway's mode, and `pdserve planner`'s flags: the SLOs planned for,
                             the plan's budget, and the forecast policy sized by what one worker of
                             each pool carries at those SLOs (`--capacity`, as the plan printed it)

    kubectl apply -k DIR     (or kubectl kustomize DIR to read it first)

What the deploy files run is a CPU worker pool each for prefill and decode, so a plan for one pool
of colocated engines, or on another profile per pool (a tensor-parallel group), is refused with the
reason rather than written wrong."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from services.planner.plan import deployment

DEFAULT_BASE = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "overlays" / "production"
PLANNER_INTERVAL_S = 15  # the overlays' own decision interval


def overlay(result: dict[str, Any], base: Path = DEFAULT_BASE, resource: str | None = None) -> dict[str, str]:
    """The overlay's files (name → YAML text) for a plan's JSON (`result`), over `base` (named in the
    kustomization as `resource`: a path relative to where the files go); ValueError where the plan
    is not one the deploy files can run."""
    rec = result.get("recommended")
    if rec is None:
        raise ValueError("the plan has no recommended configuration to deploy")
    settings = deployment(rec)  # raises for pools on another profile
    if settings["mode"] == "colocated":
        raise ValueError("a colocated plan is not written for Kubernetes: the deploy files run separate prefill "
                         "and decode pools (plan with --modes disaggregated,conditional)")
    if not (Path(base) / "kustomization.yaml").exists():
        raise ValueError(f"{base}: not a kustomize overlay (no kustomization.yaml)")
    prefill, decode = settings["prefill"], settings["decode"]
    budget = max(int(result.get("budget") or prefill + decode), prefill + decode)
    engine_env = {"PDSERVE_MAX_NUM_BATCHED_TOKENS": settings.get("max_num_batched_tokens")}
    patches = [
        _deployment("prefill", "pdserve", env=engine_env | {"PDSERVE_MAX_INFLIGHT": settings.get("max_inflight")}),
        _deployment("decode", "pdserve", env=engine_env),
        _deployment("gateway", "pdserve", env={"PDSERVE_MODE": settings["mode"]}),
        _deployment("planner", "planner", args=planner_args(result, prefill, decode, budget)),
    ]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [resource or str(base)],
        "replicas": [{"name": "prefill", "count": prefill}, {"name": "decode", "count": decode}],
        "patches": [{"path": "plan.yaml"}],
    }
    head = (f"# written by `pdserve plan --kustomize`: {rec['mode']}, {prefill} prefill + {decode} decode workers, "
            f"{_slo_text(result)}\n")
    return {"kustomization.yaml": head + yaml.safe_dump(kustomization, sort_keys=False),
            "plan.yaml": head + yaml.safe_dump_all([p for p in patches if p is not None], sort_keys=False)}


def planner_args(result: dict[str, Any], prefill: int, decode: int, budget: int) -> list[str]:
    """`pdserve planner`'s flags for the plan: each pool from one worker up to what the budget leaves
    it, the plan's SLOs, and the forecast policy by what a worker carries where the plan measured it
    (a disaggregated plan), else the reactive policy."""
    slo = result.get("slo") or {}
    args = ["--min-prefill", "1", "--max-prefill", str(max(prefill, budget - 1)),
            "--min-decode", "1", "--max-decode", str(max(decode, budget - 1)), "--budget", str(budget),
            "--autoscale-interval", str(PLANNER_INTERVAL_S)]
    if slo.get("ttft_p90_ms"):
        args += ["--slo-ttft-p90-ms", f"{slo['ttft_p90_ms']:g}"]
    if slo.get("itl_p90_ms"):
        args += ["--slo-itl-p90-ms", f"{slo['itl_p90_ms']:g}"]
    cap = result.get("capacity_rps_per_worker")
    if cap:
        args += ["--policy", "forecast", "--capacity", f"{cap['prefill']:.4g},{cap['decode']:.4g}"]
    return args


def write(result: dict[str, Any], out: Path, base: Path = DEFAULT_BASE) -> list[Path]:
    """Write the overlay into `out` (created); the files written."""
    out = Path(out)
    files = overlay(result, base, os.path.relpath(Path(base).resolve(), out.resolve()))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        (out / name).write_text(text)
        written.append(out / name)
    return written


def _deployment(name: str, container: str, env: dict[str, Any] | None = None,
                args: list[str] | None = None) -> dict[str, Any] | None:
    """A strategic-merge patch of one container of a Deployment (None: nothing to set)."""
    c: dict[str, Any] = {"name": container}
    values = [{"name": k, "value": str(v)} for k, v in (env or {}).items() if v is not None]
    if values:
        c["env"] = values
    if args is not None:
        c["args"] = args
    if len(c) == 1:
        return None
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"template": {"spec": {"containers": [c]}}}}


def _slo_text(result: dict[str, Any]) -> str:
    slo = result.get("slo") or {}
    if not (slo.get("ttft_p90_ms") and slo.get("itl_p90_ms")):
        return "its SLOs"
    return f"TTFT p90 <= {slo['ttft_p90_ms']:g} ms, ITL p90 <= {slo['itl_p90_ms']:g} ms"
