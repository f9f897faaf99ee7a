"""A misbehaving peer in the swarm (tests/attacker.py: the trainer's own code, speaking the protocol, with corrupted
gradients, averages and progress claims) beside two honest trainers, each in its own process, on 127.0.0.1.

A clean run of the two honest trainers comes first (it also checks what a plain two-trainer run must give); the
honest trainers keep their identities (so their data order) in every run.
"""

import os
import re

import pytest
import torch

from sahajbert.checkpoints import latest_checkpoint
from sahajbert.localswarm import PeerProcess, wait_for
from sahajbert.model import load_model
from sahajbert.train_log import read_train_log as train_log

from .swarm_helpers import TINY_TRAINING, first_peer, script, start_peer, swarm_loss

# Not yet reliable enough for CI (2 of 4 local runs passed in this form; see benchmarks/README.md): run it with
# SAHAJBERT_SWARM_ATTACK_TEST=1 python -m pytest tests/test_robustness.py
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("SAHAJBERT_SWARM_ATTACK_TEST") != "1",
        reason="opt-in until reliable: SAHAJBERT_SWARM_ATTACK_TEST=1",
    ),
]

STEPS = 7
# a small batch, so that a step takes seconds and every peer, the attacker included, takes part in most rounds
COMMON = ["--max_steps", str(STEPS), "--target_batch_size", "96", "--final_averaging_window", "20"]
# the attacker's phases, by global step from the first with both honest trainers: NaN gradients while claiming to
# be 30 steps ahead with x100 samples, then x1e4-scaled and sign-flipped gradients, then averages x1e4 for the
# parts it reduces (caught at once, after which it is left out)
PLAN = "3@nan+progress:2,scaled:1,sign_flipped:1,bad_reducer"


def honest(tmp_path, name, run_id, initial_peers, *extra) -> PeerProcess:
    identity = tmp_path / f"{name}.key"  # the same identity in every run: the same data order
    return start_peer(
        "run_trainer.py",
        tmp_path / run_id,
        name,
        run_id,
        initial_peers,
        *COMMON,
        "--identity_path",
        str(identity),
        *extra,
    )


def attacker(tmp_path, run_id, initial_peers, plan: str, *extra) -> PeerProcess:
    args = [plan, "--run_id", run_id, "--initial_peers", *initial_peers, *TINY_TRAINING, *COMMON, *extra]
    args += ["--output_dir", str(tmp_path / run_id / "attacker")]
    return PeerProcess(script("tests/attacker.py"), args, tmp_path / run_id / "attacker.log")


def wait_all(peers: list[PeerProcess], timeout: float) -> None:
    try:
        for peer in peers:
            assert peer.wait(timeout) == 0, peer.output()[-3000:]
    finally:
        for peer in peers:
            peer.stop()


def weights(output_dir):
    return load_model(latest_checkpoint(output_dir)).state_dict()


