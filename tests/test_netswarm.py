"""benchmarks/netswarm.py: the quick scenario behind NAT (`make test`); heterogeneous links and the real model size
(`make test-scale`). Network namespaces, veth pairs and tc need root; CI runs as root."""

import json
import os
import subprocess
import sys

import psutil
import pytest

from sahajbert.localswarm import peer_env
from sahajbert.train_log import read_train_log

from .swarm_helpers import ROOT, no_alarms, require

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _root():
    require(os.geteuid() == 0, "root", "network namespaces, veth pairs and tc need it: run the suite as root")


def namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.strip()}


@pytest.mark.timeout(960)
def test_quick_scenario_behind_nat_keeps_stepping_through_churn_and_ends_in_agreement(tmp_path):
    # `--quick --nat 2`: two trainers and the replacement after churn, each behind its own masquerading router (only
    # replies come in); they book slots on the first peer's relay once AutoNAT finds them private and reach each
    # other through it (or directly, where libp2p's hole punching gets through). The trainers' defaults: delayed
    # parameter updates (DPU), then one final parameter round at --max_steps. The churn event SIGKILLs a trainer (a
    # crash: its partner must go on) once a newcomer, started two steps before, has downloaded the state and trains.
    # No relay takes the newcomer (--no_auto_relay): it falls back to client mode by itself and trains with the
    # survivor.
    before = namespaces()
    result_path = tmp_path / "result.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "netswarm.py"), "--quick", "--nat", "2", "--timeout", "480"]
        + ["--newcomer_without_relay"]
        + ["--output_json", str(result_path), "--keep_logs", str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=900,
        env=peer_env(),
        cwd=ROOT,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    result = json.loads(result_path.read_text())
    # latency is really there, once per direction: the shortest of several round trips between the trainers'
    # routers is 2 * (12.5 + 37.5) ms, plus what the userspace switch adds (a busy machine delays only some tries)
    assert 97 <= result["round_trip_ms"] < 190, result
    assert result["churn_events"] == 1
    assert result["global_steps"] == 8
    assert result["steps_after_last_churn"] >= 3, "global steps must keep being made after the churn event"
    # what run_trainer.py --check tells a volunteer in each situation
    checks = result["reachability_checks"]
    assert checks["public address"].startswith("[ ok ] reachable from outside: public address"), checks
    assert "[ ok ] reachable from outside: behind NAT, reachable through the relay" in checks["behind NAT"], checks
    assert (
        "[warn] reachable from outside: behind NAT and not reachable through a relay"
        in checks["behind NAT, --no_auto_relay"]
    ), checks
    assert all(result["nat"].values()) and len(result["nat"]) == 3, result["nat"]
    logs = {name: (tmp_path / "logs" / f"{name}.log").read_text() for name in result["nat"]}
    for name in ("trainer0", "trainer1"):
        assert "behind NAT: other peers reach this one through the relay" in logs[name], (name, logs[name][-3000:])
    # churn is a healthy run's event: a crashed peer, a newcomer's fallback to client mode, a relay between NAT'd
    # trainers, and nothing alarming in any peer's terminal
    for text in [*logs.values(), (tmp_path / "logs" / "first_peer.log").read_text()]:
        no_alarms(text)
    newcomer = logs["trainer2"]
    assert "behind NAT and not reachable through a relay: joining again in client mode" in newcomer, newcomer[-3000:]
    # in client mode it still averaged with the others (it joins before the churn event's victim dies): global steps,
    # and the final round, with the survivor
    assert max(r.peers for r in read_train_log(tmp_path / "logs" / "trainer2")) >= 2, newcomer[-3000:]
    assert result["seconds_per_round"] is not None, "gradient all-reduce rounds between NAT'd trainers finished"
    # the newcomer's state came from a trainer behind NAT: no other peer of this swarm holds one
    assert [d["servers_behind_nat"] for d in result["state_downloads"]] == [True], result["state_downloads"]
    assert result["peers_at_the_end"] == 2
    assert max(result["final_round_peers"]) == 2, ("the two finishers averaged once more", peer_log_lines(tmp_path))
    assert result["parameters_agree"], (result["max_parameter_difference"], peer_log_lines(tmp_path))
    assert "| global steps per minute |" in run.stdout, "the result table is printed"
    assert namespaces() == before, "every namespace the run made is gone"
    # this run's switch (another run's may be serving its own network meanwhile)
    leftovers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if f"--network {result['network']}" in " ".join(p.info["cmdline"] or [])
    ]
    assert not leftovers, "the delay switch stopped with the run"
    assert "frames forwarded" in (tmp_path / "logs" / "delayswitch.log").read_text() or result["latency_by"] == "netem"


