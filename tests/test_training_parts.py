"""The parts a trainer is built from: presets, LAMB, schedule, rollback, checkpoints, precision, metrics."""

import asyncio
import contextlib
import json
import logging
import math
import runpy
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
import torch
from transformers import AlbertConfig, AlbertForPreTraining

from sahajbert import checkpoints
from sahajbert import hivemind_ext as compat
from sahajbert.cli import UserError
from sahajbert.devices import DeviceInfo, choose_precision
from sahajbert.flags import (
    AveragingArguments,
    CollaborativeOptimizerArguments,
    LocalTrainingArguments,
    PeerArguments,
    SparseDiLoCoArguments,
    SwarmArguments,
)
from sahajbert.model import PRESETS_DIR, build_model, load_config
from sahajbert.monitor import SwarmMonitor
from sahajbert.optim import Lamb, lr_at_step, parameter_groups
from sahajbert.records import LocalMetrics, StepEntry

from .swarm_helpers import LOCAL, USER_SCRIPTS, script


def test_presets_have_the_real_shapes():
    base = AlbertConfig.from_json_file(PRESETS_DIR / "sahajbert.json")
    assert (
        base.hidden_size,
        base.num_hidden_layers,
        base.num_attention_heads,
        base.intermediate_size,
        base.embedding_size,
        base.vocab_size,
    ) == (1024, 24, 16, 4096, 128, 32000)
    xl = AlbertConfig.from_json_file(PRESETS_DIR / "sahajbert-xl.json")
    assert (xl.hidden_size, xl.num_hidden_layers, xl.num_attention_heads, xl.intermediate_size, xl.embedding_size) == (
        2048,
        24,
        16,
        8192,
        128,
    )


def test_model_follows_the_tokenizer_and_seed(tokenizer):
    config = load_config("sahajbert", tokenizer)
    assert config.vocab_size == len(tokenizer) and config.pad_token_id == tokenizer.pad_token_id
    a, b = build_model("tiny", tokenizer, seed=3), build_model("tiny", tokenizer, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters())), "same seed, same start"
    with pytest.raises(UserError, match="unknown model"):
        load_config("albert-huge", tokenizer)


def test_no_weight_decay_on_biases_and_every_layer_norm(tokenizer):
    model = build_model("tiny", tokenizer, seed=0)
    decay, no_decay = parameter_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert "albert.encoder.albert_layer_groups.0.albert_layers.0.full_layer_layer_norm.weight" in no_decay_names
    assert all("bias" in n or "LayerNorm" in n or "layer_norm" in n for n in no_decay_names)
    assert all(p.dim() > 1 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.01


def test_lamb_minimizes_and_scales_updates_by_weight_norm():
    torch.manual_seed(0)
    target = torch.randn(20, 20)
    weight = torch.nn.Parameter(torch.randn(20, 20))
    optimizer = Lamb([weight], lr=0.05, clamp_value=10_000.0)
    start = (weight - target).pow(2).mean().item()
    for step in range(200):
        before = weight.detach().clone()
        optimizer.zero_grad()
        (weight - target).pow(2).mean().backward()
        optimizer.step()
        if step == 0:  # trust ratio: the first step moves the weights by lr * ||w|| * sqrt(1 - beta2) / (1 - beta1)
            expected = 0.05 * before.norm().item() * math.sqrt(1 - 0.999) / (1 - 0.9)
            assert (weight - before).norm().item() == pytest.approx(expected, rel=1e-4)
    assert (weight - target).pow(2).mean().item() < 0.01 * start


def test_lamb_clamps_the_weight_norm():
    weight = torch.nn.Parameter(torch.full((10, 10), 3.0))  # ||w|| = 30
    optimizer = Lamb([weight], lr=0.1, clamp_value=10.0)
    weight.sum().backward()
    before = weight.detach().clone()
    optimizer.step()
    assert (weight - before).norm().item() == pytest.approx(0.1 * 10.0 * math.sqrt(1 - 0.999) / (1 - 0.9), rel=1e-4)


def test_lamb_equals_torch_optimizer_lamb_with_debias_step_for_step():
    """The optimizer both references ran (torch_optimizer.Lamb, debias on): 300 steps, decay and clamp included."""
    import torch_optimizer  # requirements-dev.txt: a test-only dependency

    torch.manual_seed(0)
    shapes = [(16, 8), (8,), (4, 4, 3), (5,)]
    ours = [torch.nn.Parameter(torch.randn(s) * (10.0 if i == 2 else 1.0)) for i, s in enumerate(shapes)]
    ours.append(torch.nn.Parameter(torch.zeros(6)))  # a fresh bias: trust ratio 1
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    settings = dict(lr=0.00176, betas=(0.9, 0.999), eps=1e-6)

    def groups(params):
        return [{"params": params[:3], "weight_decay": 0.01}, {"params": params[3:], "weight_decay": 0.0}]

    mine = Lamb(groups(ours), clamp_value=5.0, **settings)  # clamp 5: the third tensor's norm is above it
    reference = torch_optimizer.Lamb(groups(theirs), clamp_value=5.0, debias=True, **settings)
    for step in range(300):
        gradients = [torch.randn(p.shape) * (step % 7 + 1) for p in ours]
        for params, optimizer in ((ours, mine), (theirs, reference)):
            for p, g in zip(params, gradients):
                p.grad = g.clone()
            optimizer.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step + 1}")


def test_lr_schedule_shape():
    assert lr_at_step(0, 1.0, 10, 110) == 0.0
    assert lr_at_step(5, 1.0, 10, 110) == pytest.approx(0.5)
    assert lr_at_step(10, 1.0, 10, 110) == pytest.approx(1.0)
    assert lr_at_step(60, 1.0, 10, 110) == pytest.approx(0.5)
    assert lr_at_step(200, 1.0, 10, 110) == 0.0


def lonely_lockstep(
    tokenizer,
    run_id: str,
    target_batch_size: int = 8,
    averaging_timeout: float | None = None,
    timing=None,
    delayed: bool = False,
):
    """A real hivemind.Optimizer in lockstep mode (`delayed`: with delayed updates, the trainer's default) alone in
    its swarm, from the trainer's factory, and its DHT (`timing`: sahajbert.adaptive's plan, as the trainer passes
    it; None: planned by the factory)."""
    import hivemind

    from sahajbert.optim import build_collaborative_optimizer

    model = build_model("tiny", tokenizer, seed=0)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peer_args = PeerArguments(
        swarm_args=SwarmArguments(run_id=run_id),
        averaging_args=AveragingArguments(matchmaking_time=1.0, averaging_timeout=averaging_timeout),
        optimizer_args=CollaborativeOptimizerArguments(
            target_batch_size=target_batch_size, delay_optimizer_step=delayed, delay_grad_averaging=delayed
        ),
        training_args=LocalTrainingArguments(
            per_device_train_batch_size=4, learning_rate=0.01, warmup_steps=4, total_steps=100
        ),
    )
    return model, build_collaborative_optimizer(model, dht, peer_args, timing=timing), dht


@pytest.fixture
def lonely_optimizer(tokenizer):
    """A real hivemind.Optimizer in a one-peer swarm, built by the same factory as the trainer's."""
    model, optimizer, dht = lonely_lockstep(tokenizer, "lonely")
    yield model, optimizer
    optimizer.shutdown()
    dht.shutdown()


