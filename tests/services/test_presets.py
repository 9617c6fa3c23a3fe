"""`pdserve up --preset`, `--plan`, `--router`, `--hosts` and `--dry-run` (services/presets.py, services/up.py).

Fast: `--dry-run` through the CLI prints the resolved settings (flag > plan > preset > default) and every
child's command line; the command lines carry the settings. Slow: each preset really starts, becomes
healthy and answers a chat completion; so does a stack of two played hosts."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.cli import main as pdserve
from services.presets import PRESETS
from tests.services.test_e2e import MODEL

WORKERS = ("prefill", "decode", "colocated")


class DryRun:
    """The output of `pdserve up … --dry-run`: settings by flag, children's argv by name."""

    def __init__(self, text: str):
        self.text = text
        self.settings: dict[str, tuple[str, str]] = {}  # flag → (value, source)
        self.children: dict[str, list[str]] = {}
        in_plan = False
        for line in text.splitlines():
            if line.startswith("pdserve up would start"):
                in_plan = True
            elif in_plan and line.startswith("  "):
                name, rest = line.strip().split(None, 1)
                if " -m services." in rest:  # the servers are described, not command lines: ports come at start
                    self.children[name] = shlex.split(rest)
            elif m := re.match(r"  (--[\w-]+)\s+(\S+)\s+\[(.+)\]$", line):
                self.settings[m[1]] = (m[2], m[3])

    def workers(self) -> dict[str, list[str]]:
        return {name: argv for name, argv in self.children.items() if name.startswith(WORKERS)}

    def kvstores(self) -> dict[str, list[str]]:
        return {name: argv for name, argv in self.children.items() if name.startswith("kvstore")}


def dry_run(capsys, *args: str) -> DryRun:
    """`pdserve up ARGS --dry-run`, in this process (the CLI's own entry point)."""
    assert pdserve(["up", *args, "--dry-run"]) == 0
    return DryRun(capsys.readouterr().out)


def value(argv: list[str], flag: str) -> str:
    """The value after the last `flag` in argv (argparse: the last one wins)."""
    assert flag in argv, (flag, argv)
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


def shown(v: object) -> str:
    return ("on" if v else "off") if isinstance(v, bool) else str(v)


# ------------------------------------------------------------------------------------------- fast


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dry_run_of_each_preset_shows_its_settings_and_passes_them_on(capsys, name):
    preset = PRESETS[name]
    out = dry_run(capsys, "--preset", name)
    assert f"preset {name}: {preset.summary}" in out.text
    for dest, v in preset.settings().items():
        assert out.settings["--" + dest.replace("_", "-")] == (shown(v), f"preset {name}"), dest
    assert out.settings["--hosts"] == ("1", "default")

    workers = out.workers()
    role = "colocated" if preset.mode == "colocated" else "decode"
    expected = [f"{role}-{i}" for i in range(preset.decode)]
    if preset.mode != "colocated":
        expected += [f"prefill-{i}" for i in range(preset.prefill)]
    assert sorted(workers) == sorted(expected)
    assert bool(out.kvstores()) == (preset.mode != "colocated")
    for worker, argv in workers.items():
        assert value(argv, "--max-num-batched-tokens") == str(preset.max_num_batched_tokens), worker
        assert value(argv, "--max-num-seqs") == str(preset.max_num_seqs), worker
        assert value(argv, "--speculative") == preset.speculative, worker
        assert ("--no-prefix-caching" in argv) == (not preset.prefix_caching), worker
        assert ("--no-chunked-prefill" in argv) == (not preset.chunked_prefill), worker

    gateway = out.children["gateway"]
    assert value(gateway, "--mode") == preset.mode
    assert value(gateway, "--router") == preset.router
    for dest in ("conditional_threshold", "conditional_busy_threshold", "conditional_queue_tokens"):
        flag = "--" + dest.replace("_", "-")
        if getattr(preset, dest) is None:
            assert flag not in gateway
        else:
            assert value(gateway, flag) == str(getattr(preset, dest))