def run_netswarm(tmp_path, *flags, timeout=900) -> dict:
    result_path = tmp_path / "result.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "netswarm.py"), *flags]
        + ["--output_json", str(result_path), "--keep_logs", str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=peer_env(),
        cwd=ROOT,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return json.loads(result_path.read_text())


# what a trainer logs about the end of its run and about rounds that came back incomplete: shown when peers disagree
END_OF_RUN = ("final parameter", "averaging parameters", "results", "round failed", "stopped at")


def peer_log_lines(tmp_path, words=END_OF_RUN) -> list[str]:
    """The lines of every peer's log that hold any of `words`, each prefixed by the peer's name."""
    return [
        f"{log.stem}: {line}"
        for log in sorted((tmp_path / "logs").glob("*.log"))
        for line in log.read_text().splitlines()
        if any(word in line for word in words)
    ]


@pytest.mark.scale
@pytest.mark.timeout(960)
def test_each_trainer_measures_its_link_and_declares_it(tmp_path):
    # 200/200, 100/20 and 20/5 Mbit/s; with the tiny model a global step's all-reduce is ~0.5 MB per peer
    result = run_netswarm(tmp_path, "--heterogeneous", "--trainers", "3", "--max_steps", "5", "--timeout", "600")
    ceiling = result["switch_ceiling_mbit"] or float("inf")
    bandwidth = result["bandwidth"]
    for name, link in bandwidth.items():  # a failed probe is tried again within the run, and then declared
        probe_lines = [line for line in (tmp_path / "logs" / f"{name}.log").read_text().splitlines() if "link" in line]
        assert link["declared_mbit"] is not None, (name, probe_lines)
    # the userspace switch forwards 600-2,100 Mbit/s when idle, but the three trainers probe at once while they start
    # on the same 2 cores, so how close a fast link's probe comes depends on the machine's load: the 200 Mbit/s link
    # measured 159-164 on an idle machine and 132.9 in a CI run (its 100 Mbit/s download 71.0). Within 25% is asserted
    # for links at most 1/40 of the switch's idle ceiling (the 20 and 5 Mbit/s ones at 800 Mbit/s and up); for every
    # link, never above its shaper (no probe beats the token bucket); and the fast link measured as the fastest (by
    # how much depends on the load again)
    for name, link in bandwidth.items():
        assert link["declared_mbit"] <= 1.25 * link["shaped_mbit"], (name, link)
        if link["shaped_mbit"] <= ceiling / 40:
            assert link["declared_mbit"] == pytest.approx(link["shaped_mbit"], rel=0.25), (name, link)
    fast = max(bandwidth, key=lambda name: bandwidth[name]["shaped_mbit"])
    others = [link["declared_mbit"] for name, link in bandwidth.items() if name != fast]
    assert bandwidth[fast]["declared_mbit"] > max(others), f"the fast link is measured as the fastest: {bandwidth}"
    # (which peer sends the most bytes is not asserted: at this size a round is 0.5 MB per peer, small next to DHT
    # and TCP traffic, and in a CI run the 20/5 trainer, which joined a step late, sent the most; benchmarks/README.md
    # compares the two balances)
    assert result["parameters_agree"], (result["max_parameter_difference"], peer_log_lines(tmp_path))


@pytest.mark.scale
@pytest.mark.timeout(1560)
def test_sahajbert_on_broadband_with_the_default_timing(tmp_path):
    # the real model (its layers; the vocabulary of the bundled sample tokenizer) on 100/20 Mbit/s, 100 ms apart:
    # with hand-tuned tiny-model timeouts every gradient round of this scenario failed
    result = run_netswarm(
        tmp_path,
        *("--model", "sahajbert", "--trainers", "2", "--max_steps", "3", "--target_batch_size", "64"),
        *("--timeout", "1200"),
        timeout=1500,
    )
    # no round failed while the run trained (every record counts 0), nor the last step's gradient round, which
    # runs after the last record: the trainer whose pass was under way when the other began that step makes it too
    names = ("trainer0", "trainer1")
    records = [r for name in names for r in read_train_log(tmp_path / "logs" / name)]
    failures = peer_log_lines(tmp_path, ("round failed",))
    assert records and all(r.failed_rounds == 0 for r in records), ([r.failed_rounds for r in records], failures)
    assert result["failed_rounds"] == 0, (result["failed_rounds"], failures)
    assert result["global_steps"] == 3
    assert min(result["final_round_peers"]) == 2, (result["final_round_peers"], peer_log_lines(tmp_path))
    assert result["parameters_agree"], (result["max_parameter_difference"], peer_log_lines(tmp_path))
    assert result["seconds_per_round"] is not None, "gradient rounds were timed"
