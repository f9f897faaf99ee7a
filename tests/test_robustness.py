"""A misbehaving peer in the swarm (tests/attacker.py: the trainer's own code, speaking the protocol, with corrupted
gradients, averages and progress claims) beside two honest trainers, each in its own process, on 127.0.0.1.

One test, three runs: a reference run whose only misbehaviour is a lying reducer in the final parameter round (it
also checks what a plain run must give), a control without the defence, and the attacked run. The honest trainers
keep their identities (so their data order) in every run.
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
# the reference run's final round starts as soon as its three peers are in it; the window only bounds how far apart
# they may arrive, and how far apart a machine's load puts them must not decide the test (20 s and then 90 s were too
# short beside a CPU hog: two honest peers averaged alone), so it is most of the time the test waits for the run
REFERENCE_WAIT = 400
REFERENCE_WINDOW = ["--final_averaging_window", str(REFERENCE_WAIT - 100)]
# an attack must show in the honest trainers' logs within this many of the attacker's gradient rounds with both of
# them (on an idle machine each attack shows in its first or second); the seconds only bound a run that stopped
# making rounds, since how long a round takes depends on the machine's load
PHASE_ROUNDS = 8
PHASE_WAIT = 600.0
# The attacked run has no fixed end: it goes on until every attack has reached the honest trainers, and the test
# then stops it with SIGTERM once they have made AFTER_ATTACKS more global steps (and passed the reference run's last
# step, which it is compared at): how many steps the attacks take depends on the machine's load, so a fixed
# --max_steps would race them. ATTACKED_CAP only bounds a run whose test died.
ATTACKED_CAP = 100
AFTER_ATTACKS = 3
# the attacks, in order, each with the line an honest trainer logs when it reaches them (None: no line tells it, so
# one more of the attacker's gradient rounds with both honest trainers shows it reached them). The undetectable one
# comes before those that get an attacker left out; an attacker left out reaches nobody, so a new one (another
# identity, from step 0 of its own) takes the attacks that remain
ATTACKS = [
    (
        "nan+progress",
        ["dropped the non-finite or misshapen contribution of {id}", r"ignored a claim of step .*from peer {id}"],
    ),
    ("sign_flipped", None),
    ("scaled+progress", ["bounded the outlying contribution of {id}|peer {id} is left out of this peer's averaging"]),
    ("bad_reducer", ["peer {id} is left out of this peer's averaging"]),
]
# the limit of the whole test, above its waits: the control (420 s), the reference run (640 s), the attacks (two
# attackers joining, 240 s each, and every phase's PHASE_WAIT), the honest trainers' last steps and their stop
TEST_LIMIT = 420 + 640 + 2 * 240 + len(ATTACKS) * PHASE_WAIT + 300 + 120 + 120


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


def attacker(tmp_path, run_id, initial_peers, plan: str, *extra, name: str = "attacker") -> PeerProcess:
    args = [plan, "--run_id", run_id, "--initial_peers", *initial_peers, *TINY_TRAINING, *COMMON, *extra]
    args += ["--output_dir", str(tmp_path / run_id / name)]
    return PeerProcess(script("tests/attacker.py"), args, tmp_path / run_id / f"{name}.log")


def attacker_id(peer: PeerProcess) -> str:
    wait_for(lambda: "attacker peer id" in peer.output() or not peer.running(), 240, "the attacker to join")
    assert peer.running(), peer.output()[-3000:]
    return re.search(r"attacker peer id (\S+)", peer.output()).group(1)


def wait_all(peers: list[PeerProcess], timeout: float) -> None:
    try:
        for peer in peers:
            assert peer.wait(timeout) == 0, peer.output()[-3000:]
    finally:
        for peer in peers:
            peer.stop()


def ending_lines(output: str) -> str:
    """A peer's lines from the start of its last global step's report on, or of its final round if it made one
    (what a failed check of a run's end needs), at most 60."""
    lines = output.splitlines()
    marks = ("global step ", "averaging parameters with the peers that finish")
    starts = [i for i, line in enumerate(lines) if any(mark in line for mark in marks) and "stopped at" not in line]
    last = max(starts, default=0)
    return "\n".join(lines[last:][-60:])


def weights(output_dir):
    return load_model(latest_checkpoint(output_dir)).state_dict()


def left_out(peer_id: str) -> str:
    return f"peer {peer_id} is left out of this peer's averaging"


def no_average_from(peer_id: str) -> str:
    return f"no average came back from {peer_id}"


class Attacks:
    """Moves an attacker (tests/attacker.py with a phase file) from one attack to the next once the honest trainers'
    logs show that the current one reached them, and starts a new attacker when the current one was left out."""

    def __init__(self, tmp_path: Path, run: list[PeerProcess], start_attacker):
        self.tmp_path, self.run, self.start_attacker = tmp_path, run, start_attacker
        self.attackers: list[tuple[PeerProcess, str, Path]] = []  # (process, peer id, phase file)
        self.reached: list[tuple[str, str]] = []  # (attack, the id of the attacker that made it)

    def seen(self, pattern: str) -> bool:
        return all(re.search(pattern, peer.output()) for peer in self.run)

    def rounds(self) -> int:
        return self.attackers[-1][0].output().count("attacker: gradient round")

    def ended(self) -> bool:
        return not all(peer.running() for peer in [*self.run, self.attackers[-1][0]])

    def tails(self) -> str:
        logs = {f"attacker {i}": bad.output() for i, (bad, _, _) in enumerate(self.attackers)}
        logs.update({f"honest {i}": peer.output() for i, peer in enumerate(self.run)})
        return "".join(f"\n--- {name}:\n" + "\n".join(out.splitlines()[-25:]) for name, out in logs.items())

    def new_attacker(self, bad: PeerProcess, phase_file: Path) -> None:
        self.attackers.append((bad, attacker_id(bad), phase_file))

    def switch_to(self, phase: str) -> None:
        # the attacker reads the file at every pass: written in place, a read could catch it empty
        phase_file = self.attackers[-1][2]
        staged = phase_file.with_name(phase_file.name + ".new")
        staged.write_text(phase)
        os.replace(staged, phase_file)

    def make(self, phase: str, lines: list[str] | None) -> None:
        bad, peer_id, _ = self.attackers[-1]
        if self.seen(left_out(peer_id)):  # it reaches nobody any more: the next attack is a new attacker's
            bad.process.send_signal(signal.SIGTERM)
            self.new_attacker(*self.start_attacker(len(self.attackers)))
            before = self.rounds()
            wait_for(lambda: self.rounds() > before or self.ended(), PHASE_WAIT, "the new attacker's first round")
            bad, peer_id, _ = self.attackers[-1]
        before = self.rounds()
        if lines is None:
            reached = lambda: self.rounds() > before  # noqa: E731
        else:
            reached = lambda: all(self.seen(line.format(id=peer_id)) for line in lines)  # noqa: E731
        self.switch_to(phase)
        try:
            wait_for(
                lambda: reached() or self.ended() or self.rounds() > before + PHASE_ROUNDS,
                PHASE_WAIT,
                f"the {phase} attack to land",
            )
        except TimeoutError as error:
            raise AssertionError(f"{error}: {self.rounds() - before} attacker round(s) since{self.tails()}") from None
        assert bad.running(), f"the attacker exited during the {phase} attack{self.tails()}"
        assert reached(), (
            f"the {phase} attack did not reach the honest trainers in the attacker's {self.rounds() - before} "
            f"gradient round(s) with both since it began, or they ended{self.tails()}"
        )
        self.reached.append((phase, peer_id))


@pytest.mark.timeout(TEST_LIMIT)
def test_a_misbehaving_peer_cannot_poison_the_run(tmp_path):
    first, initial_peers = first_peer(tmp_path / "first_peer", "robust")
    started: list[PeerProcess] = []
    try:
        # 1. the control: without the defence (hivemind's plain mean, other identities, no end: stopped once
        # poisoned), an attacker's NaN gradients reach the honest trainers' parameters, which then roll back. 2. at the
        # same time, the reference: an attacker honest until the final parameter round, whose parts it reduces come
        # back x1e4: each honest trainer refuses those and keeps its own values there, so the two would end apart.
        # They leave the attacker out, settle on one of them (stopping.settle), and the other takes its parameters
        plain = ["--aggregation", "plain", "--max_steps", "1000"]
        control = [honest(tmp_path, f"c{i}", "control", initial_peers, *plain) for i in range(2)]
        control.append(attacker(tmp_path, "control", initial_peers, "3@nan", "--max_steps", "1000"))
        started += control
        # it declares the fastest link, so that hivemind gives it parts to reduce (load balancing by bandwidth can
        # leave a slower peer none of the tiny model's parameters); started first, it trains with both from step 0
        # and it waits for its final round as long as the honest trainers do: with a shorter window it began the round
        # with whichever one had arrived (an honest trainer's last round that found no group made it 30 s late)
        final_liar = attacker(
            tmp_path, "reference", initial_peers, "3@bad_final_reducer", "--bandwidth", "100000", *REFERENCE_WINDOW
        )
        started.append(final_liar)
        liar_id = attacker_id(final_liar)
        reference = [honest(tmp_path, f"h{i}", "reference", initial_peers, *REFERENCE_WINDOW) for i in range(2)]
        started += reference
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
            # state leaves both others out and trains alone, and the other may then count 2 at every step)
            wait_for(
                lambda: "with 3 peers" in control[2].output() or any("3 peer(s)" in p.output() for p in control[:2]),
                120,
                "the attacker in a round with both control trainers, or counted by them",
            )
        finally:
            for peer in control:
                peer.kill()  # the control has shown what it must: no need to wait for a clean exit
        wait_all([*reference, final_liar], REFERENCE_WAIT)
        outputs = [peer.output() for peer in reference]
        ends = "\n\n".join(ending_lines(out) for out in [*outputs, final_liar.output()])
        assert all("final parameters averaged by 3 peers" in out for out in outputs), ends
        assert all(re.search(r"Averaging: received [\d.]+% results", out) for out in outputs), "partial, for both"
        # each honest trainer refused the liar's averages, or none came back to it (the liar, reducing nearly every
        # part, waits for both honest trainers' parts: on a loaded machine one exchange can time out first); either
        # way it kept its own values there
        assert all(left_out(liar_id) in out or no_average_from(liar_id) in out for out in outputs), ends
        took = [out for out in outputs if "this peer took the parameters of peer" in out]
        assert len(took) == 1, [out[-2000:] for out in outputs]
        reference_dirs = [tmp_path / "reference" / f"h{i}" for i in range(2)]
        assert [latest_checkpoint(d).name for d in reference_dirs] == [f"checkpoint-{STEPS}"] * 2
        a, b = (weights(d) for d in reference_dirs)
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=f"{name} differs between peers")
        assert fixed_batch_loss(latest_checkpoint(reference_dirs[0])) < fixed_batch_loss(None)
        reference_loss = swarm_loss([train_log(d) for d in reference_dirs], [STEPS - 1, STEPS])

        # 3. with the defence (the default): every attack reaches the honest trainers, and they train on. The
        # attacker starts first and trains once it sees both honest trainers: all three train from step 0. Every peer
        # declares the same link, so that each reduces a third of a round of three: the bad_reducer attack needs parts
        # to reduce, and the NaN one an honest reducer (hivemind shares the parts out by bandwidth, and the slowest of
        # three measured links can get none)
        capped = ["--max_steps", str(ATTACKED_CAP), "--bandwidth", "1000"]

        def start_attacker(index: int) -> tuple[PeerProcess, Path]:
            phase_file = tmp_path / "attacked" / f"phase{index}"
            bad = attacker(tmp_path, "attacked", initial_peers, f"3@file:{phase_file}", *capped, name=f"a{index}")
            started.append(bad)
            return bad, phase_file

        honest_dirs = [tmp_path / "attacked" / f"h{i}" for i in range(2)]
        run: list[PeerProcess] = []
        attacks = Attacks(tmp_path, run, start_attacker)
        try:
            attacks.new_attacker(*start_attacker(0))
            run += [honest(tmp_path, f"h{i}", "attacked", initial_peers, *capped) for i in range(2)]
            started += run
            for phase, lines in ATTACKS:
                attacks.make(phase, lines)
            # liveness after the attacks: both honest trainers make further global steps
            end_step = max(STEPS, max(last_step(d) for d in honest_dirs) + AFTER_ATTACKS)
            wait_for(
                lambda: all(last_step(d) >= end_step for d in honest_dirs) or not all(p.running() for p in run),
                300,
                f"both honest trainers to reach global step {end_step}",
            )
        finally:
            for peer in [*run, *(bad for bad, _, _ in attacks.attackers)]:
                if peer.running():
                    peer.process.send_signal(signal.SIGTERM)  # a clean stop: each writes its final checkpoint
        wait_all([*run, *(bad for bad, _, _ in attacks.attackers)], 120)
    finally:
        for peer in started:  # whatever an assertion left running
            peer.stop()
        first.stop()
    print("attacks that reached the honest trainers, in order, and by whom:", attacks.reached)
    outputs = "\n".join(peer.output() for peer in run)
    assert [phase for phase, _ in attacks.reached] == [phase for phase, _ in ATTACKS], attacks.reached
    # an attacker left out no longer counts toward their steps: its progress records are not counted
    left_out_ids = [peer_id for _, peer_id, _ in attacks.attackers if left_out(peer_id) in outputs]
    assert left_out_ids, outputs[-4000:]
    for peer_id in left_out_ids:
        line = f"did not count the progress of a peer left out of this peer's averaging, from peer {peer_id}"
        assert line in outputs, outputs[-4000:]
    # the honest trainers stayed finite without a rollback, made global steps until the test stopped them, and each
    # stopped on the request with its final checkpoint
    assert "rolling back to the last good state" not in outputs and "this batch is dropped" not in outputs
    logs = [train_log(directory) for directory in honest_dirs]
    last_steps = [list_checkpoints(directory)[-1][0] for directory in honest_dirs]
    assert min(last_steps) >= end_step, (last_steps, end_step)
    assert outputs.count("(stop requested)") == 2, outputs[-4000:]
    for i in range(2):
        parameters = weights(tmp_path / "attacked" / f"h{i}")
        assert all(torch.isfinite(tensor).all() for tensor in parameters.values())
    attacked_loss = swarm_loss(logs, [STEPS - 1, STEPS])  # at the reference run's last steps: the same samples
    assert abs(attacked_loss - reference_loss) / reference_loss < 0.05, (attacked_loss, reference_loss)