def lonely_diloco(
    tokenizer,
    run_id: str,
    inner_steps: int = 3,
    averaging_timeout: float | None = None,
    overlap: bool = False,
    max_steps: int | None = None,
    inner_optimizer: str = "lamb",
    compression: str = "8bit",
    sparse: SparseDiLoCoArguments | None = None,
):
    """A DiLoCo optimizer alone in its swarm, from the trainer's factory, and its DHT; `compression`: its
    --pseudo_gradient_compression, `sparse`: its sparse DiLoCo flags."""
    import hivemind

    from sahajbert.optim import build_collaborative_optimizer

    model = build_model("tiny", tokenizer, seed=0)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peer_args = PeerArguments(
        swarm_args=SwarmArguments(run_id=run_id),
        averaging_args=AveragingArguments(matchmaking_time=1.0, averaging_timeout=averaging_timeout),
        optimizer_args=CollaborativeOptimizerArguments(
            diloco_inner_steps=inner_steps,
            diloco_wait=0,
            diloco_overlap=overlap,
            diloco_inner_optimizer=inner_optimizer,
            pseudo_gradient_compression=compression,
        ),
        sparse_args=sparse or SparseDiLoCoArguments(),
        training_args=LocalTrainingArguments(
            per_device_train_batch_size=4, learning_rate=0.01, warmup_steps=1, total_steps=1000, max_steps=max_steps
        ),
    )
    return model, build_collaborative_optimizer(model, dht, peer_args), dht


def seeded_batch(seed: int) -> dict:
    """4 random sequences of 16 tokens with labels, after torch.manual_seed(seed) (the forward's dropout follows)."""
    torch.manual_seed(seed)
    return {
        "input_ids": torch.randint(5, 100, (4, 16)),
        "labels": torch.randint(5, 100, (4, 16)),
        "sentence_order_label": torch.randint(0, 2, (4,)),
    }


def train_one_batch(model, optimizer):
    batch = seeded_batch(optimizer.local_epoch)
    model(**batch).loss.backward()
    optimizer.step(batch_size=4)
    optimizer.zero_grad()


def train_to(model, optimizer, step: int) -> None:
    """Train one batch at a time until the optimizer reaches global `step` (a few mini-steps each: a step waits for
    the swarm's count of samples)."""
    for _ in range(30):
        if optimizer.local_epoch >= step:
            return
        train_one_batch(model, optimizer)
    raise AssertionError(f"no global step {step} in 30 mini-steps")


def test_both_averagers_wait_the_planned_time_for_a_leaders_answer(tokenizer):
    from sahajbert.adaptive import plan_timing

    timing = replace(plan_timing(1e6, 1e6, None, {}), request_timeout=7.5, matchmaking_time=9.0)
    _, optimizer, dht = lonely_lockstep(tokenizer, "ask", timing=timing)
    try:
        # hivemind gives averager_opts to the state averager only; the gradient averager gets it by our factory
        for averager in (optimizer.grad_averager, optimizer.state_averager):
            assert averager.matchmaking_kwargs["request_timeout"] == 7.5, type(averager).__name__
    finally:
        optimizer.shutdown()
        dht.shutdown()


def test_schedule_follows_the_global_step_not_mini_steps(lonely_optimizer):
    # mini-steps of 4 samples toward global steps of 8: at least 2 per step (a step waits for the swarm's count of
    # samples, which a busy machine may read a pass late)
    model, optimizer = lonely_optimizer
    mini_steps = 0
    while optimizer.local_epoch < 3 and mini_steps < 30:
        train_one_batch(model, optimizer)
        mini_steps += 1
    assert optimizer.local_epoch == 3 and mini_steps >= 6, (optimizer.local_epoch, mini_steps)
    assert lr_at_step(3, 0.01, 4, 100) != lr_at_step(mini_steps, 0.01, 4, 100)
    assert optimizer.opt.param_groups[0]["lr"] == pytest.approx(lr_at_step(3, 0.01, 4, 100))


def kept_where(where: str, output_dir):
    from sahajbert.rollback import keep_good_state

    return keep_good_state(where, output_dir)


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_non_finite_parameters_roll_back_to_the_last_good_state(lonely_optimizer, where, tmp_path):
    from sahajbert.rollback import LastGoodState

    model, optimizer = lonely_optimizer
    train_one_batch(model, optimizer)
    train_one_batch(model, optimizer)
    good = LastGoodState(optimizer, pending_update_timeout=10.0, kept=kept_where(where, tmp_path))
    assert good.keep_or_roll_back(), "finite parameters are kept as the new good state"
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    assert not good.parameters_finite()
    # the trainer's own end-of-step check: it finds the NaN and restores the last good state
    assert not good.keep_or_roll_back()
    assert good.parameters_finite()
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
    train_one_batch(model, optimizer)  # and training goes on from there
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_finite_parameters_that_overflow_every_pass_roll_back_to_the_last_state_that_trained(
    lonely_optimizer, where, tmp_path
):
    from sahajbert.rollback import DROPPED_PASSES_BEFORE_ROLLBACK, LastGoodState

    model, optimizer = lonely_optimizer
    train_one_batch(model, optimizer)
    good = LastGoodState(optimizer, pending_update_timeout=10.0, kept=kept_where(where, tmp_path))
    good.save()  # the state the trainer starts from
    train_one_batch(model, optimizer)
    good.after_finite_pass()
    trained = [p.detach().clone() for p in model.parameters()]
    assert good.keep_or_roll_back()  # a global step: kept, not yet trusted
    good.after_finite_pass()  # a pass from it was finite: now it is the one to roll back to
    train_one_batch(model, optimizer)
    # a plain mean with a x1e4 peer's parameters, a few times over: finite, and every pass from them overflows
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e30)
    assert good.parameters_finite() and good.keep_or_roll_back()
    batch = {
        "input_ids": torch.randint(5, 100, (4, 16)),
        "labels": torch.randint(5, 100, (4, 16)),
        "sentence_order_label": torch.randint(0, 2, (4,)),
    }
    assert not torch.isfinite(model(**batch).loss), "the inflated parameters must overflow a pass"
    rolled_back = [good.after_dropped_pass() for _ in range(DROPPED_PASSES_BEFORE_ROLLBACK)]
    # one dropped pass is a bad batch; DROPPED_PASSES_BEFORE_ROLLBACK in a row roll back, past the inflated state
    # that keep_or_roll_back kept, to the last one that gave a finite pass
    assert rolled_back == [False] * (DROPPED_PASSES_BEFORE_ROLLBACK - 1) + [True]
    assert all(torch.equal(a, b) for a, b in zip(trained, model.parameters()))
    assert torch.isfinite(model(**batch).loss)
    # a state restored that overflows every pass as well is not restored over and over: the trainer stops
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e30)
    for _ in range(DROPPED_PASSES_BEFORE_ROLLBACK - 1):
        assert not good.after_dropped_pass()
    with pytest.raises(UserError, match="every pass from the last good state is non-finite too"):
        good.after_dropped_pass()


