"""A volunteer's trainer peer: join the swarm, train on its own stream, take part in global steps, checkpoint.

`TrainerPeer` builds everything a peer needs (tokenizer, model, DHT, hivemind optimizer, compute backend, example
stream); `run()` is the training loop, read top to bottom; `train()` is the whole life of one peer.
"""

import copy
import hashlib
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import hivemind
import torch
from accelerate import PartialState

from sahajbert import adaptive, checkpoints, metrics
from sahajbert.arguments import PeerArguments
from sahajbert.cli import UserError
from sahajbert.collators import PretrainingCollator
from sahajbert.compute import build_compute
from sahajbert.devices import DeviceInfo, choose_precision, describe_device
from sahajbert.hivemind_ext.optim import accessors
from sahajbert.model import build_model
from sahajbert.optim import build_collaborative_optimizer, gradients_finite, is_finite
from sahajbert.signals import StopNow, StopRequest
from sahajbert.stopping import (
    FRESH_READ_TIMEOUT,
    FinalRound,
    joins_last_step,
    last_step_is_next,
    pending_update_timeout,
    settle,
    should_settle,
    should_stop,
)
from sahajbert.stream import Prefetcher, batched, iterate_examples
from sahajbert.swarm import SwarmPeer, validate_initial_peers
from sahajbert.tokenization import load_tokenizer
from sahajbert.train_log import StepRecord, TrainLog

logger = logging.getLogger(__name__)
# seconds a stopping peer waits for a background round to land before its last checkpoint (a stop is due within
# signals.FORCE_AFTER seconds)
STOP_PENDING_WAIT = 5.0
# matchmaking times a peer that would stop waits for its last gradient round to be matched or fail (the leader's
# matchmaking time counts from the leader's step, which came first)
SETTLE_MATCHMAKING_TIMES = 2
# dropped passes in a row, with finite parameters, that show the parameters themselves are unusable; an honest
# fp32 model's pass is rarely non-finite at all
DROPPED_PASSES_BEFORE_ROLLBACK = 3
# seconds between reads of the final round's declarations while a peer waits for its groupmates' (one DHT get each)
FINISHED_POLL_PERIOD = 0.5
# seconds a trainer that ended the run waits, beyond an aux peer's own refresh period, for that aux peer to have saved
# the final model (it downloads it from a trainer, at most a state download's time)
ARCHIVE_WAIT_MARGIN = 10.0
# seconds a trainer waits for its last metrics record (its end) to be stored before it leaves
LAST_RECORD_WAIT = 10.0
# a global step that the swarm's pace makes longer than this (seconds) is said once, with what to try instead
SLOW_STEP_SECONDS = 3600.0
SMALL_MODELS = ("tiny", "tiny-xl")
UNMEASURED_PACE = 1e-6  # samples/s below which the swarm's pace is not measured yet (a step would take 130 years)


@dataclass
class TrainResult:
    final_step: int
    steps: list[StepRecord] = field(default_factory=list)  # also written to train_log.jsonl
    checkpoint: Path | None = None


@dataclass
class StepCounters:
    """This peer's work toward the global step in progress; a new one starts after every global step."""

    loss_sum: float = 0.0  # summed over passes, each pass's loss the mean over its accumulated batches
    passes: int = 0
    samples: int = 0
    compute_seconds: float = 0.0  # forward and backward only
    optimizer_seconds: float = 0.0  # DiLoCo's inner optimizer steps


def train(peer_args: PeerArguments) -> TrainResult:
    """Run one trainer peer until --max_steps, SIGINT or SIGTERM; it always leaves the swarm cleanly."""
    with StopRequest("stopping after the current pass") as stop, TrainerPeer(peer_args) as peer:
        return peer.run(stop)


def peer_seed(run_seed: int, public_key: bytes) -> int:
    """Each peer's data order: the run seed mixed with this peer's public key, so no two peers share a stream."""
    return (run_seed * 1_000_003 + int.from_bytes(hashlib.sha256(public_key).digest()[:4], "little")) % 2**31


def parameters_digest(parameters: list[torch.Tensor]) -> str:
    """A digest of parameters' exact values (fp32 bytes, in order): equal digests, equal starting points."""
    digest = hashlib.sha256()
    for tensor in parameters:
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:32]


def slow_pace_warning(position: accessors.SwarmPosition, model: str, device_kind: str) -> str | None:
    """What to tell a user whose swarm, at its present pace, takes over SLOW_STEP_SECONDS per global step."""
    remaining = position.target_batch_size - position.samples_accumulated
    if position.seconds_to_next_step is None or position.seconds_to_next_step <= 0 or remaining <= 0:
        return None
    samples_per_second = remaining / position.seconds_to_next_step
    if samples_per_second < UNMEASURED_PACE:  # hivemind's estimate before any peer measured its pace (1e-20)
        return None
    step_seconds = position.target_batch_size / samples_per_second
    if step_seconds < SLOW_STEP_SECONDS:
        return None
    hint = (
        f"; the {model} model on a CPU is for real runs on many peers: to try things out, use --model tiny"
        if device_kind == "cpu" and model not in SMALL_MODELS
        else ": more peers, or a smaller --target_batch_size, make steps shorter"
    )
    return (
        f"at the swarm's pace ({samples_per_second:.2f} samples/s), a global step of {position.target_batch_size} "
        f"samples takes about {step_seconds / 3600:.1f} h{hint}"
    )


