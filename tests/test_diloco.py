"""DiLoCo (--diloco_inner_steps): real trainers and an aux peer, each in its own process, on 127.0.0.1, in an
invite-only run (the organizer's allowlist, written by run_first_peer.py --add_invite)."""

import re
import subprocess
import sys

import pytest
import torch

from sahajbert.access import add_invite
from sahajbert.checkpoints import latest_checkpoint, list_checkpoints, load_optimizer_state
from sahajbert.localswarm import checkpoints_agree, peer_env, wait_for
from sahajbert.model import load_model
from sahajbert.train_log import read_train_log as train_log

from .swarm_helpers import first_peer, no_alarms, script, start_peer, swarm_loss

pytestmark = pytest.mark.slow

# outer steps: the newcomer, started after the first, takes a few of them to start (both are CPU-bound on one machine,
# so a busy machine slows them alike)
STEPS = 30
INNER = 20  # inner steps per outer step, of 8 samples each
# the inner LAMB steps every 8 samples, not every 384 as the tiny preset's 0.1 is for, and its schedule counts inner
# steps (the preset's 200 would end it at outer step 10); 30 s: every trainer's wait for the others after its inner
# steps (their pace differs on a busy machine). The final round's window is the automatic one, which covers an outer
# round that a lagging trainer waits out before it gets there (a fixed 30 s left the newcomer out in a CI run: it
# came 49 s after the pair)
DILOCO = ["--diloco_inner_steps", str(INNER), "--learning_rate", "0.01", "--total_steps", "100000"]
DILOCO += ["--diloco_wait", "30"]
COMMON = [*DILOCO, "--max_steps", str(STEPS), "--verbose"]
# the second of the pair and the newcomer average in the background, behind their next inner steps; the first waits
# for each round (the two kinds of trainer make the same rounds)
OVERLAP = {0: [], 1: ["--diloco_overlap"], 2: ["--diloco_overlap"]}