def test_the_last_good_state_is_one_copy_overwritten_once_a_pass_from_a_new_state_is_finite(lonely_optimizer):
    from sahajbert.hivemind_ext.optim import accessors
    from sahajbert.rollback import LastGoodState

    model, optimizer = lonely_optimizer
    train_to(model, optimizer, 1)  # the optimizer has its moments
    good = LastGoodState(optimizer, pending_update_timeout=10.0, kept=kept_where("memory", None))
    good.save()
    kept_parameters, kept_state, _ = good.kept.state
    moments = [t for state in kept_state["state"].values() for t in state.values() if isinstance(t, torch.Tensor)]
    addresses = [t.data_ptr() for t in [*kept_parameters, *moments]]
    first = [t.clone() for t in kept_parameters]
    first_moments = [t.clone() for t in moments]
    train_to(model, optimizer, 2)
    assert not all(torch.equal(a, b.detach()) for a, b in zip(first, accessors.master_parameters(optimizer)))
    assert good.keep_or_roll_back()
    # not yet trusted: the copy still holds the state it had (training did not write into it), and no second copy
    assert all(torch.equal(a, b) for a, b in zip(first, good.kept.state[0]))
    assert all(torch.equal(a, b) for a, b in zip(first_moments, moments))
    good.after_finite_pass()
    kept = good.kept.state
    assert all(torch.equal(a, b.detach()) for a, b in zip(kept[0], accessors.master_parameters(optimizer)))
    live = optimizer.opt.state_dict()["state"]
    for index, state in kept[1]["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(live[index][name])), (index, name)
    moments = [t for state in kept[1]["state"].values() for t in state.values() if isinstance(t, torch.Tensor)]
    assert [t.data_ptr() for t in [*kept[0], *moments]] == addresses, "copied into the same tensors"
    assert not any(
        t.data_ptr() == m.data_ptr() for t in moments for s in live.values() for m in s.values() if torch.is_tensor(m)
    ), "the copy shares no tensor with the live optimizer"


def test_the_last_good_state_on_disk_is_one_file_rewritten_once_trusted_and_removed_at_the_end(
    lonely_optimizer, tmp_path
):
    from sahajbert.hivemind_ext.optim import accessors
    from sahajbert.rollback import GOOD_STATE_FILE, LastGoodState

    model, optimizer = lonely_optimizer
    train_to(model, optimizer, 1)
    good = LastGoodState(optimizer, pending_update_timeout=10.0, kept=kept_where("disk", tmp_path))
    good.save()
    assert sorted(path.name for path in tmp_path.iterdir()) == [GOOD_STATE_FILE], "one file, no temporary left"
    first = [p.detach().clone() for p in accessors.master_parameters(optimizer)]
    train_to(model, optimizer, 2)
    assert good.keep_or_roll_back()
    # not yet trusted: the file still holds the first state
    assert all(torch.equal(a, b) for a, b in zip(first, good.kept.read()[0]))
    good.after_finite_pass()
    parameters, optimizer_state, _ = good.kept.read()
    assert all(torch.equal(a, b.detach()) for a, b in zip(parameters, accessors.master_parameters(optimizer)))
    live = optimizer.opt.state_dict()["state"]
    for index, state in optimizer_state["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(live[index][name])), (index, name)
    assert sorted(path.name for path in tmp_path.iterdir()) == [GOOD_STATE_FILE]
    good.close()
    assert not any(tmp_path.iterdir()), "a stopped trainer leaves no rollback file (its checkpoint resumes it)"


def test_the_good_state_file_is_rewritten_in_place_and_anew_after_a_rollback_mapped_it(lonely_optimizer, tmp_path):
    """In place while nothing maps it (the kernel reuses its pages); after a read (a rollback maps the file), the next
    write goes to a new file, and the tensors mapped from the old one keep their values."""
    from sahajbert.hivemind_ext.optim import accessors
    from sahajbert.rollback import GOOD_STATE_FILE, LastGoodState

    model, optimizer = lonely_optimizer
    good = LastGoodState(optimizer, pending_update_timeout=10.0, kept=kept_where("disk", tmp_path))
    path = tmp_path / GOOD_STATE_FILE
    inodes = []
    for step in (1, 2):
        train_to(model, optimizer, step)
        good.kept.write(accessors.master_parameters(optimizer), optimizer.opt.state_dict(), optimizer.local_state)
        inodes.append(path.stat().st_ino)
    assert inodes[0] == inodes[1], "rewritten in place"
    mapped = good.kept.read()[0]
    held = [p.clone() for p in mapped]
    train_to(model, optimizer, 3)
    good.kept.write(accessors.master_parameters(optimizer), optimizer.opt.state_dict(), optimizer.local_state)
    assert path.stat().st_ino != inodes[1], "a new file after a read"
    assert all(torch.equal(a, b) for a, b in zip(held, mapped)), "what a rollback mapped keeps its values"
    assert not all(torch.equal(a, b) for a, b in zip(held, good.kept.read()[0])), "the file holds the new state"
    assert sorted(p.name for p in tmp_path.iterdir()) == [GOOD_STATE_FILE]


def test_a_good_state_that_cannot_be_written_to_disk_is_kept_in_memory_with_one_line(
    lonely_optimizer, tmp_path, caplog
):
    from sahajbert.rollback import LastGoodState

    model, optimizer = lonely_optimizer
    train_one_batch(model, optimizer)
    not_a_folder = tmp_path / "output"
    not_a_folder.write_text("a file where the output folder should be")  # unwritable also for root
    good = LastGoodState(optimizer, pending_update_timeout=10.0, kept=kept_where("disk", not_a_folder))
    with caplog.at_level(logging.WARNING, logger="sahajbert.trainer"):
        assert good.keep_or_roll_back()
        train_one_batch(model, optimizer)
        assert good.keep_or_roll_back()
        good.after_finite_pass()
    lines = [r.getMessage() for r in caplog.records if "last good state" in r.getMessage()]
    assert len(lines) == 1 and "kept in memory instead" in lines[0], lines
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    assert not good.keep_or_roll_back()
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))


def test_with_delayed_updates_the_good_state_is_copied_only_once_no_update_is_pending(tokenizer):
    # the optimizer steps its state in the background and the parameters take that step at a later step(): a copy
    # taken meanwhile would pair checked parameters with optimizer state of the next step
    from sahajbert.hivemind_ext.optim import accessors
    from sahajbert.rollback import LastGoodState

    model, optimizer, dht = lonely_lockstep(tokenizer, "delayed_good", delayed=True)
    try:
        good = LastGoodState(optimizer, pending_update_timeout=10.0, kept=kept_where("memory", None))
        good.save()
        kept = [t.clone() for t in good.kept.state[0]]
        train_to(model, optimizer, 1)
        assert accessors.has_pending_updates(optimizer, round_in_flight=False)
        assert good.keep_or_roll_back()
        good.after_finite_pass()  # a finite pass, but the step's update is still to come: nothing copied
        assert good.untrusted and all(torch.equal(a, b) for a, b in zip(kept, good.kept.state[0]))
        assert accessors.apply_pending_updates(optimizer, timeout=30)
        good.after_finite_pass()
        assert not good.untrusted
        now = good.kept.state[0]
        assert all(torch.equal(a, b.detach()) for a, b in zip(now, accessors.master_parameters(optimizer)))
        assert not all(torch.equal(a, b) for a, b in zip(kept, now)), "the step's state was copied"
    finally:
        optimizer.shutdown()
        dht.shutdown()


def test_checkpoints_are_atomic_and_pruned(tmp_path, tokenizer):
    model = build_model("tiny", tokenizer, seed=0)
    for step in (1, 2, 3, 4):
        checkpoints.save_checkpoint(tmp_path, step, model, tokenizer, {"state": {}, "param_groups": []}, keep=2)
    assert [s for s, _ in checkpoints.list_checkpoints(tmp_path)] == [3, 4]
    # a crash mid-save leaves a temporary folder (and maybe a folder without its state file): never the latest
    (tmp_path / ".tmp-checkpoint-9-123").mkdir()
    (tmp_path / "checkpoint-7").mkdir()
    (tmp_path / "checkpoint-7" / "config.json").write_text("{}")
    assert checkpoints.latest_checkpoint(tmp_path).name == "checkpoint-4"
    latest = checkpoints.latest_checkpoint(tmp_path)
    assert AlbertForPreTraining.from_pretrained(latest).config.vocab_size == len(tokenizer)
    assert json.loads((latest / "trainer_state.json").read_text())["global_step"] == 4
    # saving the same step again replaces it whole
    checkpoints.save_checkpoint(tmp_path, 4, model, tokenizer, None, {"loss": 1.5}, keep=2)
    assert checkpoints.read_state(latest)["loss"] == 1.5 and not (latest / "optimizer.pt").exists()
    (latest / "trainer_state.json").write_text("{not json")
    with pytest.raises(UserError, match="unreadable"):
        checkpoints.read_state(latest)


