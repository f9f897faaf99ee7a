"""benchmarks/scale.py: swarms of 4 and 8 simulated trainers (declared compute, a reduced payload) in both modes,
measured as the benchmark measures its full table."""

import json
import subprocess
import sys

import pytest

from sahajbert.localswarm import peer_env

from .swarm_helpers import ROOT

pytestmark = pytest.mark.slow

# what the benchmark's JSON holds for every swarm size (the keys, and what its table prints)
KEYS = {
    "peers",
    "seconds_per_step",
    "compute_seconds_per_step",
    "share_of_peers_per_step",
    "failed_rounds",
    "dht_requests_per_peer_step",
    "peak_rss_mib_per_peer",
    "parameters_agree",
    "matchmaking_seconds_per_round",
    "allreduce_seconds_per_round",
    "mean_group_size",
    "cpu_cores_per_peer",
}


def run_scale(tmp_path, peers: list[int], modes: list[str]) -> tuple[dict, str]:
    """benchmarks/scale.py as a user runs it, at a reduced payload and 4 short steps: its JSON and its output."""
    output = tmp_path / f"scale-{'-'.join(modes)}.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--peers", *map(str, peers), "--modes", *modes]
    command += ["--payload", "100000", "--pass_seconds", "0.5", "--passes_per_step", "2", "--steps", "4"]
    command += ["--warmup_steps", "1", "--sample_every", "0.5", "--output_json", str(output)]
    command += ["--keep_logs", str(tmp_path / "logs")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=peer_env(), cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(output.read_text()), done.stdout


def check_run(result: dict) -> None:
    assert KEYS <= set(result), KEYS - set(result)
    where = f"N={result['peers']} {result['mode']}"
    # every trainer ended with the same parameters, after global steps that the swarm made together
    assert result["parameters_agree"], (where, result["max_parameter_difference"])
    assert result["steps_measured"] >= 2 and 0 < result["share_of_peers_per_step"] <= 1, (where, result)
    # a step takes at least its declared compute (each peer's 2 passes of 0.5 s, slept), of which the peers computed
    # a part
    assert result["seconds_per_step"] >= 2 * 0.5 * 0.95, (where, result)
    assert 0 < result["compute_seconds_per_step"] <= result["seconds_per_step"], (where, result)
    # rounds formed groups of real peers, counted by the averagers themselves, and the DHT answered requests
    assert 2 <= result["mean_group_size"] <= result["peers"], (where, result)
    assert result["allreduce_seconds_per_round"] > 0 and result["dht_requests_per_peer_step"] > 0, (where, result)
    assert result["peak_rss_mib_per_peer"] > 50 and result["cpu_cores_per_peer"] > 0, (where, result)


@pytest.mark.timeout(900)
def test_swarms_of_4_and_8_simulated_trainers_step_together_and_agree(tmp_path):
    # DiLoCo at N = 4 and 8 (its rounds start as soon as every trainer is in), data parallelism at N = 4
    data, out = run_scale(tmp_path, [4, 8], ["diloco"])
    assert [(r["peers"], r["mode"]) for r in data["runs"]] == [(4, "diloco"), (8, "diloco")]
    # the planner is checked on a held-out size only when two smaller ones were fitted
    assert data["planner"] == []
    # the table, with the command that made it
    assert "python benchmarks/scale.py --peers 4 8 --modes diloco" in out and "| N | mode |" in out, out
    more, _ = run_scale(tmp_path, [4], ["data-parallel"])
    assert [(r["peers"], r["mode"]) for r in more["runs"]] == [(4, "data-parallel")]
    for result in data["runs"] + more["runs"]:
        check_run(result)