def invites(allowlist) -> dict[str, list[str]]:
    """Each peer's --invite flag: the organizer's command line adds the first, the library the others."""
    added = subprocess.run(
        [sys.executable, str(script("run_first_peer.py")), "--allowlist", str(allowlist), "--add_invite", "t0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=peer_env(),
    )
    assert added.returncode == 0, added.stderr[-3000:]
    flags = {"t0": added.stdout.strip().splitlines()[-1].split()}
    assert flags["t0"][0] == "--invite" and flags["t0"][1].startswith("t0:"), added.stdout
    for name in ("t1", "t2", "aux"):
        invite = add_invite(allowlist, name)
        flags[name] = ["--invite", f"{invite.name}:{invite.secret}"]
    return flags


def run_with_a_newcomer(tmp_path, started: list, pair: list, newcomer: list) -> list:
    """Once the first of `pair` has made an outer step, start a newcomer (run_trainer.py: its name, run id, initial
    peers, flags); wait for all three trainers to end and for the aux peer's checkpoint. The three trainers; each
    process started is added to `started`, which the caller stops."""
    wait_for(lambda: len(train_log(tmp_path / "t0")) >= 1, 300, "an outer step of the first pair")
    name, run_id, initial_peers, *flags = newcomer
    started.append(start_peer("run_trainer.py", tmp_path, name, run_id, initial_peers, *flags))
    trainers = [*pair, started[-1]]
    for trainer in trainers:
        assert trainer.wait(400) == 0, trainer.output()[-3000:]
    wait_for(lambda: list_checkpoints(tmp_path / "aux"), 60, "the aux peer's checkpoint")
    return trainers


@pytest.mark.timeout(1500)
def test_two_diloco_trainers_learn_agree_and_take_in_a_newcomer_in_an_invite_only_run(tmp_path):
    allowlist = tmp_path / "invites.txt"
    invite = invites(allowlist)
    only_invited = ["--allowlist", str(allowlist), "--identity_path", str(tmp_path / "organizer.id")]
    peer, initial_peers = first_peer(tmp_path / "first_peer", "diloco", only_invited)
    assert "is invite-only (4 volunteers" in peer.output(), peer.output()[-3000:]
    started = [peer]
    try:
        pair = [
            start_peer(
                "run_trainer.py", tmp_path, f"t{i}", "diloco", initial_peers, *COMMON, *OVERLAP[i], *invite[f"t{i}"]
            )
            for i in range(2)
        ]
        started += pair
        # the aux peer monitors the run and checkpoints the swarm's state every 5 outer steps
        aux_flags = ["--refresh_period", "1", "--checkpoint_every", "5", *DILOCO, *invite["aux"]]
        aux = start_peer("run_aux_peer.py", tmp_path, "aux", "diloco", initial_peers, *aux_flags)
        started.append(aux)
        # a newcomer joins once the pair has made an outer step: it downloads the outer and the inner state
        newcomer = ["t2", "diloco", initial_peers, *COMMON, *OVERLAP[2], *invite["t2"]]
        trainers = run_with_a_newcomer(tmp_path, started, pair, newcomer)
    finally:
        for process in started:
            process.stop()
    outputs = [trainer.output() for trainer in trainers]
    for out in outputs:  # DiLoCo, invite-only, a newcomer (at --verbose): no error line, no library's warning
        no_alarms(out)
    # the aux peer's monitor followed the outer steps, and its checkpoint is the swarm's model at one of them
    assert re.search(r"global step (1[0-9]|2[0-9]|30) \| loss", aux.output()), aux.output()[-3000:]
    aux_step, aux_checkpoint = list_checkpoints(tmp_path / "aux")[-1]
    assert aux_step >= 5, aux_step
    assert all(torch.isfinite(t).all() for t in load_model(aux_checkpoint).state_dict().values())
    # the newcomer started from the swarm's state, not from step 0, with steps left to average with the pair (more
    # steps would grow the weights past the final round's fp16 agreement at this constant learning rate)
    assert re.search(r"joined at global step ([1-9]|1[0-9]|2[0-7])\b", outputs[2]), outputs[2][-3000:]
    # outer rounds averaged the pseudo-gradients of several trainers
    assert all("Averaged gradients with 2 peers" in out or "Averaged gradients with 3 peers" in out for out in outputs)
    assert "Averaged gradients with 3 peers" in "".join(outputs), "the newcomer never joined an outer round"
    # a global step is an outer step: every trainer ends at --max_steps, each of its steps made of INNER inner steps
    logs = [train_log(tmp_path / f"t{i}") for i in range(3)]
    for i in range(3):
        assert list_checkpoints(tmp_path / f"t{i}")[-1][0] == STEPS
    # (with overlap a step ends when its round does, some inner steps into the next, and a trainer whose round is
    # still in flight at its H-th inner step goes on with inner steps until it ends, up to H + H/10)
    steps_made = [[r.mini_steps for r in log] for log in logs]
    assert sum(passes == INNER for passes in steps_made[0]) >= 0.8 * len(steps_made[0]), steps_made
    assert 0.8 * STEPS * INNER <= sum(steps_made[1]) <= (STEPS + 1) * (INNER + INNER // 10), steps_made
    # the records keep the time the inner optimizer steps took (netswarm's training utilization)
    assert all(sum(r.optimizer_seconds for r in log) > 0 for log in logs), logs
    # the overlapping trainers ran inner steps while their rounds averaged (the newcomer, in the rounds it joined: at
    # what step it joins depends on how fast the pair goes meanwhile)
    for out, least in zip(outputs[1:], (5, 1)):
        behind = [int(n) for n in re.findall(r"Outer round awaited after (\d+) inner step", out)]
        assert len(behind) >= least and sum(n >= 1 for n in behind) >= 0.8 * len(behind), behind
    # the loss falls (the first outer step's inner steps against the last's)
    assert swarm_loss(logs, [STEPS]) < 0.95 * swarm_loss(logs, [1]), [[round(r.loss, 3) for r in log] for log in logs]
    # and the final round leaves one model (8-bit pseudo-gradients, then an fp16 parameter average)
    final = [load_model(latest_checkpoint(tmp_path / f"t{i}")).state_dict() for i in range(3)]
    for name in final[0]:
        for other in final[1:]:
            torch.testing.assert_close(final[0][name], other[name], atol=2e-3, rtol=1e-2, msg=name)


# SparseLoCo's rounds every 50 inner steps (~1.5 s on a busy machine): a newcomer started after the first round takes
# a dozen of them to start
SPARSE_STEPS = 20
SPARSE = ["--diloco_inner_steps", "50", "--learning_rate", "0.01", "--total_steps", "100000"]
SPARSE += ["--diloco_wait", "30", "--pseudo_gradient_compression", "sparse"]


@pytest.mark.timeout(900)
def test_sparse_diloco_trainers_learn_agree_take_in_a_newcomer_and_keep_their_error_feedback(tmp_path):
    # SparseLoCo's rounds between a serving trainer, a client-mode one that overlaps its rounds, and a newcomer; the
    # aux peer checkpoints the swarm's state
    peer, initial_peers = first_peer(tmp_path / "first_peer", "sparse")
    started = [peer]
    common = [*SPARSE, "--max_steps", str(SPARSE_STEPS), "--verbose"]
    own = {"t0": [], "t1": ["--client_mode", "--diloco_overlap"], "t2": []}
    try:
        pair = [
            start_peer("run_trainer.py", tmp_path, name, "sparse", initial_peers, *common, *own[name])
            for name in ("t0", "t1")
        ]
        started += pair
        aux_flags = ["--refresh_period", "1", "--checkpoint_every", "3", *SPARSE]
        aux = start_peer("run_aux_peer.py", tmp_path, "aux", "sparse", initial_peers, *aux_flags)
        started.append(aux)
        trainers = run_with_a_newcomer(tmp_path, started, pair, ["t2", "sparse", initial_peers, *common, *own["t2"]])
    finally:
        for process in started:
            process.stop()
    outputs = [trainer.output() for trainer in trainers]
    for out in outputs:  # no reducer dropped or bounded an honest sparse contribution, no error line
        no_alarms(out)
    assert re.search(r"joined at global step ([1-9]|1[0-7])\b", outputs[2]), outputs[2][-3000:]
    assert "Averaged gradients with 3 peers" in "".join(outputs), "the newcomer never joined an outer round"
    finals = [list_checkpoints(tmp_path / name)[-1] for name in own]
    assert [step for step, _ in finals] == [SPARSE_STEPS] * 3
    agree, difference = checkpoints_agree([checkpoint for _, checkpoint in finals])
    assert agree, difference
    # each trainer's checkpoint of the step before the last keeps its own error-feedback buffer (what it had not
    # sent: a value for every parameter) and the outer parameters, which its model is not
    model = load_model(finals[0][1])
    before_last = [dict(list_checkpoints(tmp_path / name))[SPARSE_STEPS - 1] for name in own]
    states = [load_optimizer_state(checkpoint)["diloco"] for checkpoint in before_last]
    for state in states:
        buffers = state["error_feedback"]["buffers"]
        # (in the optimizer's order: the parameter groups with and without weight decay)
        assert sorted(b.shape for b in buffers) == sorted(p.shape for p in model.parameters())
        assert all(torch.isfinite(b).all() for b in buffers) and any(b.abs().sum() > 0 for b in buffers)
        assert len(state["outer_parameters"]) == len(buffers)
    assert not torch.equal(states[0]["error_feedback"]["buffers"][0], states[1]["error_feedback"]["buffers"][0])
    # the final parameter round averaged the models, each with its rest: none is kept after it
    for _, checkpoint in finals:
        assert not any(b.any() for b in load_optimizer_state(checkpoint)["diloco"]["error_feedback"]["buffers"])
    aux_step, aux_checkpoint = list_checkpoints(tmp_path / "aux")[-1]
    assert aux_step >= 3 and all(torch.isfinite(t).all() for t in load_model(aux_checkpoint).state_dict().values())
    logs = [train_log(tmp_path / name) for name in own]
    losses = [[round(r.loss, 3) for r in log] for log in logs]
    assert swarm_loss(logs, [SPARSE_STEPS]) < 0.97 * swarm_loss(logs, [1]), losses