@pytest.mark.parametrize(
    "device, requested, expected",
    [
        (DeviceInfo("cuda", "Tesla T4", (7, 5), 15.0), "auto", "fp16"),
        (DeviceInfo("cuda", "Tesla V100", (7, 0), 16.0), "auto", "fp16"),
        (DeviceInfo("cuda", "Tesla P100", (6, 0), 16.0), "auto", "fp32"),
        (DeviceInfo("cuda", "A100", (8, 0), 40.0), "bf16", "bf16"),
        (DeviceInfo("cuda", "H100", (9, 0), 80.0), "auto", "fp16"),
        (DeviceInfo("cuda", "A100", (8, 0), 40.0), "auto", "fp16"),
        (DeviceInfo("tpu", "TPU v3-8", cores=8), "auto", "fp32"),
        (DeviceInfo("tpu", "TPU v3-8", cores=8), "bf16", "bf16"),
        (DeviceInfo("cpu", "cpu"), "auto", "fp32"),
        (DeviceInfo("cpu", "cpu"), "bf16", "bf16"),
    ],
)
def test_precision_policy(device, requested, expected):
    assert choose_precision(device, requested) == expected


@pytest.mark.parametrize(
    "device, requested, message",
    [
        (DeviceInfo("cpu", "cpu"), "fp16", "needs a CUDA GPU"),
        (DeviceInfo("cuda", "Tesla T4", (7, 5), 15.0), "bf16", "Ampere or newer"),
        (DeviceInfo("cuda", "Tesla V100", (7, 0), 16.0), "bf16", "Ampere or newer"),
        (DeviceInfo("tpu", "TPU v3-8", cores=8), "fp16", "needs a CUDA GPU"),
    ],
)
def test_precision_policy_rejects_what_the_device_cannot_do(device, requested, message):
    with pytest.raises(UserError, match=message):
        choose_precision(device, requested)


def test_the_monitors_step_loss_is_the_loss_sum_over_the_mini_steps_of_the_peers_in_it():
    def record(step, samples_per_second, samples, loss, mini_steps):
        entry = StepEntry(
            step=step, loss=loss, mini_steps=mini_steps, samples=samples, samples_per_second=samples_per_second
        )
        return LocalMetrics(
            step=step,
            samples_per_second=samples_per_second,
            samples_accumulated=samples,
            loss=loss,
            mini_steps=mini_steps,
            recent=[entry],
        )

    monitor = SwarmMonitor("run")
    monitor.update({b"a": record(5, 10.0, 64, 8.0, 4), b"b": record(5, 30.0, 192, 12.0, 12)}, now=0.0)
    monitor.update({b"c": record(4, 5.0, 32, 100.0, 2)}, now=1.0)
    four, five = monitor.history
    assert five == {
        "step": 5,
        "loss": pytest.approx(20.0 / 16),
        "samples": 256,
        "samples_per_second": 40.0,
        "peers": 2,
    }
    assert four["loss"] == 50.0 and four["peers"] == 1 and monitor.global_step == 5


@pytest.mark.slow
def test_first_peer_keeps_its_id_and_stops_on_sigterm(tmp_path):
    from sahajbert.localswarm import PeerProcess, wait_for

    identity = tmp_path / "id.key"
    ids = []
    for attempt in range(2):
        peer = PeerProcess(
            script("run_first_peer.py"), ["--identity_path", str(identity), *LOCAL], tmp_path / f"fp{attempt}.log"
        )
        line = wait_for(
            lambda peer=peer: next((x for x in peer.output().splitlines() if "--initial_peers" in x), None),
            60,
            "the --initial_peers line",
        )
        assert line.startswith("python run_trainer.py --run_id sahajbert --initial_peers /ip4/127.0.0.1/tcp/")
        ids.append(line.rsplit("/p2p/", 1)[1])
        peer.process.terminate()
        assert peer.wait(30) == 0, peer.output()
        # the first peer makes no steps: it says it stops, not that it finishes a step first
        assert "received SIGTERM: stopping (" in peer.output() and "after the current" not in peer.output()
        peer.stop()
    assert identity.exists() and ids[0] == ids[1], "the same identity file must give the same peer id"


@pytest.mark.parametrize(
    "name",
    ["arguments.py", *USER_SCRIPTS, "benchmarks/netswarm.py", "benchmarks/bench_swarm.py", "benchmarks/bench_data.py"],
)
def test_scripts_answer_help(name, capsys):
    """Each script's main(["--help"]), called in this process as a user's shell would run it (offline here)."""
    main = runpy.run_path(str(script(name)))["main"]
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out


def test_averaged_clipping_clips_what_lamb_applies():
    """--clip_gradients averaged: LAMB clips the (averaged) gradients it is given to --max_grad_norm, then steps.

    Two steps of very different scale: the moments, and so the steps, depend on the gradients' relative size."""
    torch.manual_seed(0)
    start = [torch.randn(8, 8), torch.randn(8)]
    steps = [[torch.randn(8, 8) * 50, torch.randn(8) * 50], [torch.randn(8, 8) * 0.5, torch.randn(8) * 0.5]]

    def run(max_grad_norm, scale_by_hand):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        optimizer = Lamb(params, lr=0.01, max_grad_norm=max_grad_norm)
        for gradients in steps:
            norm = torch.sqrt(sum(g.pow(2).sum() for g in gradients))
            for p, g in zip(params, gradients):
                p.grad = g / max(1.0, norm) if scale_by_hand else g.clone()
            optimizer.step()
            if max_grad_norm:
                assert torch.sqrt(sum(p.grad.pow(2).sum() for p in params)) <= max_grad_norm + 1e-5
        return params

    clipped, by_hand, unclipped = run(1.0, False), run(None, True), run(None, False)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(clipped, by_hand))
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(clipped, unclipped)), "clipping must matter here"


@pytest.mark.parametrize("check", ["is_finite", "gradients_finite"])
def test_is_finite_finds_every_nan_and_infinity_and_nothing_else(check):
    from sahajbert import optim

    is_finite = getattr(optim, check)
    config = AlbertConfig(
        vocab_size=100, embedding_size=16, hidden_size=32, num_attention_heads=4, intermediate_size=64
    )
    model = AlbertForPreTraining(config)
    tensors = [p.detach().clone() for p in model.parameters()] + [None, torch.zeros(0), torch.arange(5)]
    assert is_finite(tensors)
    # fp16 values whose fp16 sum would overflow (65,504) are finite
    assert is_finite([torch.full((100,), 60000.0, dtype=torch.float16), torch.full((3,), 1e30, dtype=torch.float64)])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for index in (0, len(tensors) // 2):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                broken = list(tensors)
                broken[index] = broken[index].to(dtype)
                broken[index].view(-1)[-1] = bad
                assert not is_finite(broken), (bad, index, dtype)
    # the values are left as they were
    before = [t.clone() for t in tensors if t is not None]
    is_finite(tensors)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for t in tensors if t is not None]))


