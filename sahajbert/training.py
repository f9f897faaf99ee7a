"""A volunteer's trainer peer: join the swarm, train on its own stream, take part in global steps, checkpoint."""

import copy
import hashlib
import json
import logging
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import hivemind
import torch
from accelerate import PartialState
from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time

from sahajbert import checkpoints, metrics
from sahajbert.cli import UserError
from sahajbert.collators import PretrainingCollator
from sahajbert.devices import autocast_dtype, choose_precision, describe_device
from sahajbert.model import build_model
from sahajbert.optim import build_collaborative_optimizer, is_finite
from sahajbert.stream import Prefetcher, batched, iterate_examples
from sahajbert.swarm import build_dht, validate_initial_peers
from sahajbert.tokenization import load_tokenizer

logger = logging.getLogger(__name__)
LOG_FILE = "train_log.jsonl"  # one JSON line per global step this peer saw: the run's history, for people and tests


class StopRequest:
    """SIGINT/SIGTERM ask the peer to stop after the current step; a second signal stops it at once."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous = {}

    def __enter__(self) -> "StopRequest":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        logger.info(f"received {signal.Signals(signum).name}: stopping after this step (send again to force)")
        self.event.set()

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __bool__(self) -> bool:
        return self.event.is_set()


class LastGoodState:
    """A host copy of parameters and optimizer state after the last healthy global step, to roll back to."""

    def __init__(self, optimizer: hivemind.Optimizer) -> None:
        self.optimizer = optimizer
        self.parameters: list[torch.Tensor] = []
        self.optimizer_state: dict | None = None

    def _tensors(self):
        averager = self.optimizer.state_averager
        offloaded = [p for group in averager.optimizer.param_groups for p in group["params"]]
        return averager.main_parameters, offloaded

    def parameters_finite(self) -> bool:
        main, offloaded = self._tensors()
        return is_finite(main) and is_finite(offloaded)

    @torch.no_grad()
    def save(self) -> None:
        main, _ = self._tensors()
        self.parameters = [p.detach().to("cpu", copy=True) for p in main]
        self.optimizer_state = copy.deepcopy(self.optimizer.opt.state_dict())

    @torch.no_grad()
    def restore(self) -> None:
        main, offloaded = self._tensors()
        for saved, target in zip(self.parameters, main):
            target.copy_(saved)
        if offloaded is not main:
            for saved, target in zip(self.parameters, offloaded):
                target.copy_(saved)
        self.optimizer.opt.load_state_dict(copy.deepcopy(self.optimizer_state))


def peer_seed(run_seed: int, public_key: bytes) -> int:
    """Each peer's data order: the run seed mixed with this peer's public key, so no two peers share a stream."""
    return (run_seed * 1_000_003 + int.from_bytes(hashlib.sha256(public_key).digest()[:4], "little")) % 2**31


@dataclass
class TrainResult:
    final_step: int
    steps: list[dict] = field(default_factory=list)  # the per-step records also written to train_log.jsonl
    checkpoint: Path | None = None


def train(swarm_args, averaging_args, optimizer_args, model_args, training_args, corpus_args) -> TrainResult:
    """Run one trainer peer until --max_steps, SIGINT or SIGTERM; always leaves the swarm cleanly."""
    validate_initial_peers(swarm_args.initial_peers)  # answer a typo at once, before loading anything
    tokenizer = load_tokenizer(corpus_args.tokenizer_path)
    device_info = describe_device(training_args.device)
    precision = choose_precision(device_info, training_args.precision)
    on_xla = device_info.kind == "tpu"
    # the host keeps the model hivemind averages; an XLA host computes on a device copy of it (sahajbert.xla)
    device = torch.device("cpu") if on_xla else PartialState(cpu=device_info.kind == "cpu").device
    forward_batch = training_args.per_device_train_batch_size * device_info.cores
    samples_per_pass = forward_batch * training_args.gradient_accumulation_steps
    logger.info(
        f"computing on {device_info.name} in {precision}; {samples_per_pass} samples per pass "
        f"({training_args.per_device_train_batch_size} per core x {device_info.cores} core(s) x "
        f"{training_args.gradient_accumulation_steps} accumulation)"
    )

    output_dir = Path(training_args.output_dir)
    resume_from = checkpoints.latest_checkpoint(output_dir)
    if resume_from is not None:
        logger.info(f"resuming from {resume_from}")
        checkpoints.read_state(resume_from)  # a broken checkpoint is reported now, before joining anything
    model = build_model(model_args.model, tokenizer, training_args.seed, resume_from).to(device)
    if training_args.gradient_checkpointing:
        if not model.supports_gradient_checkpointing:
            raise UserError("--gradient_checkpointing is not supported by this model")
        model.gradient_checkpointing_enable()
    model.train()

    validators, public_key = metrics.make_validators(swarm_args.run_id)
    dht = build_dht(swarm_args, validators)
    optimizer = None
    prefetcher = None
    try:
        optimizer = build_collaborative_optimizer(
            model, dht, swarm_args, averaging_args, optimizer_args, training_args, batch_size_per_step=samples_per_pass
        )
        if resume_from is not None:
            state = checkpoints.load_optimizer_state(resume_from)
            if state is not None:
                optimizer.load_state_dict(state)
                optimizer.state_averager._update_scheduler()  # the LR follows the restored global step
        state_missing = _catch_up_with_swarm(optimizer, dht, swarm_args.run_id)

        collator = PretrainingCollator.from_tokenizer(
            tokenizer,
            mlm_probability=corpus_args.mlm_probability,
            whole_word_masking=corpus_args.masking == "whole_word",
            # XLA compiles per shape: every batch is padded to the full length, so the step compiles once
            pad_to_multiple_of=corpus_args.max_seq_length if on_xla else corpus_args.pad_to_multiple_of,
            seed=peer_seed(training_args.seed, public_key),
        )
        examples = iterate_examples(corpus_args, tokenizer, seed=peer_seed(training_args.seed, public_key))
        prefetcher = Prefetcher(batched(examples, forward_batch, collator))
        if on_xla:
            from sahajbert.xla import SpmdReplica

            compute = SpmdReplica(model, autocast_dtype(precision))
        else:
            compute = LocalCompute(model, device, precision)
        with StopRequest() as stop:
            result = _training_loop(
                model,
                optimizer,
                compute,
                prefetcher,
                tokenizer,
                dht,
                public_key,
                samples_per_pass,
                state_missing,
                stop,
                swarm_args,
                averaging_args,
                training_args,
            )
        return result
    finally:
        if prefetcher is not None:
            prefetcher.close()
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()


def _catch_up_with_swarm(optimizer: hivemind.Optimizer, dht, run_id: str, timeout: float = 30.0) -> bool:
    """Download the swarm's state now if it is ahead (instead of on the first step, silently).

    Ahead means: trainers report a later global step, or an aux peer announces a state to rescue the run from.
    Returns True if the swarm is ahead and no peer could share its state, so the training loop retries.
    """
    optimizer.tracker.fetched_global_progress_this_epoch.wait(timeout)
    swarm_step = max(optimizer.tracker.global_epoch, metrics.fetch_announced_step(dht, run_id))
    if optimizer.local_epoch >= swarm_step:
        return False
    logger.info(f"the swarm is at step {swarm_step}: downloading its state from peers")
    if _download_state(optimizer):
        logger.info(f"joined at global step {optimizer.local_epoch}")
        return False
    logger.warning(
        f"no peer could share the swarm's state (client-mode peers cannot serve it): training from step "
        f"{optimizer.local_epoch} with this peer's own optimizer state and retrying after every global step"
    )
    return True


@torch.no_grad()
def _download_state(optimizer: hivemind.Optimizer) -> bool:
    """hivemind's load_state_from_peers, and whether it really brought a state.

    When no peer answers, hivemind still moves a peer that is one step behind to the swarm's step (to tolerate a
    lagging peer), and a newcomer would then train with its own fresh optimizer statistics. A state that arrived
    changes the parameters: the swarm is at least one step past this peer's.
    """
    before = [p.detach().clone() for p in optimizer.state_averager.main_parameters]
    optimizer.load_state_from_peers()
    return any(not torch.equal(a, p) for a, p in zip(before, optimizer.state_averager.main_parameters))


class LocalCompute:
    """The model computes where it lives (CPU or a CUDA GPU): its gradients are already where hivemind reads them.

    The same four calls as sahajbert.xla.SpmdReplica, which computes on a device copy instead.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, precision: str):
        self.model = model
        self.device = device
        dtype = autocast_dtype(precision)
        self.autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()
        # fp16 only: hivemind's scaler unscales before averaging and drops a step whose gradients overflowed
        self.scaler = hivemind.GradScaler() if precision == "fp16" else None

    def backward(self, batch: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        with self.autocast:
            loss = self.model(**batch).loss * scale
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return loss.detach()

    def finish_pass(self) -> None:
        pass

    def push_parameters(self) -> None:
        pass  # hivemind updates these very parameters in place

    def finish(self) -> None:
        pass  # nothing to bring up to date: there is no device copy


def _training_loop(
    model,
    optimizer,
    compute,
    batches,
    tokenizer,
    dht,
    public_key,
    samples_per_pass,
    state_missing,
    stop,
    swarm_args,
    averaging_args,
    training_args,
) -> TrainResult:
    output_dir = Path(training_args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    scaler = compute.scaler
    good_state = LastGoodState(optimizer)
    good_state.save()

    result = TrainResult(final_step=optimizer.local_epoch)
    # trainers that stop at --max_steps average their parameters once more (see _average_final_parameters)
    final_round = training_args.max_steps is not None and averaging_args.final_averaging_window > 0
    loss_sum, mini_steps, samples_this_step, skipped, contributed, compute_seconds = 0.0, 0, 0, 0, 0, 0.0
    last_epoch, last_log = optimizer.local_epoch, time.monotonic()
    with open(output_dir / LOG_FILE, "a") as log_file:
        while not stop and not _should_stop(optimizer, training_args.max_steps):
            compute_start = time.perf_counter()
            scale = 1.0 / training_args.gradient_accumulation_steps
            losses = [compute.backward(next(batches), scale) for _ in range(training_args.gradient_accumulation_steps)]
            compute.finish_pass()  # XLA: run the traced pass and bring its gradients to the host model
            pass_loss = sum(loss.item() for loss in losses)
            compute_seconds += time.perf_counter() - compute_start  # forward + backward only, for the step split
            # never send non-finite gradients to the swarm (with fp16, hivemind's GradScaler does this check)
            if scaler is None and not (
                is_finite([torch.tensor(pass_loss)]) and is_finite(p.grad for p in model.parameters())
            ):
                skipped += 1
                logger.warning(f"non-finite loss or gradients: this batch is dropped ({skipped} so far)")
                optimizer.zero_grad(set_to_none=True)
                continue
            if _should_stop(optimizer, training_args.max_steps):
                break  # the swarm got there during this pass, in a round without us: do not step alone
            # hivemind changes the host parameters in a step that starts a new epoch, and (with delayed updates) in
            # the first step after a background update was pending: only then does a device copy need them again
            updates_pending = bool(optimizer.state_averager.pending_updates)
            epoch_before = optimizer.local_epoch
            if final_round and _last_step_ahead(optimizer, training_args.max_steps):
                # the final round replaces this step's parameter averaging: a background round still pending would
                # hold this peer back from it, or pair with another peer's final round and be triggered late
                optimizer.average_state_every = NO_STATE_AVERAGING
            optimizer.step(batch_size=samples_per_pass, grad_scaler=scaler)
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.update()
            loss_sum, mini_steps, samples_this_step = (
                loss_sum + pass_loss,
                mini_steps + 1,
                samples_this_step + samples_per_pass,
            )

            if optimizer.local_epoch != last_epoch:
                if state_missing and _download_state(optimizer):
                    state_missing = False
                    logger.info(f"downloaded the swarm's state at global step {optimizer.local_epoch}")
                contributed += samples_this_step
                record = _finish_global_step(
                    optimizer,
                    good_state,
                    dht,
                    public_key,
                    swarm_args,
                    loss_sum,
                    mini_steps,
                    samples_this_step,
                    contributed,
                )
                record["compute_seconds"] = compute_seconds
                result.steps.append(record)
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
                if optimizer.local_epoch % training_args.save_steps == 0:
                    result.checkpoint = _save(model, tokenizer, optimizer, training_args, record)
                loss_sum, mini_steps, samples_this_step, compute_seconds = 0.0, 0, 0, 0.0
                last_epoch = optimizer.local_epoch
            if updates_pending or optimizer.local_epoch != epoch_before:
                compute.push_parameters()
            if time.monotonic() - last_log >= training_args.log_every_seconds:
                progress = optimizer.tracker.global_progress
                own_rate = optimizer.tracker.performance_ema.samples_per_second
                logger.info(
                    f"step {optimizer.local_epoch}: {progress.samples_accumulated}/{progress.target_batch_size} "
                    f"samples toward the next step from {progress.num_peers} peer(s); "
                    f"this peer {own_rate:.1f} samples/s"
                )
                last_log = time.monotonic()

    _apply_pending_updates(optimizer)  # a step or parameter round still running in the background
    averaged_at_end = False
    if final_round and not stop:
        last_step_peers = result.steps[-1]["peers"] if result.steps else 0
        averaged_at_end = _average_final_parameters(optimizer, averaging_args.final_averaging_window, last_step_peers)
    compute.finish()  # an XLA device copy ends with the final parameters too
    result.final_step = optimizer.local_epoch
    # always written again at the end: a background round may have changed the parameters after the last save
    if result.steps or averaged_at_end:
        last = result.steps[-1] if result.steps else {"loss": None}
        result.checkpoint = _save(model, tokenizer, optimizer, training_args, last)
    logger.info(f"stopped at global step {optimizer.local_epoch}" + (" (stop requested)" if stop else ""))
    return result


NO_STATE_AVERAGING = 2**62  # an average_state_every no global step number is a multiple of
FINAL_GROUP_BITS = "1"  # the final round's own matchmaking key: it never pairs with a peer's regular round


def _last_step_ahead(optimizer: hivemind.Optimizer, max_steps: int | None) -> bool:
    """The next global step is the swarm's last one (by the swarm's step, as hivemind numbers the next epoch)."""
    return max_steps is not None and max(optimizer.local_epoch + 1, optimizer.tracker.global_epoch) >= max_steps


def _should_stop(optimizer: hivemind.Optimizer, max_steps: int | None) -> bool:
    """The swarm reached --max_steps, and no gradient round this peer was matched into is waiting for it.

    When another peer's step takes the swarm to the last step while this one is still computing, both were grouped
    for that step's all-reduce in advance (hivemind pre-schedules it): this peer then makes that step too, or the
    group would wait for its part until next_chunk_timeout and the two would end one update apart. Without such a
    group, a step now would be a lonely one.
    """
    if not _swarm_reached(optimizer, max_steps):
        return False
    scheduled = optimizer.scheduled_grads
    return scheduled is None or scheduled.done() or scheduled.stage != AveragingStage.AWAITING_TRIGGER


def _average_final_parameters(optimizer: hivemind.Optimizer, window: float, last_step_peers: int) -> bool:
    """One last parameter average among the trainers that stop at --max_steps; True if it averaged with others.

    With delayed updates every peer applies the run's last update after its loop ends, and a peer that stopped
    without that update (or failed the last background rounds) would keep different parameters: the per-step
    parameter averaging that pulls peers together during a run has no next step here. hivemind's matchmaking makes the
    peer whose window ends first the leader and starts the all-reduce when it ends, so every peer that finishes
    within `window` seconds of the first joins one group. It matches under its own key, so it never pairs with a
    slower peer's regular round (one triggered late, after that peer's gradient round, gave the two peers different
    partial results), and the last global step makes no regular parameter round at all.

    Once started, the round always waits out its window. The progress tracker cannot tell whether another peer is
    still coming: hivemind stops reporting a peer that caught up by downloading the state at the last step, so its
    report expires while it waits in this very round (a netswarm run lost its final round that way, 6.3e-2 apart).
    """
    if max(optimizer.tracker.global_progress.num_peers, last_step_peers) < 2:
        return False  # alone now and at the last global step: nobody to agree with
    averager = optimizer.state_averager
    # a client-mode peer cannot lead a group, and a leader only takes followers whose own wait ends after its own:
    # a client waits twice the window, so that it can join a leader that arrives up to `window` after it
    wait = 2 * window if optimizer.client_mode else window
    timeout = wait + optimizer.averaging_timeout
    logger.info(f"averaging parameters with the peers that finish within {window:g} s, for a common final model")
    for scheduled in (optimizer.scheduled_state, optimizer.scheduled_grads):  # rounds this peer will not make
        if scheduled is not None and scheduled.stage == AveragingStage.LOOKING_FOR_GROUP:
            scheduled.cancel()
    averager.set_group_bits(FINAL_GROUP_BITS)
    control = averager.schedule_step(
        scheduled_time=get_dht_time() + wait, gather=optimizer.local_epoch, timeout=timeout
    )
    # the group ends with one set of parameters, so it ends under one step label too: the highest gathered (a peer
    # whose labels lag one behind the swarm's took part in the same rounds); hivemind also moves the LR schedule
    averager.sync_epoch_when_averaging = True
    averager.step(
        averaging_round=True, averaging_control=control, delay_averaging=True, averaging_opts={"timeout": timeout}
    )
    deadline = time.monotonic() + timeout + 5.0  # seconds: the round's own timeout ends it first
    while not control.done() and time.monotonic() < deadline:
        time.sleep(0.5)
    _apply_pending_updates(optimizer)
    if not control.done() or control.cancelled() or control.exception() is not None:
        logger.info("no other peer joined the final parameter round: this peer keeps those of its last round")
        return False
    steps = sorted(control.result().values())
    logger.info(f"final parameters averaged by {len(steps)} peers (their steps: {steps})")
    return True


def _swarm_reached(optimizer: hivemind.Optimizer, max_steps: int | None) -> bool:
    """Whether the SWARM is at --max_steps, not only this peer.

    A peer whose step labels lag one behind the others' (it joined or caught up while they stepped) would otherwise
    see the swarm ahead, step at once to catch up, find no one left to average with and make a last step alone.
    Stopping on the swarm's step ends it on the same all-reduce as the rest, under a label one lower.
    """
    if max_steps is None:
        return False
    return max(optimizer.local_epoch, optimizer.tracker.global_epoch) >= max_steps


def _finish_global_step(
    optimizer, good_state, dht, public_key, swarm_args, loss_sum, mini_steps, samples, contributed
) -> dict:
    """After the swarm's step: check parameters (roll back if broken), publish metrics, log one line."""
    if good_state.parameters_finite():
        good_state.save()
    else:
        logger.warning(
            f"parameters became non-finite at step {optimizer.local_epoch}: rolling back to the last good state"
        )
        # every round still running lands first: one that landed after the restore would bring the bad values back
        _apply_pending_updates(optimizer)
        good_state.restore()
    step = optimizer.local_epoch
    samples_per_second = float(optimizer.tracker.performance_ema.samples_per_second)
    mean_loss = loss_sum / max(1, mini_steps)
    if optimizer.is_synchronized_with_peers():
        record = metrics.LocalMetrics(
            step=step,
            samples_per_second=samples_per_second,
            samples_accumulated=samples,
            loss=float(loss_sum),
            mini_steps=mini_steps,
        )
        metrics.publish(dht, swarm_args.run_id, public_key, record)
    peers = optimizer.tracker.global_progress.num_peers
    logger.info(
        f"global step {step} | loss {mean_loss:.4f} | {samples_per_second:.1f} samples/s | {peers} peer(s) | "
        f"this peer contributed {contributed} samples so far"
    )
    return {
        "step": step,
        "loss": mean_loss,
        "mini_steps": mini_steps,
        "samples": samples,
        "peers": peers,
        "samples_per_second": samples_per_second,
        "time": time.time(),
    }


def _apply_pending_updates(optimizer: hivemind.Optimizer) -> None:
    """Wait for every background optimizer step and averaging round, and apply them to the parameters.

    hivemind's own wait gives each update at most the all-reduce timeout and then leaves it running: a checkpoint
    written right after could miss a round that lands a moment later. Retried up to twice the averaging timeout.
    """
    averager = optimizer.state_averager
    deadline = time.monotonic() + 2 * optimizer.averaging_timeout
    averager.step(wait_for_delayed_updates=True)
    while averager.pending_updates and time.monotonic() < deadline:
        averager.step(wait_for_delayed_updates=True)
    if averager.pending_updates:
        logger.warning("a background averaging round is still running: these parameters may miss its result")


def _save(model, tokenizer, optimizer, training_args, record) -> Path:
    _apply_pending_updates(optimizer)  # save parameters with every step applied
    return checkpoints.save_checkpoint(
        training_args.output_dir,
        optimizer.local_epoch,
        model,
        tokenizer,
        optimizer_state=optimizer.state_dict(),
        state={"loss": record["loss"]},
        keep=training_args.keep_checkpoints,
    )