def start_priority(unix_time: float) -> float:
    """A state priority in (0, 0.5] at step 0 that is higher the earlier a peer started (hivemind sets the
    priority to the global step at every step after it, so it only orders peers of a new run). 2^24 s cycle:
    resolution below a millisecond next to step numbers up to 10^6 in a float64."""
    return 0.5 * (1 - (unix_time % 2**24) / 2**24)


class TrainerPeer(SwarmPeer):
    """One trainer in the swarm; use as a context manager, so that it always leaves the swarm."""

    def __init__(self, peer_args: PeerArguments):
        self.args = peer_args
        swarm_args, training_args = peer_args.swarm_args, peer_args.training_args
        validate_initial_peers(swarm_args.initial_peers)  # answer a typo at once, before loading anything
        self.tokenizer = load_tokenizer(peer_args.corpus_args.tokenizer_path)
        device_info = describe_device(training_args.device)
        self.device_kind = device_info.kind
        precision = choose_precision(device_info, training_args.precision)
        if peer_args.optimizer_args.diloco_inner_steps and precision == "fp16" and training_args.precision == "auto":
            precision = "fp32"
        if peer_args.optimizer_args.diloco_inner_steps and precision == "fp16":
            raise UserError(
                "--diloco_inner_steps steps its inner optimizer without hivemind's fp16 gradient scaler: "
                "use --precision bf16 or fp32"
            )
        forward_batch = training_args.per_device_train_batch_size * device_info.cores
        self.samples_per_pass = forward_batch * training_args.gradient_accumulation_steps
        logger.info(
            f"computing on {device_info.name} in {precision}; {self.samples_per_pass} samples per pass "
            f"({training_args.per_device_train_batch_size} per core x {device_info.cores} core(s) x "
            f"{training_args.gradient_accumulation_steps} accumulation)"
        )
        self.output_dir = Path(training_args.output_dir)
        resume_from = checkpoints.latest_checkpoint(self.output_dir)
        self.model = self._build_model(resume_from, device_info)
        self.model_parameters = list(self.model.parameters())  # checked at every pass: listed once

        self._join(swarm_args)
        self.batches: Prefetcher | None = None
        try:
            parameters = sum(p.numel() for p in self.model.parameters())
            self.timing, self.link, self.link_watch = adaptive.tune(peer_args, self.dht, parameters)
            self.rounds = adaptive.RoundMonitor(swarm_args.verbose).attach()
            self.optimizer = build_collaborative_optimizer(
                self.model,
                self.dht,
                peer_args,
                batch_size_per_step=self.samples_per_pass,
                timing=self.timing,
                gate=self.gate,
            )
            # at step 0, the peer that started first is every newcomer's donor: all start from its parameters
            self.start_priority = start_priority(time.time())
            accessors.set_state_priority(self.optimizer, self.start_priority)
            if resume_from is not None:
                self._restore_optimizer(resume_from)
            self.state_missing = self._catch_up_with_swarm()
            self.compute = build_compute(self.model, device_info, precision)
            self.batches = self._build_stream(forward_batch, on_xla=device_info.kind == "tpu")
        except BaseException:
            self.leave()
            raise

        self.good_state = LastGoodState(self.optimizer, pending_update_timeout=self._pending_update_timeout)
        self.train_log = TrainLog(self.output_dir)
        # trainers that stop at --max_steps average their parameters once more (sahajbert.stopping.FinalRound)
        timing = self.timing
        self.final_round = (
            FinalRound(timing.final_averaging_window, self.dht.client_mode, timing.averaging_timeout)
            if training_args.max_steps is not None and timing.final_averaging_window > 0
            else None
        )
        # the progress refresh follows the global step's time, unless --max_refresh_period was given
        self.refresh_ceiling = peer_args.optimizer_args.max_refresh_period
        self._last_step_time = None
        self.counters = StepCounters()
        self.last_step = self.optimizer.local_epoch  # the global step of the last record
        self.contributed = 0  # samples this peer contributed to global steps, since it started
        self.recent_steps: deque[metrics.StepEntry] = deque(maxlen=metrics.RECENT_STEPS)  # published with each record
        self.dropped_passes = 0
        self.result = TrainResult(final_step=self.optimizer.local_epoch)
        self._last_progress_line = time.monotonic()
        self._pace_told = False
        self.stop: StopRequest | None = None  # set by run()

    def _build_model(self, resume_from: Path | None, device_info: DeviceInfo) -> torch.nn.Module:
        """The model from this peer's latest checkpoint, else freshly initialized with the run's seed."""
        training_args = self.args.training_args
        if resume_from is not None:
            logger.info(f"resuming from {resume_from}")
            checkpoints.read_state(resume_from)  # a broken checkpoint is reported now, before joining anything
        model = build_model(self.args.model_args.model, self.tokenizer, training_args.seed, resume_from)
        parameters = sum(p.numel() for p in model.parameters())
        logger.info(f"model: {type(model).__name__}, {parameters / 1e6:.1f}M parameters")
        # the host keeps the model hivemind averages; an XLA host computes on a device copy of it (sahajbert.xla)
        on_xla = device_info.kind == "tpu"
        model.to("cpu" if on_xla else PartialState(cpu=device_info.kind == "cpu").device)
        if training_args.gradient_checkpointing:
            if not model.supports_gradient_checkpointing:
                raise UserError("--gradient_checkpointing is not supported by this model")
            model.gradient_checkpointing_enable()
        return model.train()

    def _build_stream(self, forward_batch: int, on_xla: bool) -> Prefetcher:
        """This peer's endless stream of collated batches, in its own order (its seed mixes in its public key)."""
        corpus_args = self.args.corpus_args
        seed = peer_seed(self.args.training_args.seed, self.public_key)
        collator = PretrainingCollator.from_tokenizer(
            self.tokenizer,
            mlm_probability=corpus_args.mlm_probability,
            whole_word_masking=corpus_args.masking == "whole_word",
            # XLA compiles per shape: every batch is padded to the full length, so the step compiles once
            pad_to_multiple_of=corpus_args.max_seq_length if on_xla else corpus_args.pad_to_multiple_of,
            seed=seed,
        )
        examples = iterate_examples(corpus_args, self.tokenizer, seed=seed)
        return Prefetcher(batched(examples, forward_batch, collator))

    def close(self) -> None:
        """Stop the stream, then leave the swarm."""
        if self.batches is not None:
            self.batches.close()
        super().close()
        if getattr(self, "rounds", None) is not None:
            self.rounds.detach()

    # ---- the training loop ----

    def run(self, stop: StopRequest) -> TrainResult:
        """Train until the swarm reaches --max_steps or a stop is requested, then end the run with the others."""
        self.good_state.save()
        self.stop = stop
        try:
            # an invite the organizer no longer renews ends this peer's part: checkpoint, then leave with one line
            # where things stood after this peer's last step: another peer's step seen since then, taking the swarm to
            # the last step, may have counted this peer's samples and waits for its part (stopping.joins_last_step)
            after_step = accessors.position(self.optimizer)
            while not (stop or self._should_stop(after_step) or self.access_lost):
                pass_loss = self._forward_backward()
                if pass_loss is None:
                    continue  # non-finite loss or gradients: this pass was dropped, nothing was sent
                if self._should_stop(after_step):
                    break  # the swarm got there in a round without us: do not step alone
                host_changed = self._step(pass_loss)
                after_step = accessors.position(self.optimizer)
                if self.optimizer.local_epoch != self.last_step:
                    self._after_global_step()
                    host_changed = True
                if host_changed:
                    self.compute.push_parameters()
                self._log_progress()
                self._watch_link()
        except StopNow:
            pass  # stopped while waiting for the stream's next batch
        result = self._finish(stopped=bool(stop) or self.access_lost)
        self.check_access()
        return result

    def _should_stop(self, after_step: accessors.SwarmPosition) -> bool:
        """Whether to stop now; `after_step`: where things stood after this peer's last step (or its start)."""
        max_steps = self.args.training_args.max_steps
        position = accessors.position(self.optimizer)
        in_background = accessors.gradient_rounds_in_background(self.optimizer)
        if joins_last_step(after_step, position, max_steps, in_background):
            return False
        if should_settle(position, max_steps):
            timeout = SETTLE_MATCHMAKING_TIMES * self.timing.matchmaking_time
            accessors.settle_gradient_round(self.optimizer, timeout, interrupted=lambda: bool(self.stop))
            position = accessors.position(self.optimizer)  # settling changed the round's stage
        return should_stop(position, max_steps)

    def _forward_backward(self) -> float | None:
        """One pass (gradient accumulation included); its loss, or None if it was dropped as non-finite."""
        accumulation = self.args.training_args.gradient_accumulation_steps
        started = time.perf_counter()
        losses = [self.compute.backward(self.batches.get(self.stop), 1.0 / accumulation) for _ in range(accumulation)]
        self.compute.finish_pass()  # XLA: run the traced pass and bring its gradients to the host model
        pass_loss = sum(loss.item() for loss in losses)
        self.counters.compute_seconds += time.perf_counter() - started
        # never send non-finite gradients to the swarm (with fp16, hivemind's GradScaler does this check)
        if self.compute.scaler is None and not (
            math.isfinite(pass_loss) and gradients_finite(p.grad for p in self.model_parameters)
        ):
            self.dropped_passes += 1
            self.optimizer.zero_grad(set_to_none=True)
            # parameters that went bad (a background round, or a peer's state) make every further batch dropped, and
            # no global step would come to roll back after: they are restored now
            if self.good_state.after_dropped_pass():
                self.compute.push_parameters()
            else:
                logger.warning(f"non-finite loss or gradients: this batch is dropped ({self.dropped_passes} so far)")
            return None
        self.good_state.after_finite_pass()
        training_args = self.args.training_args
        if training_args.clip_gradients == "local" and training_args.max_grad_norm:
            # each peer's own pass, before the swarm averages it (as DeDLOC's trainer clipped through the HF Trainer);
            # with fp16 the gradients are unscaled first, so that the norm is the true one
            if self.compute.scaler is not None:
                self.compute.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), training_args.max_grad_norm)
        return pass_loss

    def _step(self, pass_loss: float) -> bool:
        """Hand the pass to hivemind, which steps when the swarm's batch is full; True if the parameters changed."""
        # hivemind changes the host parameters in a step that starts a new global step and, with delayed updates,
        # in the first step after a background update was pending: only then does a device copy need them again
        updates_pending = accessors.has_pending_updates(self.optimizer)
        step_before = self.optimizer.local_epoch
        if self.final_round is not None and last_step_is_next(
            accessors.position(self.optimizer), self.args.training_args.max_steps
        ):
            # the final round replaces this step's parameter averaging: a background round still pending would
            # hold this peer back from it, or pair with another peer's final round and be triggered late
            accessors.skip_parameter_averaging(self.optimizer)
        if accessors.step_would_be_global(self.optimizer, self.samples_per_pass):
            # (with DiLoCo's overlap the second round is sent at step 0 too, while the first is in flight: the wait,
            # and its two blocking DHT reads, came before the first)
            if self.optimizer.local_epoch == 0 and not accessors.outer_round_in_flight(self.optimizer):
                self._wait_for_starting_trainers()
            # hivemind's view of the swarm may be seconds old (peers that joined since, samples they reported):
            # a global step is only started on a fresh read, so that no peer steps alone on a stale count
            accessors.read_progress_now(self.optimizer, FRESH_READ_TIMEOUT)
        scaler = self.compute.scaler
        started = time.time()
        self.optimizer.step(batch_size=self.samples_per_pass, grad_scaler=scaler)
        if self.optimizer.local_epoch != step_before:
            self.rounds.gradient_round_started(started)
        self.optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.update()
        self.counters.loss_sum += pass_loss
        self.counters.passes += 1
        self.counters.samples += self.samples_per_pass
        self.counters.optimizer_seconds += accessors.take_inner_step_seconds(self.optimizer)
        # DiLoCo's inner optimizer changes them at every step
        local_step = accessors.inner_round(self.optimizer) is not None
        return local_step or updates_pending or self.optimizer.local_epoch != step_before

    def _after_global_step(self) -> None:
        """The swarm made a global step: check the parameters, publish this peer's metrics, log, checkpoint."""
        if self.state_missing and self._download_state():
            self.state_missing = False
            logger.info(f"downloaded the swarm's state at global step {self.optimizer.local_epoch}")
        self.good_state.keep_or_roll_back()
        record = self._record_step()
        self.result.steps.append(record)
        self.train_log.append(record)
        if record.step % self.args.training_args.save_steps == 0:
            self._save(record.loss)
        self._follow_step_time()
        self.counters = StepCounters()
        self.last_step = self.optimizer.local_epoch

    def _watch_link(self) -> None:
        """Now and then, measure the link again and declare the new bandwidth (started only while no background
        round is pending, so that the probe does not compete with one)."""
        watch = self.link_watch
        if watch is None:
            return
        link = watch.finished()
        if link is not None:
            accessors.set_bandwidth(self.optimizer, round(link.bandwidth_mbit, 1))
            self.timing = replace(self.timing, bandwidth=round(link.bandwidth_mbit, 1))
            logger.info(f"link measured again: {link.upload_mbit:.1f} Mbit/s up, {link.download_mbit:.1f} down")
        elif watch.due() and not accessors.has_pending_updates(self.optimizer):
            watch.start()

    def _follow_step_time(self) -> None:
        """Read the swarm's progress 5 times per global step (DiLoCo: every 3rd), by the time the last one took."""
        now = time.monotonic()
        if self.refresh_ceiling is None and self._last_step_time is not None:
            seconds = now - self._last_step_time
            reads = adaptive.DILOCO_READS_PER_STEP if accessors.inner_round(self.optimizer) is not None else 5
            period = adaptive.refresh_period_for(seconds, adaptive.REFRESH_BOUNDS[1], reads)
            accessors.set_refresh_period(self.optimizer, period)
        self._last_step_time = now

    def _record_step(self) -> StepRecord:
        """This peer's record of the global step just made; published to the swarm and logged in one line."""
        counters, step = self.counters, self.optimizer.local_epoch
        self.contributed += counters.samples
        samples_per_second = accessors.own_samples_per_second(self.optimizer)
        if self.optimizer.is_synchronized_with_peers():  # a peer that is behind would report a stale step
            entry = metrics.StepEntry(
                step=step,
                loss=float(counters.loss_sum),
                mini_steps=counters.passes,
                samples=counters.samples,
                samples_per_second=samples_per_second,
            )
            self.recent_steps.append(entry)
            self._publish_metrics("training")
        record = StepRecord(
            step=step,
            loss=counters.loss_sum / max(1, counters.passes),
            mini_steps=counters.passes,
            samples=counters.samples,
            peers=accessors.position(self.optimizer).peers,
            samples_per_second=samples_per_second,
            time=time.time(),
            compute_seconds=counters.compute_seconds,
            optimizer_seconds=counters.optimizer_seconds,
            failed_rounds=self.rounds.failed_rounds,
            round_seconds=self.rounds.round_seconds[-1] if self.rounds.round_seconds else None,
            bandwidth_mbit=self.timing.bandwidth,
        )
        logger.info(
            f"global step {step} | loss {record.loss:.4f} | {samples_per_second:.1f} samples/s | "
            f"{record.peers} peer(s) | this peer contributed {self.contributed} samples so far"
        )
        return record

    def _publish_metrics(self, status: str):
        """This peer's record for the monitors: its last step, its last steps, its samples so far and its status."""
        last = self.recent_steps[-1] if self.recent_steps else None
        local = metrics.LocalMetrics(
            step=last.step if last else self.optimizer.local_epoch,
            samples_per_second=last.samples_per_second if last else 0.0,
            samples_accumulated=last.samples if last else 0,
            loss=last.loss if last else 0.0,
            mini_steps=last.mini_steps if last else 0,
            peer_id=self.dht.peer_id.to_base58(),
            samples_contributed=self.contributed,
            recent=list(self.recent_steps),
            status=status,
        )
        return metrics.publish(self.dht, self.args.swarm_args.run_id, self.public_key, local)

    def _log_progress(self) -> None:
        """Every --log_every_seconds: the swarm's progress toward the next global step."""
        if time.monotonic() - self._last_progress_line < self.args.training_args.log_every_seconds:
            return
        position = accessors.position(self.optimizer)
        inner = accessors.inner_round(self.optimizer)
        toward = (
            f"{position.samples_accumulated}/{position.target_batch_size} samples toward the next step"
            if inner is None
            else f"inner step {inner[0]}/{inner[1]} toward the next outer step"
        )
        logger.info(
            f"step {position.local_step}: {toward} from {position.peers} peer(s); "
            f"this peer {accessors.own_samples_per_second(self.optimizer):.1f} samples/s"
        )
        self._last_progress_line = time.monotonic()
        warning = (
            None
            if inner is not None or self._pace_told
            else slow_pace_warning(position, self.args.model_args.model, self.device_kind)
        )
        if warning:
            logger.warning(warning)
            self._pace_told = True

    def _finish(self, stopped: bool) -> TrainResult:
        """Apply what still runs in the background, take part in the final round, write the final checkpoint."""
        pending_wait = STOP_PENDING_WAIT if stopped else self._pending_update_timeout
        self._apply_pending_updates(pending_wait)
        if self.final_round is not None and not stopped:
            recent_peers = FinalRound.recent_peers([record.peers for record in self.result.steps])
            self.final_round.run(self.optimizer, recent_peers)
            self._end_together(self.final_round.group, self.final_round.complete)
        self.compute.finish()  # an XLA device copy ends with the final parameters too
        self.result.final_step = self.optimizer.local_epoch
        # always written at the end, also before this peer's first global step (a restart then resumes from the state
        # it started from or downloaded, not from scratch), and again after the last save: a background round may
        # have changed the parameters since
        self._save(self.result.steps[-1].loss if self.result.steps else None, pending_wait, final=True)
        last_record = self._publish_metrics("stopped" if stopped else "finished")
        if self.final_round is not None and not stopped and not self.dht.client_mode:
            self._wait_for_archive(self.optimizer.local_epoch)
        try:
            last_record.result(timeout=LAST_RECORD_WAIT)
        except Exception as e:  # the monitors then see this peer depart instead: worth a line, not a failure
            logger.info(f"could not store this peer's last record for the monitors: {type(e).__name__}")
        logger.info(f"stopped at global step {self.optimizer.local_epoch}" + (" (stop requested)" if stopped else ""))
        return self.result

    def _end_together(self, group: set[str], complete: bool) -> None:
        """Declare that this peer's final round ended (and whether all its parts came back), then stay up until the
        other peers of its `group` (base58 peer ids, this one's included) have declared the same, at most one round
        timeout. A round ends here once this peer's own averaged parts have arrived, while the parts it averaged for
        slower groupmates may still be on their way; had its process (and p2p daemon) exited then, a groupmate on a
        slow link ended with partial results (a 5 Mbit/s trainer in a CI run: 79% of them, and final parameters
        0.023 apart).

        If a part came back partial to any peer, the peers settle on one peer's parameters (`stopping.settle`): the
        others download its state, and it stays up serving it until they declare they have it, at most one state
        download. Two trainers behind NAT in a CI run each got only their own parts back (the streams between them
        through the relay stalled) and ended 0.0024 apart. Only the records of the round's peers count, less any
        peer this one has left out (a peer caught returning implausible averages could name itself the source)."""
        run_id, step = self.args.swarm_args.run_id, self.optimizer.local_epoch
        own = metrics.FinishedRecord(
            step=step, peer_id=self.dht.peer_id.to_base58(), complete=complete, serves_state=not self.dht.client_mode
        )
        metrics.declare_finished(self.dht, run_id, self.public_key, own)
        if len(group) < 2:
            return
        groupmates = group - accessors.left_out_peers(self.optimizer)
        records = self._await_final_records(
            groupmates,
            lambda records: len(records) >= len(groupmates),
            self.timing.averaging_timeout,
            "not every peer of the final round said its round ended: leaving anyway",
        )
        settlement = settle(records)
        if own.peer_id in settlement.takers:
            if accessors.take_state_of(self.optimizer, settlement.source, step, self.timing.load_state_timeout):
                logger.info(
                    f"a part of the final round came back partial: this peer took the parameters of peer "
                    f"{settlement.source}, for one final model"
                )
                metrics.declare_finished(self.dht, run_id, self.public_key, own.copy(update={"adopted": True}))
            else:
                logger.warning(f"could not download the final parameters of peer {settlement.source}: keeping its own")
        elif own.peer_id == settlement.source and settlement.takers:
            logger.info("a part of the final round came back partial: serving this peer's parameters to the others")
            self._await_final_records(
                groupmates,
                lambda records: settlement.takers <= {record.peer_id for record in records if record.adopted},
                self.timing.load_state_timeout,
                "not every peer took this peer's final parameters: leaving anyway",
            )

    def _wait_for_archive(self, step: int) -> None:
        """If an aux peer saves the run's final model, stay up (serving this peer's state) until it has saved the model
        of `step`, at most a state download's time after its next look."""
        run_id = self.args.swarm_args.run_id
        archives = metrics.fetch_archives(self.dht, run_id)
        if not archives:
            return
        deadline = time.monotonic() + self.timing.load_state_timeout + max(a.refresh_period for a in archives)
        deadline += ARCHIVE_WAIT_MARGIN
        logger.info(f"waiting for the aux peer to save the final model of step {step}")
        while not any(archive.step >= step for archive in metrics.fetch_archives(self.dht, run_id)):
            if time.monotonic() >= deadline:
                logger.info("the aux peer did not say it saved the final model: leaving anyway")
                return
            time.sleep(FINISHED_POLL_PERIOD)

    def _await_final_records(
        self, peers: set[str], done, timeout: float, giving_up: str
    ) -> list[metrics.FinishedRecord]:
        """Poll the final round's declarations of `peers` at this peer's step until `done(records)`, at most
        `timeout` seconds (then log `giving_up`); the records last read."""
        run_id, step = self.args.swarm_args.run_id, self.optimizer.local_epoch
        deadline = time.monotonic() + timeout

        def read() -> list[metrics.FinishedRecord]:
            return [record for record in metrics.fetch_finished(self.dht, run_id, step) if record.peer_id in peers]

        while not done(records := read()):
            if time.monotonic() >= deadline:
                logger.info(giving_up)
                break
            time.sleep(FINISHED_POLL_PERIOD)
        return records

    # ---- joining, state and checkpoints ----

    def _restore_optimizer(self, checkpoint: Path) -> None:
        state = checkpoints.load_optimizer_state(checkpoint)
        if state is not None:
            self.optimizer.load_state_dict(state)
            accessors.follow_schedule(self.optimizer)  # the LR follows the restored global step

    def _catch_up_with_swarm(self, timeout: float = 30.0) -> bool:
        """Download the swarm's state now if it is ahead (instead of on the first step, silently).

        Ahead means: trainers report a later global step, or an aux peer announces a state to rescue the run from.
        Returns True if the swarm is ahead and no peer could share its state, so that the loop retries.
        """
        accessors.wait_for_swarm_progress(self.optimizer, timeout)
        swarm_step = max(
            accessors.position(self.optimizer).swarm_step,
            metrics.fetch_announced_step(self.dht, self.args.swarm_args.run_id),
        )
        if self.optimizer.local_epoch >= swarm_step and self._check_unbacked_claim():
            return False
        if self.optimizer.local_epoch == swarm_step == 0:
            self._start_from_first_peer()
            return False
        if self.optimizer.local_epoch >= swarm_step:
            return False
        logger.info(f"the swarm is at step {swarm_step}: downloading its state from peers")
        if self._download_state():
            logger.info(f"joined at global step {self.optimizer.local_epoch}")
            return False
        logger.warning(
            f"no peer could share the swarm's state (client-mode peers cannot serve it): training from step "
            f"{self.optimizer.local_epoch} with this peer's own optimizer state and retrying after every global step"
        )
        return True

    def _check_unbacked_claim(self) -> bool:
        """A peer alone in the run's records at a later step (a trainer that ran alone before this one came, or a
        peer that only claims to be there): ask that peer for its state, checked as any download is. Taken, this
        peer joins at its step (True), and its claims count from then on; else this peer trains on where it is."""
        claims = accessors.unbacked_claims(self.optimizer)
        if not claims:
            return False
        peer, step = max(claims.items(), key=lambda claim: claim[1])
        max_steps = self.args.training_args.max_steps
        if max_steps is not None and step >= max_steps:
            logger.warning(
                f"peer {peer} alone claims global step {step}, at or past this run's last ({max_steps}): a run's end "
                f"is never taken from one peer; training on from step {self.optimizer.local_epoch}"
            )
            return False
        # one step more than claimed: a trainer alone may have stepped since the claim was read
        if accessors.take_state_of(self.optimizer, peer, step + 1, self.timing.load_state_timeout):
            accessors.state_taken(self.optimizer)
            logger.info(f"joined at global step {self.optimizer.local_epoch}, from the state of peer {peer}")
            return True
        logger.warning(
            f"peer {peer} alone claims global step {step}, and its state was not usable: training on from step "
            f"{self.optimizer.local_epoch} with the peers this one can check"
        )
        return False

    def _wait_for_starting_trainers(self) -> None:
        """Before a new run's first global step: trainers that started with this one but still download its
        parameters would otherwise find the run ended or far ahead; wait for them, within the join wait."""
        deadline = time.monotonic() + self.timing.join_wait
        logged = False
        while not self.stop and time.monotonic() < deadline:
            starting = accessors.starting_peers(self.optimizer)
            if not starting:
                return
            if not logged:
                logger.info(
                    f"waiting up to {self.timing.join_wait:.0f} s for {len(starting)} trainer(s) still starting, "
                    "before the run's first global step"
                )
                logged = True
            time.sleep(1.0)

    def _start_from_first_peer(self) -> None:
        """A new run: every trainer starts from the parameters of the one that started first (the highest state
        priority at step 0), so that trainers with different --seed values train one model, not two. A trainer
        whose own parameters are the first one's (the same --seed, the default) has nothing to download: at the
        real model sizes that download takes minutes on a volunteer's link (56.9 MB for sahajBERT's preset)."""
        run_id = self.args.swarm_args.run_id
        own_digest = parameters_digest(accessors.master_parameters(self.optimizer))
        if not metrics.declare_start(self.dht, run_id, self.public_key, self.dht.peer_id.to_base58(), own_digest):
            logger.warning("could not declare this trainer's initial parameters: trainers after it will download them")
        # the others' declarations reach the DHT within a few round trips of their start
        round_trip = self.link.round_trip_s if self.link is not None else adaptive.FALLBACK_LINK.round_trip_s
        time.sleep(max(2.0, 10 * round_trip))
        own = accessors.own_state_priority(self.optimizer)
        earlier = {peer: p for peer, p in accessors.state_priorities(self.optimizer).items() if own < p < 1.0}
        if not earlier:
            return
        first = max(earlier, key=earlier.get)
        if metrics.fetch_starts(self.dht, run_id).get(first.to_base58()) == own_digest:
            logger.info(
                "the run is at step 0 and another trainer started first, from the same parameters as this one: "
                "nothing to download"
            )
            return
        logger.info("the run is at step 0 and another trainer started first: starting from its parameters")
        if self._download_state():
            logger.info("downloaded the first trainer's parameters")
        # hivemind set this peer's priority to its step (0): declare the start priority again, which tells the
        # others that this trainer is starting until it reports progress
        accessors.set_state_priority(self.optimizer, self.start_priority)

    @torch.no_grad()
    def _download_state(self) -> bool:
        """hivemind's load_state_from_peers, and whether it really brought a state.

        When no peer answers, hivemind still moves a peer that is one step behind to the swarm's step (to tolerate
        a lagging peer), and a newcomer would then train with its own fresh optimizer statistics. A state that
        arrived changes the parameters: the swarm is at least one step past this peer's.
        """
        before = [p.detach().clone() for p in accessors.master_parameters(self.optimizer)]
        self.optimizer.load_state_from_peers()
        return any(not torch.equal(a, p) for a, p in zip(before, accessors.master_parameters(self.optimizer)))

    @property
    def _pending_update_timeout(self) -> float:
        return pending_update_timeout(self.timing.averaging_timeout)

    def _apply_pending_updates(self, timeout: float | None = None, outer_round: bool = True) -> None:
        """Wait for every background step and averaging round; a checkpoint must not miss one that lands late."""
        if not accessors.apply_pending_updates(self.optimizer, timeout or self._pending_update_timeout, outer_round):
            logger.warning("a background averaging round is still running: these parameters may miss its result")

    def _save(self, loss: float | None, pending_wait: float | None = None, final: bool = False) -> None:
        # save parameters with every step applied; a DiLoCo outer round in flight is awaited only at the end (the
        # checkpoint has the inner progress made since it was sent in its parameters: a resumed trainer sends that
        # progress in its next round)
        self._apply_pending_updates(pending_wait, outer_round=final)
        self.result.checkpoint = checkpoints.save_checkpoint(
            self.output_dir,
            self.optimizer.local_epoch,
            self.model,
            self.tokenizer,
            optimizer_state=self.optimizer.state_dict(),
            state={"loss": loss},
            keep=self.args.training_args.keep_checkpoints,
        )


