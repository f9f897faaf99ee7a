"""TrainerPeer in this process, alone in its swarm: the whole loop on the tiny model, in seconds."""

import re

import torch

from sahajbert.arguments import PeerArguments
from sahajbert.checkpoints import list_checkpoints
from sahajbert.cli import parse_args
from sahajbert.compute import Compute, LocalCompute
from sahajbert.localswarm import tiny_trainer_flags
from sahajbert.model import build_model
from sahajbert.signals import StopRequest
from sahajbert.tokenization import load_tokenizer
from sahajbert.train_log import StepRecord, read_train_log
from sahajbert.trainer import TrainerPeer, parameters_digest


def test_a_lone_trainer_makes_its_global_steps_logs_and_saves_them(tmp_path):
    flags = tiny_trainer_flags(target_batch_size=16, max_steps=3, save_steps=2, output_dir=tmp_path)
    (peer_args,) = parse_args((PeerArguments,), flags)
    with TrainerPeer(peer_args) as peer:
        assert isinstance(peer.compute, LocalCompute) and isinstance(peer.compute, Compute)
        assert peer.final_round is not None, "a run with --max_steps ends in a final round (skipped when alone)"
        result = peer.run(StopRequest())
    # 16 samples per global step, 8 per pass: two passes toward each of the three steps
    assert result.final_step == 3 and [r.step for r in result.steps] == [1, 2, 3]
    assert all(isinstance(r, StepRecord) and r.mini_steps == 2 and r.samples == 16 for r in result.steps)
    assert all(r.peers <= 1 and torch.isfinite(torch.tensor(r.loss)) for r in result.steps), "no other peer"
    assert read_train_log(tmp_path) == result.steps, "train_log.jsonl holds exactly the records the trainer made"
    # step 2 by --save_steps, step 3 as the final checkpoint
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2, 3] and result.checkpoint.name == "checkpoint-3"


def test_a_stop_request_ends_the_loop_before_any_step(tmp_path):
    (peer_args,) = parse_args((PeerArguments,), tiny_trainer_flags(max_steps=3, output_dir=tmp_path))
    stop = StopRequest()
    stop.event.set()
    with TrainerPeer(peer_args) as peer:
        result = peer.run(stop)
    assert result.steps == [] and result.final_step == 0 and list_checkpoints(tmp_path) == []


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
