"""The shaped-network benchmark's smallest scenario, for real: namespaces, tc, churn, and a clean teardown."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from .swarm_helpers import ROOT

pytestmark = pytest.mark.slow


def namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc"), reason="needs root and iproute2 (CI has both)")
def test_quick_scenario_keeps_stepping_through_churn_and_ends_in_agreement(tmp_path):
    before = namespaces()
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "netswarm.py"),
            "--quick",
            "--lockstep",  # with delayed updates (DPU), churn can end the last two peers one solo step apart (README)
            "--output_json",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    measured = json.loads((tmp_path / "r.json").read_text())
    assert measured["churn_events"] == 1 and measured["global_steps"] == 8
    assert measured["steps_after_last_churn"] >= 2, "global steps must go on after a peer is killed and replaced"
    assert measured["peers_at_the_end"] == 2
    assert measured["max_parameter_difference"] < 2e-3, "no peer may end with different parameters"
    assert measured["bytes_per_peer_step"] > measured["ideal_bytes_per_peer_step"] > 0
    assert "| global steps per minute |" in result.stdout
    assert namespaces() == before, "every namespace the benchmark made must be gone"
    leftovers = subprocess.run(["pgrep", "-f", "run_trainer.py --run_id net"], capture_output=True, text=True).stdout
    assert not leftovers.strip(), f"processes left behind: {leftovers}"