def test_a_misbehaving_peer_cannot_poison_the_run(tmp_path):
    first, initial_peers = first_peer(tmp_path / "first_peer", "robust")
    started: list[PeerProcess] = []
    try:
        # 1. clean: two honest trainers make every global step, end with one model, and learn. 2. at the same time,
        # the control: without the defence (hivemind's plain mean, other identities, no end: stopped once poisoned),
        # an attacker's NaN gradients reach the honest trainers' parameters, which then roll back
        clean = [honest(tmp_path, f"h{i}", "clean", initial_peers) for i in range(2)]
        plain = ["--aggregation", "plain", "--max_steps", "1000"]
        control = [honest(tmp_path, f"c{i}", "control", initial_peers, *plain) for i in range(2)]
        control.append(attacker(tmp_path, "control", initial_peers, "nan", "--max_steps", "1000"))
        started += [*clean, *control]
        try:
            # honest trainers never send non-finite gradients (they drop such a pass): only the attacker's, averaged
            # into their rounds, can poison them
            wait_for(
                lambda: any("parameters became non-finite" in peer.output() for peer in control[:2]),
                300,
                "the control's honest trainers to be poisoned",
            )
            # the attacker was in their swarm: they count it among its peers
            wait_for(lambda: any("3 peer(s)" in peer.output() for peer in control[:2]), 120, "the attacker counted")
        finally:
            for peer in control:
                peer.kill()  # the control has shown what it must: no need to wait for a clean exit
        wait_all(clean, 300)
        outputs = [peer.output() for peer in clean]
        assert any("final parameters averaged by 2 peers" in out for out in outputs), outputs[0][-3000:]
        clean_logs = [train_log(tmp_path / "clean" / f"h{i}") for i in range(2)]
        assert all(max(r.peers for r in log) == 2 for log in clean_logs)
        assert latest_checkpoint(tmp_path / "clean" / "h0").name == f"checkpoint-{STEPS}"
        a, b = weights(tmp_path / "clean" / "h0"), weights(tmp_path / "clean" / "h1")
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=2e-3, rtol=1e-2, msg=f"{name} differs between peers")
        assert swarm_loss(clean_logs, [STEPS]) < swarm_loss(clean_logs, [1])
        clean_loss = swarm_loss(clean_logs, [STEPS - 1, STEPS])

        # 3. with the defence (the default): every attack reaches the honest trainers, and they train on
        # the attacker starts first and trains once it sees both honest trainers: all three train from step 0
        bad = attacker(tmp_path, "attacked", initial_peers, PLAN)
        started.append(bad)
        run = []
        try:
            wait_for(lambda: "attacker peer id" in bad.output(), 240, "the attacker to join")
            run = [honest(tmp_path, f"h{i}", "attacked", initial_peers) for i in range(2)]
            started += run
        finally:
            wait_all([*run, bad], 400)
    finally:
        for peer in started:  # whatever an assertion left running
            peer.stop()
        first.stop()
    attacker_id = re.search(r"attacker peer id (\S+)", bad.output()).group(1)
    outputs = "\n".join(peer.output() for peer in run)
    # the attacker took part: an honest reducer dropped its NaN gradients or bounded its x1e4 ones (which of its
    # three gradient-attack steps lands in an honest reducer's part depends on how matchmaking groups the peers; the
    # sign flip is asserted through its effect only), its progress claims were ignored, and its x1e4 averages
    # caught (it is then left out of the honest peers' groups)
    caught = [f"{what} contribution of {attacker_id}" for what in ("dropped the non-finite", "bounded the outlying")]
    assert any(line in outputs for line in caught), outputs[-4000:]
    assert re.search(rf"swarm progress: ignored a claim of step 3\d .*, from peer {attacker_id}", outputs), outputs[
        -4000:
    ]
    assert f"peer {attacker_id} is left out of this peer's averaging" in outputs, outputs[-4000:]
    # and its samples no longer count toward their global steps
    assert f"the progress of peer {attacker_id}, left out, is not counted" in outputs, outputs[-4000:]
    for phase in ("nan+progress", "scaled", "sign_flipped", "bad_reducer"):
        assert f"attack {phase} at step" in bad.output(), bad.output()[-3000:]
    # the honest trainers stayed finite without a rollback and made every global step
    assert "parameters became non-finite" not in outputs and "this batch is dropped" not in outputs
    logs = [train_log(tmp_path / "attacked" / f"h{i}") for i in range(2)]
    for i in range(2):
        assert latest_checkpoint(tmp_path / "attacked" / f"h{i}").name == f"checkpoint-{STEPS}"
    # the attacker was counted in their swarm (a tracker's count lapses now and then: by one of them at least), and
    # their parameters are finite. (Not asserted equal: once the
    # attacker is left out, rounds that waited for its parts can spread the honest trainers' last steps further
    # apart than the final round's window, and each then keeps its own parameters.)
    assert any(max(r.peers for r in log) == 3 for log in logs), [[r.peers for r in log] for log in logs]
    for i in range(2):
        parameters = weights(tmp_path / "attacked" / f"h{i}")
        assert all(torch.isfinite(tensor).all() for tensor in parameters.values())
    attacked_loss = swarm_loss(logs, [STEPS - 1, STEPS])
    assert abs(attacked_loss - clean_loss) / clean_loss < 0.05, (attacked_loss, clean_loss)
