"""Collaborative training with real hivemind peers, each in its own process, on 127.0.0.1."""

import signal
import subprocess
import sys

import psutil
import pytest
import torch
from transformers import AutoTokenizer

from sahajbert.checkpoints import latest_checkpoint
from sahajbert.localswarm import PeerProcess, peer_env, wait_for
from sahajbert.model import load_model
from sahajbert.train_log import read_train_log as train_log

from .swarm_helpers import (
    LOCAL,
    final_step,
    first_peer,
    fixed_batch_loss,
    last_step,
    script,
    start_peer,
    swarm_loss,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def swarm(tmp_path, request):
    run_id = request.node.name.replace("[", "_").replace("]", "")[:40]
    peer, initial_peers = first_peer(tmp_path / "first_peer", run_id)
    yield run_id, initial_peers
    peer.stop()


def trainer(tmp_path, name, run_id, initial_peers, *extra) -> PeerProcess:
    return start_peer("run_trainer.py", tmp_path, name, run_id, initial_peers, *extra)


def weights(checkpoint) -> dict[str, torch.Tensor]:
    return load_model(checkpoint).state_dict()


# the default mode and model (dpu, tiny) are what the other swarm tests run (learning: the collaboration test; a
# clean pair: tests/test_robustness.py; agreement at the end: tests/test_netswarm.py); here the other mode with the
# other model, in one run
def test_two_trainers_make_global_steps_and_agree(tmp_path, swarm):
    run_id, initial_peers = swarm
    # lockstep: every peer waits for each all-reduce before its next step (no delayed parameter updates);
    # tiny-xl: LeanALBERT, sahajBERT-XL's architecture, at the tiny sizes
    flags = ["--delay_optimizer_step", "false", "--delay_grad_averaging", "false", "--model", "tiny-xl"]
    # a 30 s final window: on a busy 2-core machine one trainer can reach --max_steps more
    # than the tiny preset's 10 s after the other (a fresh-clone CI run: its final round found nobody)
    flags += ["--final_averaging_window", "30"]
    # two seeds, so two initial models: the trainer that starts second downloads the first one's parameters
    peers = [
        trainer(tmp_path, f"t{i}", run_id, initial_peers, "--max_steps", "5", "--seed", str(i + 1), *flags)
        for i in range(2)
    ]
    try:
        for peer in peers:
            assert peer.wait(300) == 0, peer.output()[-3000:]
    finally:
        for peer in peers:
            peer.stop()
    # the trainers that stop together average their parameters once more
    outputs = [peer.output() for peer in peers]
    assert any("final parameters averaged by 2 peers" in out for out in outputs), outputs[0][-3000:]
    assert sum("downloaded the first trainer's parameters" in out for out in outputs) == 1, outputs[0][-3000:]
    logs = [train_log(tmp_path / f"t{i}") for i in range(2)]
    for log in logs:
        assert max(r.peers for r in log) == 2, "both trainers must be counted in the same global steps"
    # parameters end identical within fp16 compression tolerance
    a, b = (weights(latest_checkpoint(tmp_path / f"t{i}")) for i in range(2))
    assert latest_checkpoint(tmp_path / "t0").name == latest_checkpoint(tmp_path / "t1").name == "checkpoint-5"
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-3, rtol=1e-2, msg=f"{name} differs between peers")
    checkpoint = latest_checkpoint(tmp_path / "t0")
    # the swarm learned: the final model's loss on fixed examples is below the initial model's
    learned = fixed_batch_loss(checkpoint)
    assert learned < fixed_batch_loss(None), [[round(r.loss, 3) for r in log] for log in logs]
    # the checkpoint is a transformers model with its tokenizer beside it
    assert AutoTokenizer.from_pretrained(checkpoint).mask_token_id == 4


