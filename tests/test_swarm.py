"""Collaborative training with real hivemind peers, each in its own process, on 127.0.0.1: the README's `make demo`
(data parallelism with delayed updates, the tiny ALBERT) and the other mode on the other model; a trainer stopped
and resumed. Bad input to the scripts is tests/test_user_edges.py's, in-process."""

import re
import signal
import subprocess

import psutil
import pytest
import torch
from transformers import AutoTokenizer

from sahajbert.checkpoints import latest_checkpoint, list_checkpoints
from sahajbert.cli import parse_args
from sahajbert.flags import PeerArguments
from sahajbert.localswarm import PeerProcess, tiny_trainer_flags, wait_for
from sahajbert.model import load_model
from sahajbert.rollback import GOOD_STATE_FILE
from sahajbert.signals import StopRequest
from sahajbert.train_log import read_train_log as train_log
from sahajbert.trainer import TrainerPeer

from .swarm_helpers import ROOT, final_step, first_peer, fixed_batch_loss, last_step, quiet, start_peer, swarm_loss

pytestmark = pytest.mark.slow

DEMO_STEPS = 10  # run_local_swarm.py's default --max_steps: `make demo` runs as a user runs it
DEMO_WAIT = 700.0  # seconds: the demo gives up after its own --timeout of 600


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`make demo` (a first peer and two trainers) into a folder of this test's, and meanwhile, in this process, one
    trainer alone with twice the batch per pass: the same global steps of the same target batch. Yields the demo's
    output folder, its printed output, and the lone trainer's folder."""
    workdir = tmp_path_factory.mktemp("demo")
    output = workdir / "demo"
    with open(workdir / "make_demo.log", "w") as log:
        make = subprocess.Popen(
            ["make", "-C", str(ROOT), "demo", f"DEMO_FLAGS=--output_dir {output}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            flags = tiny_trainer_flags(
                max_steps=DEMO_STEPS, per_device_train_batch_size=16, output_dir=workdir / "solo"
            )
            (peer_args,) = parse_args((PeerArguments,), ["--run_id", "solo", *flags])
            with TrainerPeer(peer_args) as peer:
                peer.run(StopRequest())
            code = make.wait(DEMO_WAIT)
        finally:
            if make.poll() is None:
                make.kill()
    printed = (workdir / "make_demo.log").read_text()
    assert code == 0, printed[-3000:]
    return output, printed, workdir / "solo"


@pytest.mark.timeout(int(DEMO_WAIT) + 300)
def test_make_demo_trains_two_peers_together_and_prints_its_summary(demo):
    output, printed, _ = demo
    summary = printed.split("=== local swarm summary ===", 1)[-1]
    assert f"global steps:     {DEMO_STEPS}" in summary, printed[-3000:]
    assert "peers seen:       2 trainers in one global step" in summary, summary
    assert "every process stopped" in summary, summary
    first, last = map(float, re.search(r"loss \(.*\): ([\d.]+) at step \d+ -> ([\d.]+) at the end", summary).groups())
    assert last < first, summary
    # the two trainers counted each other in the same global steps, from one initial model (one seed: nothing to
    # download), and averaged their parameters once more at the end
    logs = [train_log(output / f"trainer{i}") for i in range(2)]
    assert all(max(r.peers for r in log) == 2 for log in logs), [[r.peers for r in log] for log in logs]
    outputs = [(output / f"trainer{i}.log").read_text() for i in range(2)]
    for out in [printed, *outputs]:
        quiet(out, healthy=True)
    assert not any("starting from its parameters" in out for out in outputs), outputs[1][-3000:]
    assert any("final parameters averaged by 2 peers" in out for out in outputs), outputs[0][-3000:]


def test_the_demos_trainers_end_with_one_model_that_learned(demo):
    output, _, _ = demo
    checkpoints = [latest_checkpoint(output / f"trainer{i}") for i in range(2)]
    assert [c.name for c in checkpoints] == [f"checkpoint-{DEMO_STEPS}"] * 2
    a, b = (load_model(c).state_dict() for c in checkpoints)
    for name in a:  # within fp16 compression's tolerance
        torch.testing.assert_close(a[name], b[name], atol=2e-3, rtol=1e-2, msg=f"{name} differs between peers")
    # the swarm learned: the final model's loss on fixed examples is below the initial model's
    assert fixed_batch_loss(checkpoints[0]) < fixed_batch_loss(None)
    # the checkpoint is a transformers model with its tokenizer beside it
    assert AutoTokenizer.from_pretrained(checkpoints[0]).mask_token_id == 4


def test_collaboration_does_not_change_what_is_learned(demo):
    """2 peers with batch b (the demo) vs 1 peer with batch 2b, same target batch and global steps: similar loss."""
    output, _, solo = demo
    assert final_step(solo) == final_step(output / "trainer0") == DEMO_STEPS
    pair_loss = swarm_loss([train_log(output / "trainer0"), train_log(output / "trainer1")], [9, 10])
    solo_loss = swarm_loss([train_log(solo)], [9, 10])
    assert abs(pair_loss - solo_loss) / solo_loss < 0.05, (pair_loss, solo_loss)


def trainer(tmp_path, name, run_id, initial_peers, *extra) -> PeerProcess:
    return start_peer("run_trainer.py", tmp_path, name, run_id, initial_peers, *extra)


@pytest.mark.timeout(720)
def test_two_lockstep_trainers_of_lean_albert_with_adaptive_compression_make_global_steps_and_agree(tmp_path):
    # the other mode with the other model, and the XL recipe's codec, in one run. lockstep: every peer waits for each
    # all-reduce before its next step (no delayed parameter updates); tiny-xl: LeanALBERT, sahajBERT-XL's
    # architecture, at the tiny sizes; adaptive: fp16 for tensors up to 2^16 values, 8-bit above
    organizer, initial_peers = first_peer(tmp_path / "first_peer", "lockstep")
    flags = ["--delay_optimizer_step", "false", "--delay_grad_averaging", "false", "--model", "tiny-xl"]
    flags += ["--compression", "adaptive"]
    # a 30 s final window: on a busy 2-core machine one trainer can reach --max_steps more than the tiny preset's 10 s
    # after the other
    flags += ["--final_averaging_window", "30"]
    # two seeds, so two initial models: the trainer that starts second downloads the first one's parameters
    peers = [
        trainer(tmp_path, f"t{i}", "lockstep", initial_peers, "--max_steps", "5", "--seed", str(i + 1), *flags)
        for i in range(2)
    ]
    try:
        for peer in peers:
            assert peer.wait(300) == 0, peer.output()[-3000:]
    finally:
        for peer in [*peers, organizer]:
            peer.stop()
    outputs = [peer.output() for peer in peers]
    assert any("final parameters averaged by 2 peers" in out for out in outputs), outputs[0][-3000:]
    assert sum("downloaded the first trainer's parameters" in out for out in outputs) == 1, outputs[0][-3000:]
    logs = [train_log(tmp_path / f"t{i}") for i in range(2)]
    for log in logs:
        assert max(r.peers for r in log) == 2, "both trainers must be counted in the same global steps"
    a, b = (load_model(latest_checkpoint(tmp_path / f"t{i}")).state_dict() for i in range(2))
    assert latest_checkpoint(tmp_path / "t0").name == latest_checkpoint(tmp_path / "t1").name == "checkpoint-5"
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-3, rtol=1e-2, msg=f"{name} differs between peers")
    assert fixed_batch_loss(latest_checkpoint(tmp_path / "t0")) < fixed_batch_loss(None)


