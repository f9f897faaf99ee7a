"""A misbehaving peer in the swarm (tests/attacker.py: the trainer's own code, speaking the protocol, with corrupted
gradients, averages and progress claims) beside two honest trainers, each in its own process, on 127.0.0.1.

A clean run of the two honest trainers comes first (it also checks what a plain two-trainer run must give); the
honest trainers keep their identities (so their data order) in every run.
"""

import os
import re
import signal
from pathlib import Path

import pytest
import torch

from sahajbert.checkpoints import latest_checkpoint, list_checkpoints
from sahajbert.localswarm import PeerProcess, wait_for
from sahajbert.model import load_model
from sahajbert.train_log import read_train_log as train_log

from .swarm_helpers import TINY_TRAINING, first_peer, fixed_batch_loss, last_step, script, start_peer, swarm_loss

pytestmark = pytest.mark.slow

STEPS = 9
# a small batch, so that a step takes seconds and every peer, the attacker included, takes part in most rounds
COMMON = ["--max_steps", str(STEPS), "--target_batch_size", "96", "--final_averaging_window", "20"]
# an attack must show in the honest trainers' logs within this many of the attacker's gradient rounds with both of
# them (on an idle machine each attack shows in its first or second); the seconds only bound a run that stopped
# making rounds, since how long a round takes depends on the machine's load
PHASE_ROUNDS = 8
PHASE_WAIT = 600.0
# The attacked run has no fixed end: it goes on until every attack has reached the honest trainers, and the test
# then stops it with SIGTERM once they have made AFTER_ATTACKS more global steps (and passed the clean run's last
# step, which it is compared at). How many steps the attacks take depends on the machine's load (on an idle machine
# the four land by step 6; in CI runs the x1e4 one had not landed by step 9, then by step 14), so a fixed
# --max_steps raced them. ATTACKED_CAP only bounds a run whose test died.
ATTACKED_CAP = 100
AFTER_ATTACKS = 3


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