def test_explicit_flags_win_over_the_preset(capsys):
    out = dry_run(capsys, "--preset", "batch", "--mode", "disaggregated", "--decode", "2", "--max-num-seqs", "8",
                  "--prefix-caching", "--speculative", "ngram", "--router", "round-robin", "--hot-spot-factor", "2",
                  "--worker-arg=--max-num-batched-tokens=64")
    assert out.settings["--mode"] == ("disaggregated", "flag")
    assert out.settings["--decode"] == ("2", "flag")
    assert out.settings["--max-num-seqs"] == ("8", "flag")
    assert out.settings["--prefix-caching"] == ("on", "flag")
    assert out.settings["--speculative"] == ("ngram", "flag")
    assert out.settings["--router"] == ("round-robin", "flag")
    assert out.settings["--hot-spot-factor"] == ("2.0", "flag")
    assert out.settings["--max-num-batched-tokens"] == ("2048", "preset batch")  # not overridden: the preset's
    assert out.settings["--worker-arg"] == ("--max-num-batched-tokens=64", "flag")
    assert sorted(out.workers()) == ["decode-0", "decode-1", "prefill-0"]
    for argv in out.workers().values():
        assert value(argv, "--max-num-seqs") == "8" and value(argv, "--speculative") == "ngram"
        assert "--no-prefix-caching" not in argv
        # an extra worker argument comes after the settings, so it wins in the worker's argparse
        assert argv.index("--max-num-batched-tokens=64") > argv.index("--max-num-batched-tokens")
    gateway = out.children["gateway"]
    assert value(gateway, "--mode") == "disaggregated" and value(gateway, "--router") == "round-robin"
    assert value(gateway, "--hot-spot-factor") == "2.0"
    assert value(gateway, "--expect") == "prefill=1,decode=2,kvstore=1"