def test_collaboration_does_not_change_what_is_learned(tmp_path, swarm):
    """2 peers with batch b vs 1 peer with batch 2b, same target batch and global steps: similar loss."""
    run_id, initial_peers = swarm
    common = ["--max_steps", "8", "--per_device_train_batch_size", "8", "--target_batch_size", "384"]
    pair = [trainer(tmp_path, f"pair{i}", run_id, initial_peers, *common) for i in range(2)]
    try:
        for peer in pair:
            assert peer.wait(400) == 0, peer.output()[-3000:]
    finally:
        for peer in pair:
            peer.stop()
    # one seed, one initial model: the trainer that starts second has nothing to download
    assert not any("starting from its parameters" in peer.output() for peer in pair), pair[1].output()[-3000:]
    solo = trainer(tmp_path, "solo", run_id + "_solo", initial_peers, *common, "--per_device_train_batch_size", "16")
    try:
        assert solo.wait(400) == 0, solo.output()[-3000:]
    finally:
        solo.stop()

    pair_loss = swarm_loss([train_log(tmp_path / "pair0"), train_log(tmp_path / "pair1")], [7, 8])
    solo_loss = swarm_loss([train_log(tmp_path / "solo")], [7, 8])
    assert final_step(tmp_path / "solo") == final_step(tmp_path / "pair0") == 8
    assert abs(pair_loss - solo_loss) / solo_loss < 0.05, (pair_loss, solo_loss)


def test_trainer_resumes_from_its_checkpoint(tmp_path, swarm):
    run_id, initial_peers = swarm
    first = trainer(tmp_path, "resume", run_id, initial_peers, "--max_steps", "2")
    assert first.wait(240) == 0, first.output()[-3000:]
    first.stop()
    second = trainer(tmp_path, "resume", run_id, initial_peers, "--max_steps", "4")
    assert second.wait(240) == 0, second.output()[-3000:]
    second.stop()
    steps = [r.step for r in train_log(tmp_path / "resume")]
    assert steps == [1, 2, 3, 4], steps
    assert "resuming from" in second.output()
    assert latest_checkpoint(tmp_path / "resume").name == "checkpoint-4"


def test_sigterm_stops_cleanly_without_orphans(tmp_path, swarm):
    run_id, initial_peers = swarm
    peer = trainer(tmp_path, "term", run_id, initial_peers)
    try:
        wait_for(lambda: last_step(tmp_path / "term") >= 1, 240, "a first global step")
        children = [c for c in peer.descendants()]
        assert any("p2pd" in c.name() for c in children), [c.name() for c in children]
        peer.process.send_signal(signal.SIGTERM)
        assert peer.wait(90) == 0, peer.output()[-3000:]
    finally:
        peer.stop()
    assert "stop requested" in peer.output()
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"orphaned processes: {[p.name() for p in alive]}"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--initial_peers", "1.2.3.4:1337"], "must be a libp2p multiaddr"),
        (
            [
                "--initial_peers",
                "/ip4/127.0.0.1/tcp/9/p2p/QmXa1yGyEqqZrNqBGNd3YjUVWyKwYQ8Uw3tWNBhJuLbX9f",
                "--join_timeout",
                "10",
            ],
            "none of the initial peers answered",
        ),
        (["--tokenizer_path", "/nonexistent/tokenizer"], "tokenizer"),
        (["--model", "albert-huge"], "unknown model 'albert-huge'"),
        (["--per_device_train_batch_size", "0"], "per_device_train_batch_size must be at least 1"),
        (["--device", "tpu"], "pip install -r requirements-tpu.txt"),
        (["--device", "cpu", "--precision", "fp16"], "needs a CUDA GPU"),
        (["--final_averaging_window", "-5"], "--final_averaging_window must be >= 0 seconds"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, args, message):
    sample_tokenizer = ["--tokenizer_path", "sample"]
    result = subprocess.run(
        # the bundled tokenizer: the default is the Hub's, which this offline machine cannot reach
        [
            sys.executable,
            str(script("run_trainer.py")),
            "--output_dir",
            str(tmp_path / "o"),
            *LOCAL,
            *sample_tokenizer,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=peer_env(),
    )
    assert result.returncode == 2, result.stderr[-2000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
