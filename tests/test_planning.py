"""benchmarks/plan_run.py (the run planner) and the pieces of NAT traversal that need no network."""

import json
import runpy
from pathlib import Path

import pytest

from sahajbert.flags import SwarmArguments
from sahajbert.hivemind_ext.p2p import relay_options
from sahajbert.swarm import public_ip, relays_of

ROOT = Path(__file__).resolve().parents[1]
PLAN = runpy.run_path(str(ROOT / "benchmarks" / "plan_run.py"))
Peer = PLAN["Peer"]


def test_butterfly_moves_twice_the_payload_with_equal_peers_and_balances_by_bandwidth():
    payload = 10e6  # bytes
    equal = [Peer(1.0, 20, 100, 50)] * 4
    # each of 4 peers sends 3/4 of the payload as parts and 3/4 back as averaged shares, over its 20 Mbit/s upload
    assert PLAN["butterfly_seconds"](equal, payload) == pytest.approx(2 * 0.75 * payload * 8 / 20e6)
    # a client-mode peer reduces nothing: the 3 others take a third each, and each sends 2/3 of the payload as
    # parts plus its averaged third to the 3 others
    with_client = [Peer(1.0, 20, 100, 50)] * 3 + [Peer(1.0, 20, 100, 50, client=True)]
    assert PLAN["butterfly_seconds"](with_client, payload) == pytest.approx(payload * 8 / 20e6 * (2 / 3 + 1))
    # a fast peer takes a larger share, so the slow ones finish sooner than with an equal split
    mixed = [Peer(1.0, 200, 200, 50), Peer(1.0, 5, 20, 50), Peer(1.0, 5, 20, 50)]
    slow_peer_equal_split = (payload * 2 / 3 + 2 * payload / 3) * 8 / 5e6
    assert PLAN["butterfly_seconds"](mixed, payload) < slow_peer_equal_split
    assert PLAN["butterfly_seconds"]([Peer(1.0, 20, 100, 50)], payload) == 0.0


def test_step_time_adds_compute_protocol_and_bytes():
    constants = {"overhead": 1.0, "per_peer": 2.0, "per_client": 3.0, "efficiency": 0.5}
    peers = [Peer(10.0, 1, 1, 1)] * 2 + [Peer(10.0, 1, 1, 1, client=True)]
    seconds, compute, communication = PLAN["step_seconds"](peers, 1_000_000, 300, constants)
    moving = PLAN["butterfly_seconds"](peers, 2e6) * 2  # fp16 gradients and parameters, 2 bytes each
    assert compute == pytest.approx(10.0)
    assert communication == pytest.approx(1.0 + 2 * 2.0 + 3.0 + moving / 0.5)
    assert seconds == pytest.approx(compute + communication)


def test_calibration_recovers_constants_from_runs_it_made(tmp_path):
    truth = {"overhead": 2.0, "per_peer": 1.5, "per_client": 0.75, "efficiency": 0.5}
    runs = []
    # (trainers, of them in client mode, upload Mbit/s, samples/s each): peer counts, clients and links vary
    for trainers, clients, up, rate in ((2, 0, 20, 100.0), (3, 1, 5, 100.0), (4, 0, 1000, 20.0), (3, 0, 2, 50.0)):
        run = {
            "model": "tiny",
            "parameters": 2_000_000,
            "target_batch_size": 384,
            "compression": "fp16",
            "trainer_links": {
                f"trainer{i}": {
                    "up_mbit": up,
                    "down_mbit": 5 * up,
                    "one_way_ms": 25.0,
                    "client": i >= trainers - clients,
                    "samples_per_compute_second": rate,
                }
                for i in range(trainers)
            },
        }
        run["seconds_per_step"] = PLAN["predict_run"](run, truth)
        runs.append(run)
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    assert PLAN["fit"](PLAN["load"]([str(tmp_path / "runs.json")])) == truth


def scale_run(peers: int, mode: str, constants: dict) -> dict:
    """A benchmarks/scale.py result as its JSON holds it, its seconds per step made by the planner from `constants`."""
    run = {
        "peers": peers,
        "mode": mode,
        "pass_seconds": 2.0,
        "samples_per_pass": 8,
        "target_batch_size": peers * 4 * 8,  # 4 passes per peer and step
        "payload_parameters": 100_000,
        "compression": "fp16",
    }
    run["seconds_per_step"] = PLAN["predict_run"](run, constants)
    return run


