"""TrainerPeer in this process, alone in its swarm: the whole loop on the tiny model, in seconds."""

import logging
import re

import torch

from sahajbert.checkpoints import list_checkpoints
from sahajbert.cli import parse_args
from sahajbert.compute import Compute, LocalCompute
from sahajbert.flags import PeerArguments
from sahajbert.hivemind_ext.optim import accessors
from sahajbert.joining import parameters_digest
from sahajbert.localswarm import tiny_trainer_flags
from sahajbert.model import build_model
from sahajbert.reports import slow_pace_warning
from sahajbert.signals import StopRequest
from sahajbert.stream import training_batches
from sahajbert.tokenization import load_tokenizer
from sahajbert.train_log import StepRecord, read_train_log
from sahajbert.trainer import TrainerPeer


def test_a_lone_trainer_makes_its_global_steps_logs_and_saves_them(tmp_path):
    flags = tiny_trainer_flags(target_batch_size=16, max_steps=3, save_steps=2, output_dir=tmp_path)
    (peer_args,) = parse_args((PeerArguments,), flags)
    with TrainerPeer(peer_args) as peer:
        assert isinstance(peer.compute, LocalCompute) and isinstance(peer.compute, Compute)
        assert peer.ending.final_round is not None, "a run with --max_steps ends in a final round (skipped when alone)"
        result = peer.run(StopRequest())
    # 16 samples per global step, 8 per pass: two passes toward each of the three steps
    assert result.final_step == 3 and [r.step for r in result.steps] == [1, 2, 3]
    assert all(isinstance(r, StepRecord) and r.mini_steps == 2 and r.samples == 16 for r in result.steps)
    assert all(r.peers <= 1 and torch.isfinite(torch.tensor(r.loss)) for r in result.steps), "no other peer"
    assert read_train_log(tmp_path) == result.steps, "train_log.jsonl holds exactly the records the trainer made"
    # step 2 by --save_steps, step 3 as the final checkpoint
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2, 3] and result.checkpoint.name == "checkpoint-3"


def test_a_stop_before_the_first_step_leaves_a_checkpoint_a_restart_resumes_from(tmp_path):
    (peer_args,) = parse_args((PeerArguments,), tiny_trainer_flags(max_steps=3, output_dir=tmp_path))
    stop = StopRequest()
    stop.event.set()
    with TrainerPeer(peer_args) as peer:
        result = peer.run(stop)
        stopped_with = parameters_digest(list(peer.model.parameters()))
    assert result.steps == [] and result.final_step == 0
    assert [step for step, _ in list_checkpoints(tmp_path)] == [0] and result.checkpoint.name == "checkpoint-0"
    # another seed: a restart that started afresh would have other parameters than the ones it stopped with
    (restart_args,) = parse_args(
        (PeerArguments,), [*tiny_trainer_flags(max_steps=3, output_dir=tmp_path), "--seed", "7"]
    )
    with TrainerPeer(restart_args) as restarted:
        assert parameters_digest(list(restarted.model.parameters())) == stopped_with


def test_local_clipping_bounds_each_pass_before_it_is_handed_to_the_swarm(tmp_path):
    """--clip_gradients local (DeDLOC's): the gradients of a pass are clipped before hivemind accumulates them."""
    norms = {}
    for mode in ("local", "averaged"):
        flags = tiny_trainer_flags(max_steps=3, output_dir=tmp_path / mode)
        (peer_args,) = parse_args((PeerArguments,), [*flags, "--clip_gradients", mode, "--max_grad_norm", "0.05"])
        with TrainerPeer(peer_args) as peer:
            peer.stop = StopRequest()
            assert peer._forward_backward() is not None
            grads = [p.grad for p in peer.model.parameters() if p.grad is not None]
            norms[mode] = torch.sqrt(sum(g.pow(2).sum() for g in grads)).item()
    assert norms["local"] <= 0.05 + 1e-6 < norms["averaged"], norms


