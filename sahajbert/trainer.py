"""A volunteer's trainer peer: join the swarm, train on its own stream, take part in global steps, checkpoint.

`TrainerPeer` builds everything a peer needs (tokenizer, model, DHT, hivemind optimizer, compute backend, example
stream); `run()` is the training loop, read top to bottom; `train()` is the whole life of one peer. Its parts:
joining the run (sahajbert.joining), ending it (sahajbert.ending), rolling back (sahajbert.rollback) and what it
reports (sahajbert.reports).
"""

import logging
import math
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from accelerate import PartialState

from sahajbert import adaptive, checkpoints, memory
from sahajbert.cli import UserError
from sahajbert.compute import Compute, build_compute
from sahajbert.devices import DeviceInfo, describe_device, trainer_precision
from sahajbert.ending import Ending
from sahajbert.flags import PeerArguments
from sahajbert.hivemind_ext.optim import accessors
from sahajbert.joining import Joining
from sahajbert.model import build_model
from sahajbert.optim import build_collaborative_optimizer, gradients_finite
from sahajbert.peer_context import PeerContext
from sahajbert.reports import PeerReports, StepCounters
from sahajbert.rollback import LastGoodState, keep_good_state
from sahajbert.round_log import RoundMonitor
from sahajbert.signals import StopNow, StopRequest
from sahajbert.stopping import FRESH_READ_TIMEOUT, pending_update_timeout
from sahajbert.stream import Prefetcher, peer_seed, training_batches
from sahajbert.swarm import SwarmPeer, validate_initial_peers
from sahajbert.tokenization import load_tokenizer
from sahajbert.train_log import StepRecord, TrainLog

logger = logging.getLogger(__name__)
# seconds a stopping peer waits for a background round to land before its last checkpoint (a stop is due within
# signals.FORCE_AFTER seconds)
STOP_PENDING_WAIT = 5.0


@dataclass
class TrainResult:
    final_step: int
    steps: list[StepRecord] = field(default_factory=list)  # also written to train_log.jsonl
    checkpoint: Path | None = None


def train(peer_args: PeerArguments) -> TrainResult:
    """Run one trainer peer until --max_steps, SIGINT or SIGTERM; it always leaves the swarm cleanly."""
    memory.set_up_peer_process()  # before the model and hivemind's forked processes allocate
    with StopRequest("stopping after the current pass") as stop, TrainerPeer(peer_args) as peer:
        return peer.run(stop)


class TrainerPeer(SwarmPeer):
    """One trainer in the swarm; use as a context manager, so that it always leaves the swarm."""

    def __init__(self, peer_args: PeerArguments):
        self.args = peer_args
        swarm_args, training_args = peer_args.swarm_args, peer_args.training_args
        validate_initial_peers(swarm_args.initial_peers)  # answer a typo at once, before loading anything
        self.tokenizer = load_tokenizer(peer_args.corpus_args.tokenizer_path)
        device_info = describe_device(training_args.device)
        diloco = bool(peer_args.optimizer_args.diloco_inner_steps)
        precision = trainer_precision(device_info, training_args.precision, diloco)
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
        # what close() undoes, in reverse order of building: a failure midway leaves the swarm with what was built
        self._parts = ExitStack()
        try:
            self._build_parts(resume_from, device_info, precision, forward_batch)
        except BaseException:
            self.leave()
            raise
        self.stop: StopRequest | None = None  # set by run()

    def _build_parts(
        self, resume_from: Path | None, device_info: DeviceInfo, precision: str, forward_batch: int
    ) -> None:
        """Join the swarm and build what trains in it, each part closed by close() from when it exists."""
        peer_args = self.args
        self.rounds = RoundMonitor(peer_args.swarm_args.verbose)
        self._parts.callback(self.rounds.detach)  # after leaving: hivemind's last round lines are the monitor's too
        self._join(peer_args.swarm_args)
        self._parts.callback(super().close)  # the optimizer (once built), the DHT and the p2p daemon
        parameters = sum(p.numel() for p in self.model.parameters())
        self.timing, self.link, self.link_watch = adaptive.tune(peer_args, self.dht, parameters)
        self.rounds.attach()
        self.optimizer = build_collaborative_optimizer(
            self.model,
            self.dht,
            peer_args,
            batch_size_per_step=self.samples_per_pass,
            timing=self.timing,
            gate=self.gate,
        )
        context = PeerContext(self.optimizer, self.dht, self.public_key, peer_args)
        self.joining = Joining(context, self.timing, self.link)
        self.joining.join(resume_from)
        self.compute = self._build_compute(device_info, precision)
        self.batches = self._build_batches(device_info, forward_batch)
        self._parts.callback(self.batches.close)
        kept = keep_good_state(peer_args.training_args.keep_good_state, self.output_dir)
        self.good_state = LastGoodState(self.optimizer, self._pending_update_timeout, kept)
        self._parts.callback(self.good_state.close)
        self.train_log = TrainLog(self.output_dir)
        self.ending = Ending(context, self.timing)
        # the progress refresh follows the global step's time, unless --max_refresh_period was given
        self.refresh_ceiling = peer_args.optimizer_args.max_refresh_period
        self._last_step_time = None
        self.counters = StepCounters()
        self.last_step = self.optimizer.local_epoch  # the global step of the last record
        self.dropped_passes = 0
        self.result = TrainResult(final_step=self.optimizer.local_epoch)
        self.reports = PeerReports(context, device_info.kind)

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

    def _build_compute(self, device_info: DeviceInfo, precision: str) -> Compute:
        """What runs the forward and backward passes (the device's backend)."""
        return build_compute(self.model, device_info, precision)

    def _build_batches(self, device_info: DeviceInfo, forward_batch: int) -> Prefetcher:
        """This peer's own stream of training batches (its seed: --data_seed, else the run's mixed with its key)."""
        training_args = self.args.training_args
        seed = training_args.data_seed
        if seed is None:
            seed = peer_seed(training_args.seed, self.public_key)
        on_xla = device_info.kind == "tpu"
        return training_batches(self.args.corpus_args, self.tokenizer, seed, forward_batch, on_xla)

    def close(self) -> None:
        """Stop the stream, then leave the swarm: what construction built, in reverse."""
        self._parts.close()

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
            while not (stop or self.ending.should_stop(after_step, stop) or self.access_lost):
                pass_loss = self._forward_backward()
                if pass_loss is None:
                    continue  # non-finite loss or gradients: this pass was dropped, nothing was sent
                if self.ending.should_stop(after_step, stop):
                    break  # the swarm got there in a round without us: do not step alone
                host_changed = self._step(pass_loss)
                after_step = accessors.position(self.optimizer)
                if self.optimizer.local_epoch != self.last_step:
                    self._after_global_step()
                    host_changed = True
                if host_changed:
                    self.compute.push_parameters()
                self.reports.log_progress()
                self._watch_link()
        except StopNow:
            pass  # stopped while waiting for the stream's next batch
        result = self._finish(stopped=bool(stop) or self.access_lost)
        self.check_access()
        return result

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
            # each peer's own pass, before the swarm averages it (as DeDLOC's trainer clipped through the HF Trainer).
            # With fp16, hivemind's scaler unscales only inside a global step; elsewhere it checks for infinities and
            # leaves the pass's gradients multiplied by the loss scale (unscale_ says False): the bound is scaled too,
            # so that the true norm is what is bounded
            max_norm = training_args.max_grad_norm
            if self.compute.scaler is not None and not self.compute.scaler.unscale_(self.optimizer):
                max_norm *= self.compute.scaler.get_scale()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return pass_loss

    def _step(self, pass_loss: float) -> bool:
        """Hand the pass to hivemind, which steps when the swarm's batch is full; True if the parameters changed."""
        # hivemind changes the host parameters in a step that starts a new global step and, with delayed updates,
        # in the first step after a background update was pending: only then does a device copy need them again
        updates_pending = accessors.has_pending_updates(self.optimizer)
        step_before = self.optimizer.local_epoch
        self.ending.before_step()
        if self.optimizer.step_would_be_global(self.samples_per_pass):
            # (with DiLoCo's overlap the second round is sent at step 0 too, while the first is in flight: the wait,
            # and its two blocking DHT reads, came before the first)
            if self.optimizer.local_epoch == 0 and not self.optimizer.round_in_flight:
                self.joining.wait_for_starting_trainers(self.stop)
            # hivemind's view of the swarm may be seconds old (peers that joined since, samples they reported):
            # a global step is only started on a fresh read, so that no peer steps alone on a stale count
            self.optimizer.read_progress_now(FRESH_READ_TIMEOUT)
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
        self.counters.optimizer_seconds += self.optimizer.take_inner_step_seconds()
        changed = self.optimizer.steps_change_parameters or updates_pending
        return changed or self.optimizer.local_epoch != step_before

    def _after_global_step(self) -> None:
        """The swarm made a global step: check the parameters, publish this peer's metrics, log, checkpoint."""
        self.joining.retry_download()
        self.good_state.keep_or_roll_back()
        record = self.reports.record_step(self.counters, self.rounds, self.timing)
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
        """Read the swarm's progress `reads_per_step` times per global step (DiLoCo: every 3rd step), by the time the
        last one took."""
        now = time.monotonic()
        if self.refresh_ceiling is None and self._last_step_time is not None:
            seconds = now - self._last_step_time
            period = adaptive.refresh_period_for(seconds, adaptive.REFRESH_BOUNDS[1], self.optimizer.reads_per_step)
            accessors.set_refresh_period(self.optimizer, period)
        self._last_step_time = now

    def _finish(self, stopped: bool) -> TrainResult:
        """Apply what still runs in the background, end the run with the others, write the final checkpoint."""
        pending_wait = STOP_PENDING_WAIT if stopped else self._pending_update_timeout
        self._apply_pending_updates(pending_wait)
        if not stopped:
            self.ending.end_with_the_others([record.peers for record in self.result.steps])
        self.compute.finish()  # an XLA device copy ends with the final parameters too
        self.result.final_step = self.optimizer.local_epoch
        # always written at the end, also before this peer's first global step (a restart then resumes from the state
        # it started from or downloaded, not from scratch), and again after the last save: a background round may
        # have changed the parameters since
        self._save(self.result.steps[-1].loss if self.result.steps else None, pending_wait, final=True)
        last_record = self.reports.publish("stopped" if stopped else "finished")
        if not stopped:
            self.ending.wait_for_archive()
        self.ending.wait_for_record(last_record)
        logger.info(f"stopped at global step {self.optimizer.local_epoch}" + (" (stop requested)" if stopped else ""))
        return self.result

    # ---- state and checkpoints ----

    @property
    def _pending_update_timeout(self) -> float:
        return pending_update_timeout(self.timing.averaging_timeout)

    def _apply_pending_updates(self, timeout: float | None = None, round_in_flight: bool = True) -> None:
        """Wait for every background step and averaging round; a checkpoint must not miss one that lands late."""
        timeout = timeout or self._pending_update_timeout
        if not accessors.apply_pending_updates(self.optimizer, timeout, round_in_flight):
            logger.warning("a background averaging round is still running: these parameters may miss its result")

    def _save(self, loss: float | None, pending_wait: float | None = None, final: bool = False) -> None:
        # save parameters with every step applied; a round in flight (DiLoCo's outer round) is awaited only at the end
        # (the checkpoint has the inner progress made since it was sent in its parameters: a resumed trainer sends
        # that progress in its next round)
        with accessors.sitting_out(self.optimizer):  # seconds without a pass: the others must not count samples here
            self._apply_pending_updates(pending_wait, round_in_flight=final)
            self.result.checkpoint = checkpoints.save_checkpoint(
                self.output_dir,
                self.optimizer.local_epoch,
                self.model,
                self.tokenizer,
                optimizer_state=self.optimizer.state_dict(),
                state={"loss": loss},
                keep=self.args.training_args.keep_checkpoints,
            )