def run_the_attacks(phase_file: Path, bad: PeerProcess, run: list[PeerProcess], attacker_id: str) -> list[str]:
    """Move the attacker from one attack to the next once the honest trainers' logs show that the current one
    reached them: NaN gradients while claiming to be 30 steps ahead with x100 samples (its NaN dropped by an honest
    reducer, its claim ignored), x1e4-scaled gradients with the same claims (bounded by an honest reducer, or its
    averages caught), sign-flipped gradients (for one of its gradient rounds with both honest trainers), then x1e4
    averages for the parts it reduces (caught). An honest trainer that gets x1e4 averages from it leaves it out from
    then on (also in a group of two during the x1e4 phase, where it reduces a part from its own x1e4 gradients and the
    pair rule keeps the honest one near them): no later attack reaches anyone, and the plan ends there. Returns the
    attacks it went through."""
    left_out = f"peer {attacker_id} is left out of this peer's averaging"

    def seen(*lines: str):
        return lambda: all(any(re.search(line, peer.output()) for peer in run) for line in lines)

    def rounds() -> int:
        return bad.output().count("attacker: gradient round")

    def more_rounds_than(before: int):
        return lambda: rounds() > before

    def ended() -> bool:
        return not all(peer.running() for peer in [*run, bad])

    def over(reached, before: int):
        return lambda: reached() or ended() or rounds() > before + PHASE_ROUNDS

    def switch_to(phase: str) -> None:
        # the attacker reads the file at every pass: written in place, a read can catch it empty (an attacker died of
        # that, and the wait for its attack to land timed out)
        staged = phase_file.with_name(phase_file.name + ".new")
        staged.write_text(phase)
        os.replace(staged, phase_file)

    def tails() -> str:
        logs = {"attacker": bad.output(), **{f"honest {i}": peer.output() for i, peer in enumerate(run)}}
        return "".join(f"\n--- {name}:\n" + "\n".join(out.splitlines()[-25:]) for name, out in logs.items())

    plan = [
        (
            "nan+progress",
            seen(
                f"dropped the non-finite or misshapen contribution of {attacker_id}",
                rf"swarm progress: ignored a claim of step 3\d .*, from peer {attacker_id}",
            ),
        ),
        ("scaled+progress", lambda: seen(f"bounded the outlying contribution of {attacker_id}")() or seen(left_out)()),
        ("sign_flipped", None),
        ("bad_reducer", seen(left_out)),
    ]
    done = []
    for phase, reached in plan:
        if seen(left_out)():
            break
        before = rounds()
        if reached is None:  # no log line tells a sign flip: one more of its rounds with both honest trainers
            reached = more_rounds_than(before)
        switch_to(phase)
        done.append(phase)
        try:
            wait_for(over(reached, before), PHASE_WAIT, f"the {phase} attack to land")
        except TimeoutError as error:
            raise AssertionError(f"{error}: {rounds() - before} attacker round(s) since it began{tails()}") from None
        assert bad.running(), f"the attacker exited during the {phase} attack{tails()}"
        assert reached(), (
            f"the {phase} attack did not reach the honest trainers in the attacker's {rounds() - before} gradient "
            f"round(s) with both since it began, or they ended{tails()}"
        )
    return done


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
        control.append(attacker(tmp_path, "control", initial_peers, "3@nan", "--max_steps", "1000"))
        started += [*clean, *control]
        try:
            # honest trainers never send non-finite gradients (they drop such a pass): only the attacker's, averaged
            # into their rounds, can poison them
            wait_for(
                lambda: any("rolling back to the last good state" in peer.output() for peer in control[:2]),
                300,
                "the control's honest trainers to be poisoned",
            )
            # the attacker was in their swarm: it made a gradient round with both (its own count, tests/attacker.py),
            # or they counted it among their peers. (Not the count alone: a control trainer that downloads a poisoned
            # state leaves both others out and trains alone, and the other may then count 2 at every step, as in a
            # CI run)
            wait_for(
                lambda: "with 3 peers" in control[2].output() or any("3 peer(s)" in p.output() for p in control[:2]),
                120,
                "the attacker in a round with both control trainers, or counted by them",
            )
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
        learned = fixed_batch_loss(latest_checkpoint(tmp_path / "clean" / "h0"))
        assert learned < fixed_batch_loss(None), learned
        clean_loss = swarm_loss(clean_logs, [STEPS - 1, STEPS])

        # 3. with the defence (the default): every attack reaches the honest trainers, and they train on. The
        # attacker starts first and trains once it sees both honest trainers: all three train from step 0
        phase_file = tmp_path / "attacked" / "phase"
        # every peer declares the same link, so that each reduces a third of a round of three: the bad_reducer attack
        # needs parts to reduce, and the NaN one an honest reducer. hivemind shares the parts out by bandwidth, and the
        # slowest of three measured ones can get none (in a run beside a busy core the attacker measured 1,107 Mbit/s
        # on loopback against 2,579 and 2,685, reduced nothing, and its bad_reducer attack never landed)
        capped = ["--max_steps", str(ATTACKED_CAP), "--bandwidth", "1000"]
        bad = attacker(tmp_path, "attacked", initial_peers, f"3@file:{phase_file}", *capped)
        started.append(bad)
        run = []
        honest_dirs = [tmp_path / "attacked" / f"h{i}" for i in range(2)]
        try:
            wait_for(lambda: "attacker peer id" in bad.output(), 240, "the attacker to join")
            attacker_id = re.search(r"attacker peer id (\S+)", bad.output()).group(1)
            run = [honest(tmp_path, f"h{i}", "attacked", initial_peers, *capped) for i in range(2)]
            started += run
            attacks = run_the_attacks(phase_file, bad, run, attacker_id)
            # liveness after the attacks: both honest trainers make further global steps
            end_step = max(STEPS, max(last_step(d) for d in honest_dirs) + AFTER_ATTACKS)
            wait_for(
                lambda: all(last_step(d) >= end_step for d in honest_dirs) or not all(p.running() for p in run),
                300,
                f"both honest trainers to reach global step {end_step}",
            )
        finally:
            for peer in [*run, bad]:
                if peer.running():
                    peer.process.send_signal(signal.SIGTERM)  # a clean stop: each writes its final checkpoint
        wait_all([*run, bad], 120)
    finally:
        for peer in started:  # whatever an assertion left running
            peer.stop()
        first.stop()
    print("attacks that reached the honest trainers, in order:", attacks)
    outputs = "\n".join(peer.output() for peer in run)
    # each attack reached them (run_the_attacks waited for each one's evidence), and the attacker was left out of
    # their groups in the end: its samples no longer count toward their steps
    assert attacks[:2] == ["nan+progress", "scaled+progress"], (attacks, re.findall(r".*from now on: .*", outputs))
    assert f"peer {attacker_id} is left out of this peer's averaging" in outputs, outputs[-4000:]
    assert (
        f"swarm progress: did not count the progress of a peer left out of this peer's averaging, from peer "
        f"{attacker_id}" in outputs
    ), outputs[-4000:]
    # the honest trainers stayed finite without a rollback, made global steps until the test stopped them, and each
    # stopped on the request with its final checkpoint
    assert "rolling back to the last good state" not in outputs and "this batch is dropped" not in outputs
    logs = [train_log(directory) for directory in honest_dirs]
    last_steps = [list_checkpoints(directory)[-1][0] for directory in honest_dirs]
    assert min(last_steps) >= end_step, (last_steps, end_step)
    assert outputs.count("(stop requested)") == 2, outputs[-4000:]
    # the attacker was in their groups: an honest reducer received its parts (a step record's peer count is no
    # proof either way: the tracker ignores the attacker's inflated claims, so it may never count it), and their
    # parameters are finite. (Not asserted equal: once the attacker is left out, rounds that waited for its parts
    # can spread the honest trainers' last steps further apart than the final round's window, and each then keeps
    # its own parameters.)
    assert f"dropped the non-finite or misshapen contribution of {attacker_id}" in outputs, outputs[-4000:]
    for i in range(2):
        parameters = weights(tmp_path / "attacked" / f"h{i}")
        assert all(torch.isfinite(tensor).all() for tensor in parameters.values())
    attacked_loss = swarm_loss(logs, [STEPS - 1, STEPS])  # at the clean run's last steps: the same samples
    assert abs(attacked_loss - clean_loss) / clean_loss < 0.05, (attacked_loss, clean_loss)