@pytest.mark.timeout(600)
def test_a_trainer_stopped_by_ctrl_c_leaves_no_orphans_and_resumes_from_its_checkpoint(tmp_path):
    """SIGINT, what Ctrl+C sends, once the trainer's averagers run (hivemind's set it to ignored in their owner's
    process as they start; the fence puts the trainer's handler back). SIGTERM: tests/test_user_edges.py."""
    organizer, initial_peers = first_peer(tmp_path / "first_peer", "resume")
    try:
        small = ["--target_batch_size", "64"]  # steps of a few passes: what is under test is the stop and the restart
        peer = trainer(tmp_path, "resume", "resume", initial_peers, "--max_steps", "100", *small)
        try:
            wait_for(lambda: last_step(tmp_path / "resume") >= 1, 240, "a first global step")
            children = peer.descendants()
            assert any("p2pd" in c.name() for c in children), [c.name() for c in children]
            # the state a rollback restores is kept on disk while the trainer runs (--keep_good_state disk)
            assert (tmp_path / "resume" / GOOD_STATE_FILE).is_file()
            peer.process.send_signal(signal.SIGINT)
            assert peer.wait(90) == 0, peer.output()[-3000:]
        finally:
            peer.stop()
        assert "received SIGINT" in peer.output() and "stop requested" in peer.output()
        gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, f"orphaned processes: {[p.name() for p in alive]}"
        assert not (tmp_path / "resume" / GOOD_STATE_FILE).exists(), "the checkpoint resumes it, not the rollback file"
        # the stop saved a checkpoint at the step it reached; a restart in the same folder goes on from there
        stopped_at = list_checkpoints(tmp_path / "resume")[-1][0]
        assert stopped_at == last_step(tmp_path / "resume") >= 1
        resumed = trainer(tmp_path, "resume", "resume", initial_peers, "--max_steps", str(stopped_at + 2), *small)
        try:
            assert resumed.wait(240) == 0, resumed.output()[-3000:]
        finally:
            resumed.stop()
    finally:
        organizer.stop()
    # each run's terminal: one line per event, with the default logging a user gets
    for run in (peer, resumed):
        quiet(run.output(), healthy=True)
    assert f"resuming from {tmp_path / 'resume' / f'checkpoint-{stopped_at}'}" in resumed.output(), resumed.output()
    steps = [r.step for r in train_log(tmp_path / "resume")]
    assert steps == list(range(1, stopped_at + 3)), steps
    assert latest_checkpoint(tmp_path / "resume").name == f"checkpoint-{stopped_at + 2}"
