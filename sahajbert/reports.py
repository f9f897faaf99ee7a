"""What a trainer tells: its record of each global step (published for the monitors and logged in one line), its
metrics record, and its progress lines toward the next global step, with a word when the swarm's pace is slow."""

import logging
import time
from collections import deque
from dataclasses import dataclass

from sahajbert import records
from sahajbert.adaptive import Timing
from sahajbert.hivemind_ext.optim import accessors
from sahajbert.peer_context import PeerContext
from sahajbert.round_log import RoundMonitor
from sahajbert.split_watch import SplitWatch
from sahajbert.train_log import StepRecord

# the trainer's lines keep the trainer's logger name, whichever of its parts says them: users filter on it
logger = logging.getLogger("sahajbert.trainer")
# a global step that the swarm's pace makes longer than this (seconds) is said once, with what to try instead
SLOW_STEP_SECONDS = 3600.0
SMALL_MODELS = ("tiny", "tiny-xl")
UNMEASURED_PACE = 1e-6  # samples/s below which the swarm's pace is not measured yet (a step would take 130 years)


@dataclass
class StepCounters:
    """This peer's work toward the global step in progress; a new one starts after every global step."""

    loss_sum: float = 0.0  # summed over passes, each pass's loss the mean over its accumulated batches
    passes: int = 0
    samples: int = 0
    compute_seconds: float = 0.0  # forward and backward only
    optimizer_seconds: float = 0.0  # optimizer steps between global steps (DiLoCo's inner steps)


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


class PeerReports:
    """This peer's records and lines; `contributed`: samples it contributed to global steps since it started."""

    def __init__(
        self,
        context: PeerContext,
        device_kind: str,
    ):
        self.optimizer, self.dht, self.public_key = context.optimizer, context.dht, context.public_key
        peer_args = context.peer_args
        self.run_id, self.model = peer_args.swarm_args.run_id, peer_args.model_args.model
        self.log_every_seconds = peer_args.training_args.log_every_seconds
        self.device_kind = device_kind
        self.contributed = 0
        self.recent_steps: deque[records.StepEntry] = deque(maxlen=records.RECENT_STEPS)  # published with each record
        self._last_progress_line = time.monotonic()
        self._pace_told = False
        self.split_watch = SplitWatch(self.dht, self.run_id, self.public_key)

    def record_step(self, counters: StepCounters, rounds: RoundMonitor, timing: Timing) -> StepRecord:
        """This peer's record of the global step just made, from its `counters`; published to the swarm and logged in
        one line."""
        step = self.optimizer.local_epoch
        self.contributed += counters.samples
        samples_per_second = accessors.own_samples_per_second(self.optimizer)
        if self.optimizer.is_synchronized_with_peers():  # a peer that is behind would report a stale step
            entry = records.StepEntry(
                step=step,
                loss=float(counters.loss_sum),
                mini_steps=counters.passes,
                samples=counters.samples,
                samples_per_second=samples_per_second,
            )
            self.recent_steps.append(entry)
            self.publish("training")
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
            failed_rounds=rounds.failed_rounds,
            round_seconds=rounds.round_seconds[-1] if rounds.round_seconds else None,
            bandwidth_mbit=timing.bandwidth,
        )
        logger.info(
            f"global step {step} | loss {record.loss:.4f} | {samples_per_second:.1f} samples/s | "
            f"{record.peers} peer(s) | this peer contributed {self.contributed} samples so far"
        )
        return record

    def publish(self, status: str):
        """This peer's record for the monitors: its last step, its last steps, its samples so far and its status."""
        last = self.recent_steps[-1] if self.recent_steps else None
        local = records.LocalMetrics(
            step=last.step if last else self.optimizer.local_epoch,
            samples_per_second=last.samples_per_second if last else 0.0,
            samples_accumulated=last.samples if last else 0,
            loss=last.loss if last else 0.0,
            mini_steps=last.mini_steps if last else 0,
            peer_id=self.dht.peer_id.to_base58(),
            samples_contributed=self.contributed,
            recent=list(self.recent_steps),
            status=status,
            peers_seen=self.split_watch.peers_seen or accessors.position(self.optimizer).peers,
        )
        return records.publish(self.dht, self.run_id, self.public_key, local)

    def log_progress(self) -> None:
        """Every --log_every_seconds: the swarm's progress toward the next global step; and a word if the other
        trainers' records show a swarm that is not the one this peer sees (sahajbert.split_watch)."""
        position = accessors.position(self.optimizer)
        self.split_watch.saw(position.peers)
        if self.optimizer.is_synchronized_with_peers():  # a peer catching up is at another step than the others
            self.split_watch.poll(self.optimizer.local_epoch)
        if time.monotonic() - self._last_progress_line < self.log_every_seconds:
            return
        logger.info(
            f"step {position.local_step}: {self.optimizer.step_progress()} from {position.peers} peer(s); "
            f"this peer {accessors.own_samples_per_second(self.optimizer):.1f} samples/s"
        )
        self._last_progress_line = time.monotonic()
        warning = (
            None
            if not self.optimizer.samples_start_steps or self._pace_told
            else slow_pace_warning(position, self.model, self.device_kind)
        )
        if warning:
            logger.warning(warning)
            self._pace_told = True