@pytest.mark.parametrize("kind", ["UNIFORM_8BIT", "QUANTILE_8BIT"])
def test_8bit_codecs_decode_what_they_encode(kind):
    """hivemind 1.1.12's own 8-bit decoders fail under numpy >= 2.4 (every received part was dropped); the adapter
    registers fixed ones in their place (`install()`, called for the whole session by conftest.py)."""
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.proto import runtime_pb2

    values = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3 + 1.5
    decoded = deserialize_torch_tensor(serialize_torch_tensor(values, getattr(runtime_pb2, kind)))
    assert decoded.shape == values.shape
    # 256 buckets: a mean error of a few hundredths of the spread, and the mean kept
    assert (decoded - values).abs().mean() < 0.03 * values.std()
    assert abs(decoded.mean() - values.mean()) < 0.01 * values.std()
    constant = torch.full((16,), 2.5)
    encoded = serialize_torch_tensor(constant, getattr(runtime_pb2, kind))
    assert torch.equal(deserialize_torch_tensor(encoded), constant)


def test_8bit_compression_sends_each_tensor_part_in_the_fewer_bytes():
    # 8-bit costs a part's values plus 256 float32 bucket means; a bias of 64 values goes as fp16 (128 bytes, not
    # 64 + 1,032), a matrix of 4,096 values in 8 bits; what the all-reduce sends is what the factory chose
    from hivemind.compression import CompressionInfo

    from sahajbert.optim import make_compression

    compression = make_compression("8bit")
    sizes = {}
    for values in (64, 1032, 1033, 4096):
        tensor = torch.randn(values)
        sizes[values] = len(compression.compress(tensor, CompressionInfo.from_tensor(tensor)).buffer)
    assert sizes[64] == 2 * 64 and sizes[1032] == 2 * 1032, sizes
    assert sizes[1033] == 1033 + 1032 < 2 * 1033 and sizes[4096] == 4096 + 1032, sizes


def test_adaptive_compression_sends_parts_up_to_2_16_values_in_fp16_and_larger_ones_in_8_bits():
    # sahajBERT-XL's rule (--compression adaptive): fp16 up to 2^16 values, 8-bit above, whatever the bytes
    from hivemind.compression import CompressionInfo

    from sahajbert.optim import make_compression

    compression = make_compression("adaptive")
    sizes = {}
    for values in (4096, 2**16, 2**16 + 1):
        tensor = torch.randn(values)
        sizes[values] = len(compression.compress(tensor, CompressionInfo.from_tensor(tensor)).buffer)
    assert sizes == {4096: 2 * 4096, 2**16: 2 * 2**16, 2**16 + 1: 2**16 + 1 + 1032}, sizes


@contextlib.contextmanager
def an_absent_peer(optimizer, dht, run_id: str):
    """Beside a lonely optimizer, a peer that reports progress toward its step and never comes to its averaging
    rounds (tests/absent_peer.py), from when that peer is seen: the optimizer's rounds look for it and fail."""
    from sahajbert.localswarm import wait_for

    absent = subprocess.Popen(
        [sys.executable, str(script("tests/absent_peer.py")), run_id, str(dht.get_visible_maddrs()[0])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert absent.stdout.readline().strip() == "reporting"
        wait_for(
            lambda: optimizer.read_progress_now(5) and optimizer.tracker.global_progress.num_peers == 2,
            60,
            "the other peer's progress to be seen",
        )
        yield
    finally:
        absent.stdin.close()
        absent.wait(60)


@contextlib.contextmanager
def diloco_with_an_absent_peer(tokenizer, run_id: str, overlap: bool = False, averaging_timeout: float = 3.0):
    """A lonely DiLoCo optimizer (3 inner steps, rounds of `averaging_timeout` seconds) beside `an_absent_peer`: its
    outer round looks for that peer and fails. Yields the model, the optimizer (after 2 inner steps) and the
    parameters before those steps (in the outer parameters' order)."""
    from sahajbert import hivemind_ext as compat

    model, optimizer, dht = lonely_diloco(tokenizer, run_id, averaging_timeout=averaging_timeout, overlap=overlap)
    try:
        start = [p.detach().clone() for p in compat.master_parameters(optimizer)]
        for _ in range(2):
            train_one_batch(model, optimizer)
        with an_absent_peer(optimizer, dht, run_id):
            yield model, optimizer, start
    finally:
        optimizer.shutdown()
        dht.shutdown()


def test_a_lockstep_step_whose_gradient_round_found_nobody_makes_no_parameter_round(tokenizer, caplog):
    # lockstep: a gradient round in the foreground, then a parameter round. Peers one round out of phase (each in its
    # gradient round while the others are in their parameter round) found nobody in either, for good: a peer whose
    # gradient round found nobody makes no parameter round at that step, and its next gradient round meets theirs
    from sahajbert import hivemind_ext as compat
    from sahajbert.round_log import RoundMonitor

    run_id = "lockstep-phase"
    model, optimizer, dht = lonely_lockstep(tokenizer, run_id, target_batch_size=12, averaging_timeout=3.0)
    monitor = RoundMonitor(verbose=False).attach()
    try:
        train_one_batch(model, optimizer)  # (reported: until then the swarm's progress has no record of this peer)
        with an_absent_peer(optimizer, dht, run_id), caplog.at_level("INFO", logger="sahajbert"):
            # 8 samples of this peer's and the absent peer's 4 make the step's 12: a gradient round, which finds nobody
            train_one_batch(model, optimizer)
            assert optimizer.local_epoch == 1
            # a parameter round would run in the background: any is over (and counted) once applied
            assert compat.apply_pending_updates(optimizer, 30)
    finally:
        monitor.detach()
        optimizer.shutdown()
        dht.shutdown()
    failed = [r.getMessage() for r in caplog.records if "averaging round failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].startswith("a gradient averaging round failed"), failed
    assert monitor.failed_rounds == 1
    assert any("this step makes no parameter round" in r.getMessage() for r in caplog.records)
    assert optimizer.average_state_every == 1, "the later steps make their parameter rounds"


def test_a_failed_outer_round_steps_on_the_peers_own_pseudo_gradient(tokenizer, caplog):
    # another peer reports progress, so the outer round looks for it, and never comes to the round, which fails: the
    # outer step takes this peer's own pseudo-gradient (hivemind's fallback gave it zeros: the model went back to
    # where its inner steps began)
    from sahajbert import hivemind_ext as compat

    with diloco_with_an_absent_peer(tokenizer, "diloco-failed-round") as (model, optimizer, start):
        params = compat.master_parameters(optimizer)
        reached = [p.detach().clone() for p in params]
        with caplog.at_level("INFO", logger="sahajbert"):
            train_one_batch(model, optimizer)  # the third inner step, then the outer round, which finds nobody
        assert optimizer.local_epoch == 1
        # DiLoCo makes no parameter rounds: lockstep's rule for a gradient round that found nobody has none to skip
        assert not any("makes no parameter round" in r.getMessage() for r in caplog.records)
        # the outer step went the way of the inner steps (the third moved the parameters on from `reached`, hence a
        # direction rather than values); with zeros it went nowhere: exactly back to the start
        moved = torch.cat([(now.detach() - begun).flatten() for begun, now in zip(start, params)])
        own = torch.cat([(r - begun).flatten() for begun, r in zip(start, reached)])
        assert torch.nn.functional.cosine_similarity(moved, own, dim=0) > 0.5
        assert moved.norm() > own.norm(), "Nesterov SGD at lr 0.7, momentum 0.9: 1.33x the pseudo-gradient"


def test_an_outer_round_scheduled_ahead_always_fits_its_timeout_and_a_refused_one_is_no_crash(tokenizer, caplog):
    # the round looked for ahead starts at the H-th inner step by the trainer's pace: a pace estimate of an hour a
    # step (inner steps that stalled) asked hivemind for a start beyond the round's timeout, which it asserts against
    # (both trainers exited 1). It starts at the latest time that fits instead; a round hivemind still refuses (a
    # wait longer than the timeout) is looked for when it begins, with one warning line
    from hivemind.utils import get_dht_time

    with diloco_with_an_absent_peer(tokenizer, "diloco-schedule-edge") as (model, optimizer, _):
        optimizer.round_began -= 3600.0
        seconds_per_step = 3600.0 / max(1, optimizer.inner_step)
        control = optimizer._schedule_round(2, (optimizer.inner_steps - optimizer.inner_step) * seconds_per_step)
        assert control is not None, "a start within the timeout was refused"
        try:
            assert get_dht_time() < control.scheduled_time < get_dht_time() + optimizer.averaging_timeout
        finally:
            control.cancel()
        optimizer.wait = optimizer.averaging_timeout + 10.0
        with caplog.at_level("WARNING", logger="sahajbert"):
            assert optimizer._schedule_round(2, 0.0) is None
        assert [r.getMessage() for r in caplog.records if "could not schedule the outer round ahead" in r.getMessage()]
        optimizer.wait = 0.0
        train_one_batch(model, optimizer)  # the H-th inner step: its round is scheduled, found nobody, and done
        assert optimizer.local_epoch == 1


def test_an_overlapped_outer_round_runs_behind_the_next_inner_steps_which_keep_their_progress(tokenizer):
    # --diloco_overlap: the round (here one that fails: the other peer never comes) runs while the trainer goes on;
    # its outer step then moves the model by as much as it moved the outer parameters, and what the model did since
    # the round was sent stays in it
    from sahajbert import hivemind_ext as compat
    from sahajbert.localswarm import wait_for

    with diloco_with_an_absent_peer(tokenizer, "diloco-overlap", overlap=True) as (model, optimizer, start):
        params = compat.master_parameters(optimizer)
        train_one_batch(model, optimizer)  # the third inner step: the round is sent and the step returns at once
        sent = [p.detach().clone() for p in params]
        assert optimizer.local_epoch == 0 and optimizer.inner_step == 0 and compat.has_pending_updates(optimizer)
        assert any(not torch.equal(a, b) for a, b in zip(start, sent)), "the model stays where the inner steps went"
        # the step is global (the trainer reads the swarm afresh) only when the next round is due, not while
        # this one runs although the swarm may look a step ahead
        assert not optimizer.step_would_be_global(4)
        wait_for(lambda: optimizer.scheduled_grads.done(), 60, "the round to fail")
        progress = [torch.randn_like(p) * 1e-3 for p in params]  # as if inner steps had moved the model
        with torch.no_grad():
            for p, d in zip(params, progress):
                p.add_(d)
        assert compat.apply_pending_updates(optimizer, 30)
        assert optimizer.local_epoch == 1 and not compat.has_pending_updates(optimizer)
        outer = [p for group in optimizer.opt.param_groups for p in group["params"]]
        for begun, reached, d, now, outer_now in zip(start, sent, progress, params, outer):
            # the outer step on the own pseudo-gradient (a failed round): 0.7 x 1.9 x (start - sent), as alone
            expected_outer = begun - 0.7 * 1.9 * (begun - reached)
            torch.testing.assert_close(outer_now.detach(), expected_outer, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(now.detach(), expected_outer + d, rtol=1e-4, atol=1e-6)


# seconds a round that the test ends itself (compat.cancel_round) may look for its group: far longer than the test
# takes to get there on any machine, so that the round is in flight exactly until the test calls it off
HELD_ROUND_TIMEOUT = 120.0


@contextlib.contextmanager
def attached(handler: logging.Handler, name: str):
    """`handler` on the logger `name`, which passes it records from handler.level on, while the body runs."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(handler.level)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class CallOffWhenAwaited(logging.Handler):
    """Calls the optimizer's round in flight off (a round that then fails) as soon as the trainer logs that it waits
    for it: the round ends when the trainer waits for it, never before. Notes each such wait."""

    def __init__(self, optimizer):
        super().__init__(logging.INFO)
        self.optimizer, self.awaited = optimizer, []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Outer round awaited"):
            self.awaited.append(record.getMessage())
            compat.cancel_round(self.optimizer.scheduled_grads)


def test_an_overlapping_diloco_trainer_goes_on_with_inner_steps_while_its_round_waits_for_a_slower_peer(tokenizer):
    # a round still in flight at the next H-th inner step (it waits for a slower peer) is not waited for: the inner
    # steps go on until it ends, at the latest the (H + H/10)-th (at least H + 1), and the next round, sent then,
    # carries them all. The round here ends (fails) only once the trainer waits for it.
    run = diloco_with_an_absent_peer(tokenizer, "diloco-go-on", overlap=True, averaging_timeout=HELD_ROUND_TIMEOUT)
    with run as (model, optimizer, _), attached(CallOffWhenAwaited(optimizer), "sahajbert.hivemind_ext") as waits:
        train_one_batch(model, optimizer)  # the 3rd inner step: the round is sent, and looks for the absent peer
        for _ in range(2):
            train_one_batch(model, optimizer)
        assert optimizer.round_in_flight, "the round still looks for the absent peer"
        assert not optimizer.step_would_be_global(4), "the H-th step starts no round while one is in flight"
        train_one_batch(model, optimizer)  # the H-th
        assert optimizer.round_in_flight and optimizer.local_epoch == 0 and optimizer.inner_step == 3, "it waited"
        assert waits.awaited == [], "the round is not waited for at the H-th step"
        train_one_batch(model, optimizer)  # the (H + 1)-th: it waits for the round to fail, then sends the next
        assert waits.awaited == ["Outer round awaited after 4 inner step(s) behind it"]
        assert optimizer.local_epoch == 1 and optimizer.round_in_flight and optimizer.inner_step == 0
        assert optimizer.scheduled_grads.weight == 4 * 4, "the round weighs the samples of its H + 1 inner steps"


def published_progress(dht, tracker) -> tuple[int, int] | None:
    """(step, samples) of the tracker's own progress record as the DHT holds it; None if it holds none."""
    found = dht.get(tracker.training_progress_key, latest=True)
    record = found.value.get(tracker._local_public_key) if found is not None else None
    return None if record is None else (record.value["epoch"], record.value["samples_accumulated"])


def test_a_round_called_off_is_called_off_once(tokenizer):
    # a round called off reads "looking for a group" until the averager's process has seen the cancel, and a second
    # StepControl.cancel raises InvalidStateError: a DiLoCo trainer's outer round called off at its last step was
    # called off again by the final parameter round's start, then by hivemind's shutdown (exit 1 in a CI run)
    from hivemind.averaging.control import AveragingStage
    from hivemind.utils import get_dht_time

    from sahajbert import hivemind_ext as compat
    from sahajbert.localswarm import wait_for
    from sahajbert.stopping import FINAL_GROUP_BITS

    model, optimizer, dht = lonely_diloco(tokenizer, "diloco-called-off")
    try:
        # as `_match_ahead` looks for the next outer round's group
        scheduled = optimizer.grad_averager.schedule_step(scheduled_time=get_dht_time() + 30, timeout=60)
        optimizer.scheduled_grads = scheduled
        wait_for(lambda: scheduled.stage == AveragingStage.LOOKING_FOR_GROUP, 30, "the round to look for its group")
        compat.cancel_round(scheduled)
        compat.cancel_round(scheduled)
        final = compat.start_parameter_round(optimizer, FINAL_GROUP_BITS, wait=0.5, timeout=3.0)
        assert scheduled.cancelled()
        wait_for(final.done, 30, "the final round to find nobody")
    finally:
        optimizer.shutdown()
        dht.shutdown()
    assert compat.round_steps(final) is None


class NotedStores:
    """hivemind's DHT, noting each store of the progress record `key` made through it: (time.monotonic(), value)."""

    def __init__(self, dht, key):
        self.dht, self.key, self.made = dht, key, []

    def __getattr__(self, name):
        return getattr(self.dht, name)

    def store(self, key, value, *args, **kwargs):
        if key == self.key:
            self.made.append((time.monotonic(), value))
        return self.dht.store(key, value, *args, **kwargs)


def test_a_diloco_trainer_publishes_its_progress_once_per_round_not_at_every_inner_step(tokenizer):
    # the swarm reads a DiLoCo trainer's step and presence from its progress record; its samples start nothing, and
    # a DHT store at every inner step was most of what a trainer sent on a slow link
    from sahajbert import hivemind_ext as compat
    from sahajbert.localswarm import wait_for

    model, optimizer, dht = lonely_diloco(tokenizer, "diloco-quiet")
    tracker = optimizer.tracker
    tracker.dht = stores = NotedStores(dht, tracker.training_progress_key)  # (its reporter stores through it)
    started = time.monotonic()  # (its reporter, started with it, has made no store: no samples yet)

    def reporter_idle():
        # a report that asks for a store sets this; the reporter clears it and makes the store in one go
        return not tracker.should_report_progress.is_set()

    try:
        train_one_batch(model, optimizer)  # a round's first inner step: published
        wait_for(lambda: published_progress(dht, tracker) == (0, 4), 30, "the round's first report")
        # between reports, progress is noted locally at most every NOTE_PERIOD seconds: one period on, it is
        wait_for(lambda: time.monotonic() - optimizer.noted_at >= compat.NOTE_PERIOD, 30, "a note period", 0.05)
        train_one_batch(model, optimizer)  # kept local
        assert tracker.local_progress.samples_accumulated == 8
        wait_for(reporter_idle, 30, "the reporter to take any report asked for", 0.01)
        train_one_batch(model, optimizer)  # the outer step (alone): the new step waits for the next inner step
        assert optimizer.local_epoch == 1
        wait_for(reporter_idle, 30, "the reporter to take any report asked for", 0.01)
        train_one_batch(model, optimizer)  # the first inner step at the new step: published, one store per round
        wait_for(lambda: published_progress(dht, tracker) == (1, 4), 30, "the new step's first report")
        made = list(stores.made)  # (the tracker's shutdown stores once more)
    finally:
        optimizer.shutdown()
        dht.shutdown()
    # the stores asked for: every one but the tracker's periodic report, which comes metadata_expiration / 2 seconds
    # after its store before (or its start) and sends what was noted
    period = tracker.metadata_expiration / 2
    asked = [
        (value["epoch"], value["samples_accumulated"])
        for (before, _), (when, value) in zip([(started, None)] + made, made)
        if when - before < 0.9 * period
    ]
    assert asked == [(0, 4), (1, 4)], [(when - started, v["epoch"], v["samples_accumulated"]) for when, v in made]


def test_a_diloco_trainer_publishes_the_runs_last_step_at_once(tokenizer):
    # no inner step follows the last outer step: the peers reading the swarm's step must see it from the epoch change
    from sahajbert.localswarm import wait_for

    model, optimizer, dht = lonely_diloco(tokenizer, "diloco-last", inner_steps=2, max_steps=1)
    tracker = optimizer.tracker
    try:
        for _ in range(2):
            train_one_batch(model, optimizer)
        assert optimizer.local_epoch == 1
        wait_for(lambda: published_progress(dht, tracker) == (1, 0), 30, "the last step's report")
    finally:
        optimizer.shutdown()
        dht.shutdown()


def test_a_diloco_trainer_reads_the_swarm_ahead_of_its_outer_round_and_does_not_wait_for_it(tokenizer):
    # the outer round starts on a fresh read of the swarm's progress (its peers, its step): asked for halfway
    # through the round, it is in by the H-th step, which then waits for no DHT read
    from sahajbert.localswarm import wait_for

    model, optimizer, dht = lonely_diloco(tokenizer, "diloco-read-ahead", inner_steps=4)
    try:
        for _ in range(2):
            train_one_batch(model, optimizer)
        assert optimizer.read_ahead_from is None, "the first round reads after the wait for the starting trainers"
        for _ in range(2):
            train_one_batch(model, optimizer)
        assert optimizer.local_epoch == 1
        train_one_batch(model, optimizer)
        assert optimizer.read_ahead_from is None, "not before halfway"
        train_one_batch(model, optimizer)
        assert optimizer.read_ahead_from is not None
        wait_for(lambda: optimizer.read_ahead_came_in, 30, "the read asked for halfway")
        assert optimizer.read_progress_now(timeout=0), "no wait: a read asked for now is not in at once"
        for _ in range(2):
            train_one_batch(model, optimizer)
        assert optimizer.local_epoch == 2 and optimizer.read_ahead_from is None, "a new round asks again"
        assert not optimizer.read_progress_now(timeout=0), "without a read ahead, the read is waited for"
    finally:
        optimizer.shutdown()
        dht.shutdown()


def test_an_overlapping_diloco_trainer_reads_ahead_while_its_last_round_is_still_in_flight(tokenizer):
    # with overlap, a round is often still in flight halfway through the next one: the read for the next outer round
    # is asked for then too, and the H-th step does not wait for it (asked only once the round had ended, it often
    # came in after the H-th step, which then waited for it)
    from sahajbert import hivemind_ext as compat
    from sahajbert.localswarm import wait_for

    run = diloco_with_an_absent_peer(
        tokenizer, "diloco-read-in-flight", overlap=True, averaging_timeout=HELD_ROUND_TIMEOUT
    )
    with run as (model, optimizer, _):
        train_one_batch(model, optimizer)  # the 3rd inner step: the first round is sent (nobody comes), and called off
        compat.cancel_round(optimizer.scheduled_grads)
        wait_for(lambda: optimizer.scheduled_grads.done(), 60, "the first round to fail")
        for _ in range(3):  # its outer step at the first, the second round sent at the third
            train_one_batch(model, optimizer)
        assert optimizer.local_epoch == 1 and optimizer.round_in_flight
        train_one_batch(model, optimizer)  # halfway (1 of 3)
        assert optimizer.round_in_flight, "the round is still looking for the absent peer"
        assert optimizer.read_ahead_from is not None, "the read is asked for while the round is in flight"
        wait_for(lambda: optimizer.read_ahead_came_in, 30, "the read asked for halfway")
        assert optimizer.read_progress_now(timeout=0), "no wait at the H-th step"


def test_an_overlapping_diloco_trainers_second_round_reads_ahead_at_step_0(tokenizer):
    # with overlap the second round is sent at step 0 too, while the first (the run's first global step) is in
    # flight: it reads ahead like every later round (and `round_in_flight`, which tells the trainer not to wait
    # for starting trainers again, holds)

    run = diloco_with_an_absent_peer(
        tokenizer, "diloco-read-second", overlap=True, averaging_timeout=HELD_ROUND_TIMEOUT
    )
    with run as (model, optimizer, _):
        assert optimizer.read_ahead_from is None, "the run's first round reads after the wait for starting trainers"
        assert not optimizer.round_in_flight
        train_one_batch(model, optimizer)  # the 3rd inner step: the first round is sent; it looks for the absent peer
        train_one_batch(model, optimizer)  # halfway (1 of 3) through the second round's inner steps
        assert optimizer.local_epoch == 0 and optimizer.round_in_flight, "the first is still in flight"
        assert optimizer.read_ahead_from is not None, "the second round's read is asked for at step 0"


class HeldReads:
    """hivemind's DHT, whose awaited reads (the tracker's fetcher's) each wait until the test lets one through: a read
    over a slow link."""

    def __init__(self, dht):
        self.dht, self.begun, self.gate = dht, 0, threading.Semaphore(0)

    def __getattr__(self, name):
        return getattr(self.dht, name)

    async def _held_get(self, *args, **kwargs):
        self.begun += 1
        await asyncio.get_running_loop().run_in_executor(None, self.gate.acquire)
        return await self.dht.get(*args, **kwargs)

    def get(self, *args, return_future: bool = False, **kwargs):
        if not return_future:  # not the tracker's fetcher: at once
            return self.dht.get(*args, **kwargs)
        return self._held_get(*args, return_future=True, **kwargs)


def test_a_step_change_does_not_wait_for_a_progress_read_and_the_read_it_overtook_is_made_again():
    # a progress read over a slow link held the tracker's lock throughout, and a step change (`pause_updates`) waited
    # it out; hivemind's optimizer checks its sync on the first read after a step change, which must begin after it
    # (an overtaken read is still taken in: a peer whose steps come faster than its reads would never take one)
    import hivemind

    from sahajbert import hivemind_ext as compat
    from sahajbert.localswarm import wait_for

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    reads = HeldReads(dht)
    # no periodic read: each read is one the test asked for
    periods = dict(min_refresh_period=600, max_refresh_period=600, default_refresh_period=600)
    tracker = compat.BoundedProgressTracker(dht=reads, prefix="held-read", target_batch_size=64, start=True, **periods)
    fetched = tracker.fetched_global_progress_this_epoch
    try:
        compat.request_progress_read(tracker)
        reads.gate.release()
        wait_for(fetched.is_set, 60, "the first read")
        begun = reads.begun
        compat.request_progress_read(tracker)
        wait_for(lambda: reads.begun == begun + 1, 60, "the next read to begin")
        assert tracker.lock_global_progress.acquire(timeout=30), "the step change waits for the read in flight"
        try:
            tracker.update_epoch(1)
        finally:
            tracker.lock_global_progress.release()
        overtaken = tracker.global_progress
        reads.gate.release()  # the read the step change overtook ends: taken in, but not as this step's read
        wait_for(lambda: reads.begun == begun + 2, 60, "the read made again")
        assert tracker.global_progress is not overtaken, "what it found (peers, their steps) is taken in"
        assert not fetched.is_set(), "the overtaken read counted as the read after the step change"
        reads.gate.release()
        wait_for(fetched.is_set, 60, "the read made again")
        assert tracker.global_progress.epoch == 1
    finally:
        for _ in range(10):
            reads.gate.release()
        tracker.shutdown()
        dht.shutdown()


def test_diloco_with_adamw_steps_as_torch_adamw_and_shares_its_state(tokenizer):
    # --diloco_inner_optimizer adamw: the inner steps are torch's AdamW on the trainer's parameter groups (with the
    # inner schedule and --max_grad_norm), and its moments are the tensors a newcomer downloads (extra_tensors)
    import copy

    from sahajbert.optim import parameter_groups

    model, optimizer, dht = lonely_diloco(tokenizer, "diloco-adamw", inner_optimizer="adamw")
    try:
        reference = copy.deepcopy(model)
        adamw = torch.optim.AdamW(parameter_groups(reference, 0.01), betas=(0.9, 0.999), eps=1e-6)
        for inner_step in range(2):
            train_one_batch(model, optimizer)
            reference(**seeded_batch(0)).loss.backward()  # train_one_batch's (its seed is the step, 0)
            torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 1.0)
            for group in adamw.param_groups:
                group["lr"] = optimizer.inner_lr(inner_step)
            adamw.step()
            adamw.zero_grad()
        assert optimizer.local_epoch == 0 and optimizer.inner_step == 2
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-7)
        shared = {id(t) for t in optimizer.state_averager.extra_tensors}
        for group in optimizer.inner.param_groups:
            for p in group["params"]:
                assert {id(optimizer.inner.state[p][name]) for name in ("step", "exp_avg", "exp_avg_sq")} <= shared
        assert float(optimizer.inner.state[p]["step"]) == 2
        train_one_batch(model, optimizer)  # the third inner step, then the outer one
        assert optimizer.local_epoch == 1 and optimizer.inner_step == 0
    finally:
        optimizer.shutdown()
        dht.shutdown()


def test_diloco_makes_an_outer_nesterov_step_after_its_inner_steps_and_checkpoints_both_states(tokenizer):
    model, optimizer, dht = lonely_diloco(tokenizer, "diloco-alone")
    other = None
    try:
        start = [p.detach().clone() for p in model.parameters()]
        for _ in range(2):
            train_one_batch(model, optimizer)
        assert optimizer.local_epoch == 0 and optimizer.inner_step == 2, "inner steps are local"
        assert any(not torch.equal(a, p) for a, p in zip(start, model.parameters())), "the inner LAMB stepped"
        before_outer = {}
        outer_step = optimizer._outer_step

        def outer_step_seen():  # the real outer step, with the parameters the inner steps reached kept first
            before_outer["parameters"] = [p.detach().clone() for p in model.parameters()]
            outer_step()

        optimizer._outer_step = outer_step_seen
        train_one_batch(model, optimizer)  # the third inner step, then the outer one
        assert optimizer.local_epoch == 1 and optimizer.inner_step == 0
        # alone in the swarm, the outer step applies its own pseudo-gradient d = start - reached: SGD with Nesterov
        # momentum 0.9 at lr 0.7 moves the parameters from the start by 0.7 x (1 + 0.9) x d on its first step
        for begun, reached, now in zip(start, before_outer["parameters"], model.parameters()):
            torch.testing.assert_close(now.detach(), begun - 0.7 * 1.9 * (begun - reached), rtol=1e-4, atol=1e-6)
        train_one_batch(model, optimizer)
        state = optimizer.state_dict()
        # a trainer resuming from this checkpoint: the same inner state and step, in the tensors its state averager
        # shares with newcomers (extra_tensors)
        _, other, other_dht = lonely_diloco(tokenizer, "diloco-resumed")
        other.load_state_dict(state)
        assert other.local_epoch == 1 and other.inner_step == 1
        shared = {id(t) for t in other.state_averager.extra_tensors}
        for mine, theirs in zip(optimizer.inner.param_groups, other.inner.param_groups):
            for p, q in zip(mine["params"], theirs["params"]):
                for name in ("step", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(optimizer.inner.state[p][name], other.inner.state[q][name]), name
                    assert id(other.inner.state[q][name]) in shared, f"{name} is no longer the shared tensor"
        assert float(other.inner.state[q]["step"]) == 4
    finally:
        optimizer.shutdown()
        dht.shutdown()
        if other is not None:
            other.shutdown()
            other_dht.shutdown()
