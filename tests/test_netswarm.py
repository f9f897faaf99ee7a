"""benchmarks/netswarm.py --quick: two trainers on shaped links with latency, one churn event (needs root)."""

import json
import os
import subprocess
import sys

import psutil
import pytest

from sahajbert.localswarm import peer_env

from .swarm_helpers import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces, veth pairs and tc need root"),
]


def namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.strip()}


def test_quick_scenario_keeps_stepping_through_churn_and_ends_in_agreement(tmp_path):
    before = namespaces()
    result_path = tmp_path / "result.json"
    # the trainers' defaults: delayed parameter updates (DPU), then one final parameter round at --max_steps
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "netswarm.py"), "--quick", "--timeout", "420"]
        + ["--output_json", str(result_path), "--keep_logs", str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=900,
        env=peer_env(),
        cwd=ROOT,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    result = json.loads(result_path.read_text())
    # latency is really there: the measured round trip between the trainers' hosts is 2 * (12.5 + 37.5) ms
    assert 90 <= result["round_trip_ms"] <= 150, result
    assert result["churn_events"] == 1
    assert result["global_steps"] == 8
    assert result["steps_after_last_churn"] >= 3, "global steps must keep being made after the churn event"
    assert result["peers_at_the_end"] == 2
    assert max(result["final_round_peers"]) == 2, "the two finishers averaged their parameters once more"
    assert result["parameters_agree"], f"final peers differ by up to {result['max_parameter_difference']:.2e}"
    assert "| global steps per minute |" in run.stdout, "the result table is printed"
    assert namespaces() == before, "every namespace the run made is gone"
    leftovers = [
        p for p in psutil.process_iter(["cmdline"]) if "benchmarks/delayswitch.py" in " ".join(p.info["cmdline"] or [])
    ]
    assert not leftovers, "the delay switch stopped with the run"
    assert "frames forwarded" in (tmp_path / "logs" / "delayswitch.log").read_text() or result["latency_by"] == "netem"