class LastGoodState:
    """Host copies of parameters and optimizer state to roll back to: those after the last global step whose
    parameters were finite and then gave a finite pass. Finite parameters can still be unusable: a plain mean with a
    x1e4 peer's contribution leaves values whose every pass overflows; such a state is never the one rolled back to.
    """

    def __init__(self, optimizer: hivemind.Optimizer, pending_update_timeout: float):
        self.optimizer = optimizer
        self.pending_update_timeout = pending_update_timeout
        # (parameters, optimizer state, DiLoCo's inner state or None)
        self.good: tuple[list[torch.Tensor], dict, dict | None] | None = None
        self.candidate: tuple[list[torch.Tensor], dict, dict | None] | None = None  # no finite pass from it yet
        self.dropped_in_a_row = 0
        self.restored = False  # the state was restored and no pass from it was finite yet

    def keep_or_roll_back(self) -> bool:
        """After a global step: keep finite parameters as the next good state (True), or restore the last one."""
        if self.parameters_finite():
            self.save()
            return True
        self.roll_back(f"parameters became non-finite at step {self.optimizer.local_epoch}")
        return False

    def after_finite_pass(self) -> None:
        """A pass from the current parameters gave a finite loss and gradients: they are good."""
        self.dropped_in_a_row, self.restored = 0, False
        if self.candidate is not None:
            self.good, self.candidate = self.candidate, None

    def after_dropped_pass(self) -> bool:
        """A pass was dropped as non-finite: roll back (True) if the parameters are non-finite, or if this was the
        DROPPED_PASSES_BEFORE_ROLLBACK-th dropped pass in a row (finite parameters that overflow every pass)."""
        self.dropped_in_a_row += 1
        if not self.parameters_finite():
            self.roll_back("parameters became non-finite between global steps")
        elif self.dropped_in_a_row >= DROPPED_PASSES_BEFORE_ROLLBACK:
            if self.restored:  # rolling back again would restore the same state and spin
                raise UserError(
                    f"every pass from the last good state is non-finite too ({self.dropped_in_a_row} in a row): the "
                    "model cannot train from it (is --learning_rate too high?)"
                )
            self.roll_back(f"the last {self.dropped_in_a_row} passes were all non-finite")
        else:
            return False
        return True

    def roll_back(self, reason: str) -> None:
        logger.warning(f"{reason}: rolling back to the last good state")
        # every round still running lands first: one that landed after the restore would bring the bad values back
        accessors.apply_pending_updates(self.optimizer, self.pending_update_timeout)
        self.restore()
        self.candidate, self.dropped_in_a_row, self.restored = None, 0, True

    def _tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        offloaded = [p for group in self.optimizer.opt.param_groups for p in group["params"]]
        return accessors.master_parameters(self.optimizer), offloaded

    def parameters_finite(self) -> bool:
        main, offloaded = self._tensors()
        return is_finite(main) and is_finite(offloaded)

    @torch.no_grad()
    def save(self) -> None:
        """Keep the current state; it becomes the good one with the first finite pass from it (at once if there is
        no good one yet: the state a peer starts from was checked when loaded)."""
        main, _ = self._tensors()
        parameters = [p.detach().to("cpu", copy=True) for p in main]
        state = (parameters, copy.deepcopy(self.optimizer.opt.state_dict()), accessors.local_state(self.optimizer))
        if self.good is None:
            self.good = state
        else:
            self.candidate = state

    @torch.no_grad()
    def restore(self) -> None:
        parameters, optimizer_state, local_state = self.good
        main, offloaded = self._tensors()
        # with offload_optimizer the optimizer steps host copies of the model's parameters: both are restored
        for saved, target, copy_ in zip(parameters, main, offloaded):
            target.copy_(saved)
            copy_.copy_(saved)
        self.optimizer.opt.load_state_dict(copy.deepcopy(optimizer_state))
        accessors.restore_local_state(self.optimizer, local_state)