def test_the_scale_up_is_fitted_on_the_smaller_swarms_and_checked_on_the_largest():
    truth = {"overhead": 0.5, "per_peer": 0.75, "per_client": 0.0, "efficiency": 1.0, "growth": "log2"}
    runs = [scale_run(peers, mode, truth) for mode in ("data-parallel", "diloco") for peers in (4, 8, 16, 32)]
    # each run's compute: its 4 passes of 2 s, whatever the swarm's size (the target batch grows with it)
    for run in runs:
        peers = PLAN["peers_of_run"](run)
        assert len(peers) == run["peers"]
        assert PLAN["step_seconds"](peers, 100_000, run["target_batch_size"], truth)[1] == pytest.approx(8.0)
    checks = PLAN["hold_out"](runs, "log2")
    assert [(c["mode"], c["fitted_on_peers"], c["held_out_peers"]) for c in checks] == [
        ("data-parallel", [4, 8, 16], 32),
        ("diloco", [4, 8, 16], 32),
    ]
    for check in checks:
        assert check["constants"]["overhead"] == pytest.approx(0.5, abs=1e-6)
        assert check["constants"]["per_peer"] == pytest.approx(0.75, abs=1e-6)
        assert check["error"] == pytest.approx(0.0, abs=1e-6)
    # protocol that grows with every further peer: the log2 model, fitted on 4-16, falls short at 32
    linear = {**truth, "growth": "linear"}
    check = PLAN["hold_out"]([scale_run(peers, "diloco", linear) for peers in (4, 8, 16, 32)], "log2")[0]
    assert check["error"] < -0.2, check
    # two sizes of a mode are too few to fit two constants and hold one out
    assert PLAN["hold_out"]([scale_run(peers, "diloco", truth) for peers in (4, 32)]) == []


def test_plan_prints_days_and_rejects_a_bad_swarm_in_one_line(capsys):
    assert PLAN["main"](["--preset", "sahajbert-2021", "--steps", "1000"]) == 0
    out = capsys.readouterr().out
    assert "| days to 1,000 steps |" in out and "(56 peers)" in out
    # beside it, the same swarm with the protocol's terms fitted on benchmarks/scale.py's larger swarms: cheaper per
    # further peer, so a faster step
    rows = dict(line.strip("|").rsplit("|", 1) for line in out.splitlines() if line.startswith("| seconds per"))
    fitted = float(rows[" seconds per global step, protocol fitted on 4-16 peers (benchmarks/scale.py) "])
    assert 0 < fitted < float(rows[" seconds per global step "])
    # SystemExit with a message: Python prints it as the one line on stderr, with exit code 1
    with pytest.raises(SystemExit) as bad:
        PLAN["main"](["--swarm", "4xGTX@broadband"])
    assert isinstance(bad.value.code, str) and "\n" not in bad.value.code, bad.value.code
    assert bad.value.code.startswith("error: --swarm item") and "expected COUNTxKIND@LINK" in bad.value.code


def test_relay_options_book_the_initial_peers_and_size_the_relay_for_averaging():
    first = "/ip4/31.77.0.1/tcp/31337/p2p/12D3KooWGWn1HNMv3LKnLgpbWQTqVjibrBXd37rwaD1WNqbMmSAQ"
    options = relay_options(True, [first], "auto", client_mode=False)
    assert options["dht"] == {"use_auto_relay": True, "trusted_relays": [first]}
    # static relays at once (no 3-minute discovery), and libp2p's largest limits (its 128 KiB default resets rounds)
    assert options["daemon"] == {"relayDataLimit": 1 << 32, "relayTimeLimit": "3600s", "relayDiscovery": False}
    assert "use_auto_relay" not in relay_options(True, [first], "auto", client_mode=True)["dht"]
    assert relay_options(False, [first], "private", False)["dht"] == {"force_reachability": "private"}
    assert public_ip(first) and not public_ip("/ip4/192.168.1.2/tcp/1") and not public_ip("/ip4/127.0.0.1/tcp/1")
    assert relays_of(SwarmArguments(initial_peers=[first])) == [first]