def test_a_data_seed_gives_a_trainer_the_stream_of_that_seed(tmp_path):
    """--data_seed repeats a stream (a benchmark's plain loop reads the trainer's batches); without it, the order
    mixes in the process's key."""
    first_batches = {}
    for data_seed in (None, 5):
        flags = tiny_trainer_flags(max_steps=3, output_dir=tmp_path / str(data_seed))
        flags += [] if data_seed is None else ["--data_seed", str(data_seed)]
        (peer_args,) = parse_args((PeerArguments,), flags)
        with TrainerPeer(peer_args) as peer:
            first_batches[data_seed] = peer.batches.get(StopRequest())["input_ids"]
    given = training_batches(peer_args.corpus_args, peer.tokenizer, 5, len(first_batches[5]), False)
    try:
        expected = given.get(StopRequest())["input_ids"]
    finally:
        given.close()
    assert torch.equal(first_batches[5], expected)
    assert not torch.equal(first_batches[None], expected)


def test_the_initial_parameters_digest_tells_one_seed_from_another():
    """Two trainers of a new run with one --seed start from the same parameters (nothing to download); another seed,
    or one changed value, gives another digest."""
    tokenizer = load_tokenizer("sample")
    digests = [parameters_digest(list(build_model("tiny", tokenizer, seed).parameters())) for seed in (42, 42, 7)]
    assert digests[0] == digests[1] != digests[2]
    assert re.fullmatch("[0-9a-f]{32}", digests[0]), digests[0]
    parameters = list(build_model("tiny", tokenizer, 42).parameters())
    # of the values in fp32, whatever their dtype or layout: a float64 copy of each tensor, transposed and back
    copies = [p.detach().to(torch.float64).t().contiguous().t() if p.dim() == 2 else p.double() for p in parameters]
    assert parameters_digest(copies) == digests[0]
    # in order: the same tensors in another order are another starting point
    assert parameters_digest(parameters[::-1]) != digests[0]
    # every tensor counts, to its last value's last bit
    for index, tensor in enumerate(parameters):
        with torch.no_grad():
            flat, kept = tensor.view(-1), tensor.view(-1)[-1].clone()
            flat[-1] = torch.nextafter(kept, torch.tensor(float("inf")))
            assert parameters_digest(parameters) != digests[0], index
            flat[-1] = kept
    assert parameters_digest(parameters) == digests[0]


def test_a_step_that_would_take_hours_is_said_once_with_what_to_try(tmp_path, caplog):
    """A lone trainer of the tiny model against a target of 10 million samples: hours per step at its own pace."""
    flags = tiny_trainer_flags(target_batch_size=10_000_000, max_steps=3, output_dir=tmp_path)
    (peer_args,) = parse_args((PeerArguments,), [*flags, "--log_every_seconds", "0"])
    stop = StopRequest()

    class StopOnceWarned(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING and "a global step of" in record.getMessage():
                stop.event.set()

    handler = StopOnceWarned()
    logging.getLogger("sahajbert.trainer").addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="sahajbert.trainer"), TrainerPeer(peer_args) as peer:
            peer.run(stop)
            # the pace is the swarm's: this peer alone, at the samples/s its own progress lines said
            position = accessors.position(peer.optimizer)
    finally:
        logging.getLogger("sahajbert.trainer").removeHandler(handler)
    told = [
        r.getMessage() for r in caplog.records if "a global step of 10000000 samples takes about" in r.getMessage()
    ]
    assert len(told) == 1 and "more peers, or a smaller --target_batch_size" in told[0], told
    assert position.target_batch_size == 10_000_000


def test_the_pace_warning_names_the_tiny_model_to_a_cpu_running_a_real_preset():
    def at(seconds_left, accumulated=0, target=4096):
        return accessors.SwarmPosition(0, 0, 1, accumulated, target, False, False, seconds_left)

    assert slow_pace_warning(at(None), "sahajbert", "cpu") is None, "no pace measured yet"
    assert slow_pace_warning(at(4096 / 1e-20), "sahajbert", "cpu") is None, "hivemind's pace before a measurement"
    assert slow_pace_warning(at(600), "sahajbert", "cpu") is None, "10 minutes per step is no news"
    # 0.1 samples/s: 4,096 samples in 11.4 h
    line = slow_pace_warning(at(40_960 - 1_000, accumulated=100), "sahajbert", "cpu")
    assert "(0.10 samples/s), a global step of 4096 samples takes about 11.4 h" in line, line
    assert "use --model tiny" in line
    assert "--model tiny" not in slow_pace_warning(at(40_960), "sahajbert", "cuda")