def test_no_preset_is_todays_defaults_and_dry_run_starts_nothing(tmp_path):
    """Through the real `pdserve` command line: every setting [default], the command lines as before
    presets existed (nothing passed on that the children default themselves), no workdir made."""
    workdir = tmp_path / "never-made"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}  # today's defaults, not the env's
    proc = subprocess.run([sys.executable, "-m", "services.cli", "up", "--dry-run", "--workdir", str(workdir)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    out = DryRun(proc.stdout)
    assert all(source == "default" for _, source in out.settings.values()), out.settings
    assert {flag: v for flag, (v, _) in out.settings.items()} == {
        "--mode": "disaggregated", "--prefill": "1", "--decode": "1", "--hosts": "1",
        "--max-num-batched-tokens": "512", "--prefix-caching": "on", "--chunked-prefill": "on",
        "--speculative": "suffix", "--max-num-seqs": "64", "--max-inflight": "4", "--router": "cache-aware",
        "--hot-spot-factor": "1.5",
        "--conditional-threshold": "256", "--conditional-busy-threshold": "1024", "--conditional-queue-tokens": "4096"}
    assert list(out.children) == ["kvstore", "prefill-0", "decode-0", "gateway"]
    assert "nats-server" in proc.stdout and "valkey-server" in proc.stdout
    store = value(out.children["kvstore"], "--store")
    assert re.fullmatch(r"kv-up-\d+", store)
    for argv in out.workers().values():
        assert value(argv, "--kvstore") == store and value(argv, "--speculative") == "suffix"
        assert not {"--max-num-batched-tokens", "--max-num-seqs", "--max-inflight", "--no-prefix-caching",
                    "--no-chunked-prefill"} & set(argv)
    gateway = out.children["gateway"]
    assert value(gateway, "--mode") == "disaggregated" and value(gateway, "--expect") == "prefill=1,decode=1,kvstore=1"
    assert not {"--router", "--hot-spot-factor", "--conditional-threshold"} & set(gateway)  # the gateway's own
    assert not workdir.exists()


def test_hosts_spread_workers_over_one_kvstore_each(capsys):
    out = dry_run(capsys, "--hosts", "2", "--prefill", "2", "--decode", "3", "--kv-slots", "64")
    assert out.settings["--hosts"] == ("2", "flag")
    stores = {name: value(argv, "--store") for name, argv in out.kvstores().items()}
    assert sorted(stores) == ["kvstore-h0", "kvstore-h1"]
    assert re.fullmatch(r"kv-up-\d+-h0", stores["kvstore-h0"])
    assert stores["kvstore-h1"] == stores["kvstore-h0"][:-1] + "1"
    for argv in out.kvstores().values():
        assert value(argv, "--num-slots") == "64"
    host_of = {name: value(argv, "--kvstore") for name, argv in out.workers().items()}
    assert host_of == {"prefill-0": stores["kvstore-h0"], "prefill-1": stores["kvstore-h1"],
                       "decode-0": stores["kvstore-h0"], "decode-1": stores["kvstore-h1"],
                       "decode-2": stores["kvstore-h0"]}
    assert value(out.children["gateway"], "--expect") == "prefill=2,decode=3,kvstore=2"
    slots = [int(value(argv, "--core-slot")) for argv in out.workers().values()]
    assert len(set(slots)) == 5  # one machine: the engines still share its cores, each its own slot
    assert all("--fair-share" in argv for argv in out.workers().values())  # the cores divided among those present
    pinned = dry_run(capsys, "--threads", "3")
    assert all(value(argv, "--threads") == "3" and "--fair-share" not in argv for argv in pinned.workers().values())


def test_a_nats_cluster_s_urls_reach_every_child_spread_over_its_nodes(capsys):
    out = dry_run(capsys, "--nats-cluster", "3", "--prefill", "2", "--decode", "2", "--valkey-ha")
    nodes = {f"nats://127.0.0.1:NATS_PORT_{i}" for i in range(3)}
    lists = {name: value(argv, "--nats").split(",") for name, argv in out.children.items()}
    assert lists and all(sorted(urls) == sorted(nodes) for urls in lists.values()), lists
    assert len({urls[0] for name, urls in lists.items() if name in out.workers()}) >= 2  # not all on one node
    assert {value(argv, "--redis") for argv in out.children.values()} == {
        "redis+sentinel://127.0.0.1:SENTINEL_PORT_0,127.0.0.1:SENTINEL_PORT_1,127.0.0.1:SENTINEL_PORT_2/pdserve"}
    for line in ("nats-2", "valkey-1", "sentinel-2", "work queues replicated 3 ways"):
        assert line in out.text


def test_colocated_has_no_kvstore_on_any_number_of_hosts(capsys):
    out = dry_run(capsys, "--mode", "colocated", "--decode", "2", "--hosts", "2")
    assert not out.kvstores()
    assert sorted(out.workers()) == ["colocated-0", "colocated-1"]
    assert value(out.children["gateway"], "--expect") == "colocated=2"


def test_a_plan_deploys_its_recommended_configuration_between_the_flags_and_the_preset(capsys, tmp_path):
    """`--plan`: a `pdserve plan --json` result's recommended mode, pools, chunk budget and jobs a prefill
    worker; an explicit flag wins over it, and it over the preset (which still gives what the plan does not)."""
    plan = tmp_path / "plan.json"
    rec = {"mode": "disaggregated", "prefill": 2, "decode": 3, "prefill_profile": None, "decode_profile": None,
           "chunk_budget": 1024, "prefill_inflight": 2}
    plan.write_text(json.dumps({"recommended": rec, "runner_ups": []}))
    out = dry_run(capsys, "--plan", str(plan), "--preset", "chat", "--decode", "1")
    assert out.settings["--mode"] == ("disaggregated", "plan plan.json")  # not chat's conditional
    assert out.settings["--prefill"] == ("2", "plan plan.json")
    assert out.settings["--decode"] == ("1", "flag")
    assert out.settings["--max-num-batched-tokens"] == ("1024", "plan plan.json")
    assert out.settings["--max-inflight"] == ("2", "plan plan.json")
    assert out.settings["--conditional-threshold"] == ("512", "preset chat")
    assert sorted(out.workers()) == ["decode-0", "prefill-0", "prefill-1"]
    for argv in out.workers().values():
        assert value(argv, "--max-inflight") == "2" and value(argv, "--max-num-batched-tokens") == "1024"
    assert value(out.children["gateway"], "--expect") == "prefill=2,decode=1,kvstore=1"
    # the autoscaler keeps the SLOs the plan was made for, unless they are given
    plan.write_text(json.dumps({"recommended": rec, "slo": {"ttft_p90_ms": 1500.0, "itl_p90_ms": 80.0}}))
    assert "(SLOs: TTFT p90 1500 ms, ITL p90 80 ms)" in dry_run(capsys, "--plan", str(plan), "--autoscale").text
    assert "(SLOs: TTFT p90 1500 ms, ITL p90 60 ms)" in dry_run(capsys, "--plan", str(plan), "--autoscale",
                                                                "--slo-itl-p90-ms", "60").text
    assert "(SLOs: TTFT p90 2000 ms, ITL p90 250 ms)" in dry_run(capsys, "--autoscale").text
    # colocated: one pool; jobs a prefill worker and the chunk budget left to the defaults when the plan has none
    plan.write_text(json.dumps({"recommended": rec | {"mode": "colocated", "prefill": 0, "chunk_budget": None,
                                                      "prefill_inflight": None}}))
    out = dry_run(capsys, "--plan", str(plan))
    assert sorted(out.workers()) == ["colocated-0", "colocated-1", "colocated-2"]
    assert out.settings["--max-inflight"] == ("4", "default")
    assert out.settings["--max-num-batched-tokens"] == ("512", "default")


@pytest.mark.parametrize("content, error", [
    (None, "cannot read it as a plan"),
    ("not json", "cannot read it as a plan"),
    ('{"rows": {}}', "not the JSON of `pdserve plan --json`"),
    ('{"recommended": null, "runner_ups": []}', "the plan found no configuration that meets its SLOs"),
    ('{"recommended": {"mode": "disaggregated", "prefill": 3, "decode": 1, "prefill_profile": "roofline-tp4"}}',
     "its prefill pool was planned on roofline-tp4, not on the main profile"),
    ('{"recommended": {"prefill": 3}}', "its recommended configuration lacks 'mode'"),
])
def test_a_plan_that_cannot_be_deployed_is_a_clear_error(capsys, tmp_path, content, error):
    plan = tmp_path / "plan.json"
    if content is not None:
        plan.write_text(content)
    assert pdserve(["up", "--plan", str(plan), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"--plan {plan}: {error}" in err and "Traceback" not in err


def test_bad_hosts_is_a_clear_error(capsys):
    assert pdserve(["up", "--hosts", "0", "--dry-run"]) == 2
    assert "--hosts must be at least 1" in capsys.readouterr().err


def test_every_preset_is_documented_and_fits_a_small_machine():
    assert sorted(PRESETS) == ["batch", "chat", "long-doc", "platform"]
    for preset in PRESETS.values():
        assert len(preset.why) > 200 and preset.summary
        assert preset.decode + (0 if preset.mode == "colocated" else preset.prefill) <= 2
    assert PRESETS["batch"].prefix_caching is False and PRESETS["batch"].speculative == "off"
    assert PRESETS["platform"].mode == "disaggregated" and PRESETS["platform"].router == "cache-aware"


# ------------------------------------------------------------------------------------------- slow


def _serve_one_chat(up_args: list[str], workdir: Path, requests: int = 1) -> list[str]:
    """Start `pdserve up UP_ARGS`, wait until healthy, ask `requests` short greedy chat completions,
    stop it with SIGTERM (exit 0, nothing left behind); the answers' texts."""
    from tests.services.test_up_supervision import leftovers, start_up, wait_up_healthy

    up = start_up(workdir, *up_args)
    try:
        wait_up_healthy(up, timeout=150)
        # the gateway answers /health a poll before `up` sees it and says so: a SIGTERM in between
        # (a fast answer on a loaded machine) stopped it before its "pdserve is up"
        deadline = time.monotonic() + 30
        while "pdserve is up" not in up.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        texts = []
        for i in range(requests):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Name a fruit, number {i}."}],
                    "max_tokens": 8, "temperature": 0.0}
            r = httpx.post(f"{up.url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["message"]["content"])
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0, up.log()[-3000:]
        assert not leftovers(up), leftovers(up)
        return texts
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
            up.proc.wait(10)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_starts_and_serves(tmp_path, name):
    texts = _serve_one_chat(["--preset", name, "--kv-slots", "256"], tmp_path)
    assert texts[0].strip(), texts
    log = (tmp_path / "up.log").read_text()
    assert f"[preset {name}]" in log and "pdserve is up" in log


# two played hosts serving through `pdserve up --hosts 2`: tests/services/test_routing_e2e.py::test_two_hosts_…