def test_a_final_round_that_a_bad_reducer_left_partial_still_ends_in_one_model(tmp_path):
    # the attacker is honest until the final parameter round, where the parts it reduces come back x1e4: each honest
    # trainer refuses those and keeps its own values there, so the two would end apart. They leave the attacker out,
    # settle on one of them (stopping.settle), and the other takes its parameters. The round starts as soon as all
    # three are in it; its window only bounds how far apart they may arrive (20 s was too short in a CI run beside
    # the other tests: two honest peers averaged alone)
    window = ("--final_averaging_window", "90")
    first, initial_peers = first_peer(tmp_path / "first_peer", "final")
    started: list[PeerProcess] = []
    try:
        # it declares the fastest link, so that hivemind gives it parts to reduce (load balancing by bandwidth can
        # leave a slower peer none of the tiny model's parameters)
        bad = attacker(tmp_path, "final", initial_peers, "3@bad_final_reducer", "--bandwidth", "100000", *window)
        started.append(bad)
        wait_for(lambda: "attacker peer id" in bad.output(), 240, "the attacker to join")
        attacker_id = re.search(r"attacker peer id (\S+)", bad.output()).group(1)
        run = [honest(tmp_path, f"h{i}", "final", initial_peers, *window) for i in range(2)]
        started += run
        wait_all([*run, bad], 400)
    finally:
        for peer in started:
            peer.stop()
        first.stop()
    outputs = [peer.output() for peer in run]
    ends = [out[-1500:] for out in [*outputs, bad.output()]]
    assert all("final parameters averaged by 3 peers" in out for out in outputs), ends
    assert all(re.search(r"Averaging: received [\d.]+% results", out) for out in outputs), "partial, for both"
    assert all(f"peer {attacker_id} is left out of this peer's averaging" in out for out in outputs)
    took = [out for out in outputs if "this peer took the parameters of peer" in out]
    assert len(took) == 1, [out[-2000:] for out in outputs]
    a, b = weights(tmp_path / "final" / "h0"), weights(tmp_path / "final" / "h1")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=f"{name} differs between peers")
