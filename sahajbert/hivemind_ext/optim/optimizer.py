"""hivemind.Optimizer with guarded, robust averagers and a bounded progress tracker (`GuardedOptimizer`)."""

import logging
import math
import time
from collections.abc import Callable
from functools import partial

import hivemind
from hivemind.averaging.control import StepControl
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils import get_dht_time

from sahajbert.hivemind_ext.averaging.averager import GuardedAverager, GuardedGradientAverager, GuardedStateAverager
from sahajbert.hivemind_ext.averaging.control import cancel_sent, round_succeeded
from sahajbert.hivemind_ext.optim.progress import BoundedProgressTracker, request_progress_read

logger = logging.getLogger(__name__)


# a count that no global step or sample total reaches
NEVER = 2**62
# an `average_state_every` that no global step number is a multiple of: no parameter round at the coming steps
NO_STATE_AVERAGING = NEVER


def gradient_averager_factory(gate=None, aggregation=None, **averager_opts):
    """hivemind 1.1.x gives `averager_opts` to the state averager only: the gradient averager, made by this factory
    (the documented `grad_averager_factory`), gets the same bandwidth and group size, the access gate and the
    robust aggregation (None: the rules' default `Aggregation()`). It serves no state: hivemind's Optimizer downloads
    a gradient averager's state (its gradient buffers, the model's size) after the training state only to discard
    it."""
    return partial(
        GuardedGradientAverager, gate=gate, aggregation=aggregation, allow_state_sharing=False, **averager_opts
    )


DOWNLOAD_BACKOFF_MAX = 8  # refresh periods: the longest wait between two attempts at the swarm's state
DOWNLOAD_BACKOFF_LOGGED = 4  # failures in a row after which the wait is logged once more


class DownloadBackoff:
    """When a peer may next try to download the swarm's state: after an attempt that brought none, after 2, 4 ..
    DOWNLOAD_BACKOFF_MAX refresh periods (a period after one that did), never in a loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock, self.failures, self.next_at = clock, 0, -math.inf

    def due(self) -> bool:
        return self.clock() >= self.next_at

    def done(self, taken: bool, period: float) -> float:
        """Record an attempt's outcome; the seconds until the next attempt is due."""
        self.failures = 0 if taken else self.failures + 1
        wait = period * min(2**self.failures, DOWNLOAD_BACKOFF_MAX)
        self.next_at = self.clock() + wait
        return wait


class GuardedOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer whose state averager is guarded and robust, and whose progress tracker bounds claims; its
    gradient averager comes from `gradient_averager_factory`. `_make_state_averager` and `_make_progress_tracker`
    repeat hivemind 1.1.12's own arguments. `passes_through`: exceptions a state download lets through (the project's
    stop request) where any other failure is logged and training goes on. `reads_per_step`: how often per global
    step the trainer has the swarm's progress read (the project's policy, sahajbert.adaptive.refresh_period_for).

    The trainer asks the optimizer the questions of its loop (`step_would_be_global`, `read_progress_now`,
    `step_progress`, `round_in_flight`, ...): this class answers them for data-parallel training, and a mode of
    training (DiLoCoOptimizer) overrides the answers, so that the loop never asks which mode it runs."""

    def __init__(
        self,
        *args,
        gate=None,
        aggregation=None,
        passes_through: tuple[type[BaseException], ...] = (),
        reads_per_step: float = 5,
        **kwargs,
    ):
        self._gate, self._aggregation = gate, aggregation
        self._passes_through = passes_through
        self.reads_per_step = reads_per_step
        self.downloads = DownloadBackoff()
        super().__init__(*args, **kwargs)

    # ---- the questions of the trainer's loop, answered for data-parallel training ----

    # an optimizer.step() changes the parameters only when it makes a global step
    steps_change_parameters = False
    # the swarm's samples start a global step: the swarm's pace, in samples/s, sets the time between global steps
    samples_start_steps = True
    # the optimizer's (offloaded) parameters are the model's between global steps: a rollback restores both alike
    model_is_outer = True

    @property
    def round_in_flight(self) -> bool:
        """A round was sent whose global step is not made yet, while this peer trains on (DiLoCo's overlap; hivemind's
        delayed rounds are pending updates of the state averager instead)."""
        return False

    def step_would_be_global(self, batch_size: int) -> bool:
        """Would `step(batch_size=batch_size)` start a global step, by the tracker's current view? (hivemind adds the
        batch to `global_progress.samples_accumulated`, then checks `tracker.ready_to_update_epoch`.)"""
        tracker = self.tracker
        progress = tracker.global_progress
        return (
            tracker.global_epoch > tracker.local_progress.epoch
            or progress.samples_accumulated + batch_size >= tracker.target_batch_size
            or get_dht_time() >= progress.eta_next_epoch
        )

    def read_progress_now(self, timeout: float) -> bool:
        """Make the tracker read the swarm's progress from the DHT now and wait for it; False if no read came in time.

        The fetcher sleeps until `global_progress.next_fetch_time` or until `global_state_updated` is set; when woken
        it re-reads the (now past) fetch time, fetches, and sets `fetched_global_progress_this_epoch`.
        """
        request_progress_read(self.tracker)
        return self.tracker.fetched_global_progress_this_epoch.wait(timeout)

    def step_progress(self) -> str:
        """This peer's way to the coming global step, in words: the swarm's samples toward its batch."""
        progress = self.tracker.global_progress
        return f"{progress.samples_accumulated}/{progress.target_batch_size} samples toward the next step"

    def take_inner_step_seconds(self) -> float:
        """Seconds spent in optimizer steps made between global steps since the last call (then 0 again): none."""
        return 0.0

    def local_state(self, copied: bool = True) -> dict | None:
        """What a trainer changes between global steps besides the parameters and the optimizer's state, to roll back
        to (a copy, or its live tensors where not `copied`): nothing."""
        return None

    def restore_local_state(self, state: dict | None) -> None:
        """Take back a state `local_state` kept: nothing to take back."""

    def finish_round_in_flight(self, timeout: float | None = None) -> None:
        """Wait for the round in flight (`round_in_flight`) and make its global step: there is none."""

    def _should_load_state_from_peers(self) -> bool:
        # hivemind's answer first (it also clears its once-per-step check); then no more than the backoff allows
        return super()._should_load_state_from_peers() and self.downloads.due()

    def load_state_from_peers(self, **kwargs) -> bool:
        """Follows hivemind 1.1.12's Optimizer.load_state_from_peers (hivemind/optim/optimizer.py): one attempt at
        hivemind's download of the training state (hivemind's own retries at once, forever, with
        a traceback per failure), its outcome fed to `self.downloads`; whether a state was taken. The gradient
        averager's state is not asked for: hivemind resets those buffers after a download anyway."""
        # a state from beyond the swarm's step (bounded by BoundedProgressTracker) is refused; a peer that has seen
        # no other peer yet has no step to hold it to
        seen_others = self.tracker.global_progress.num_peers > 1
        self.state_averager.state_step_ceiling = self.tracker.global_epoch + 1 if seen_others else None
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            # a round this peer joined: it takes part with weight 0 rather than make the others match again
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)
        before = self.state_averager.states_downloaded
        with self.tracker.pause_updates():
            try:
                self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
            except TimeoutError:
                logger.info(f"no peer sent its state within {self.load_state_timeout:.0f} s")
            except self._passes_through:  # the project's own (a stop request), never taken for a failed download
                raise
            except Exception as e:  # hivemind retried any error at once, forever: one line, and the backoff
                logger.warning(f"a state download failed ({e!r}): training on")
            taken = self.state_averager.states_downloaded > before
            wait = self.downloads.done(taken, self.tracker.max_refresh_period)
            if not taken and self.downloads.failures in (1, DOWNLOAD_BACKOFF_LOGGED):
                logger.info(f"no usable state from the swarm's peers: training on, next try in {wait:.0f} s or later")
            if self.tracker.global_epoch - 1 <= self.local_epoch < self.tracker.global_epoch:
                self.state_averager.local_epoch = self.tracker.global_epoch  # one step behind: catch up, as hivemind
            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
            if self.use_gradient_averaging:
                self.grad_averager.reset_accumulated_grads_()
                if not self.client_mode:
                    self.grad_averager.state_sharing_priority = self.local_epoch
        return taken

    def _update_global_epoch(self, grad_scaler) -> None:
        # `_average_gradients_and_load_into_optimizer` may call off this step's parameter round; later steps keep it
        average_state_every = self.average_state_every
        try:
            super()._update_global_epoch(grad_scaler)
        finally:
            self.average_state_every = average_state_every

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: StepControl | None) -> None:
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        if self.delay_grad_averaging or maybe_step_control is None or round_succeeded(maybe_step_control):
            return
        if self.average_state_every == NO_STATE_AVERAGING:
            return  # no parameter round to call off (DiLoCo; the run's last step)
        # Lockstep (a gradient round in the foreground, then a parameter round; each waits up to the round timeout
        # for a group that is not coming): a gradient round that found nobody while other peers report progress
        # most likely ran while they were in their parameter round. Making this step's parameter round too would
        # keep this peer one round out of phase with them for good: both kinds of round then find nobody and every
        # step takes two round timeouts. Without it, this peer's next gradient round starts as theirs does. The
        # parameters
        # stay as they are until the next step's parameter round.
        logger.info("the gradient round found no group: this step makes no parameter round, to meet the others' next")
        self.average_state_every = NO_STATE_AVERAGING

    def shutdown(self):
        # hivemind's shutdown cancels each scheduled round whose stage reads "looking for a group", also one this
        # peer has called off already (`cancel_round`), which raised InvalidStateError; one that has ended needs
        # nothing either
        for name in ("scheduled_grads", "scheduled_state"):
            control = getattr(self, name)
            if control is not None and (control.done() or cancel_sent(control)):
                setattr(self, name, None)
        super().shutdown()

    def _vouched_peers(self) -> set[bytes]:
        averagers = (getattr(self, "state_averager", None), getattr(self, "grad_averager", None))
        vouched = set().union(*(a.vouched_peers() for a in averagers if isinstance(a, GuardedAverager)))
        return vouched - self._left_out_peers()

    def _left_out_peers(self) -> set[bytes]:
        # the tracker starts before the averagers: until they exist, nobody is left out
        averagers = (getattr(self, "state_averager", None), getattr(self, "grad_averager", None))
        averagers = [a for a in averagers if isinstance(a, GuardedAverager)]
        left_out = set().union(*(a.left_out_peers() for a in averagers))
        for averager in averagers:  # what one averager caught, the other leaves out too
            averager.leave_out(left_out)
        return left_out

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        """hivemind 1.1.12's Optimizer._make_progress_tracker (hivemind/optim/optimizer.py), with our tracker."""
        return BoundedProgressTracker(
            left_out=self._left_out_peers,
            vouched=self._vouched_peers,
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        """hivemind 1.1.12's Optimizer._make_state_averager (hivemind/optim/optimizer.py), with our averager."""
        return GuardedStateAverager(
            gate=self._gate,
            aggregation=self._aggregation,
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )
