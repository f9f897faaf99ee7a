"""What the trainer, the aux peer and the stopping rules read and set on a hivemind.Optimizer beyond its documented
API (the swarm's progress, the state averager, the pre-scheduled rounds). Each function says what it relies on.
"""

import contextlib
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import hivemind
import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.compression import NoCompression
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from sahajbert.hivemind_ext.averaging.control import SETTLE_POLL, cancel_round, still_matching
from sahajbert.hivemind_ext.optim.optimizer import NO_STATE_AVERAGING, GuardedOptimizer
from sahajbert.hivemind_ext.optim.progress import BoundedProgressTracker


@dataclass(frozen=True)
class SwarmPosition:
    """Where this peer and the swarm stand, as hivemind's progress tracker sees them."""

    local_step: int  # this peer's global step (hivemind's local_epoch)
    swarm_step: int  # the highest global step any peer reports (tracker.global_epoch)
    peers: int  # peers reporting progress now
    samples_accumulated: int  # the swarm's samples toward the next global step
    target_batch_size: int
    # this peer was matched in advance into the coming gradient all-reduce, which waits for its part
    gradient_round_waiting: bool
    # hivemind pre-scheduled that all-reduce and is still matching it: a group may yet form around this peer
    gradient_round_matching: bool
    # hivemind's estimate of the seconds until the swarm reaches the next global step (every peer's reported pace);
    # None before this peer has measured its own pace
    seconds_to_next_step: float | None = None


def position(optimizer: hivemind.Optimizer) -> SwarmPosition:
    """Read the swarm's progress: `tracker.global_epoch`, `tracker.global_progress` (num_peers,
    samples_accumulated, target_batch_size) and `optimizer.scheduled_grads` (a StepControl that hivemind
    pre-schedules for the next gradient round; its `stage` is AWAITING_TRIGGER once the group is formed)."""
    progress = optimizer.tracker.global_progress
    scheduled = optimizer.scheduled_grads
    return SwarmPosition(
        local_step=optimizer.local_epoch,
        swarm_step=optimizer.tracker.global_epoch,
        peers=progress.num_peers,
        samples_accumulated=progress.samples_accumulated,
        target_batch_size=progress.target_batch_size,
        gradient_round_waiting=scheduled is not None
        and not scheduled.done()
        and scheduled.stage == AveragingStage.AWAITING_TRIGGER,
        gradient_round_matching=still_matching(scheduled),
        seconds_to_next_step=_seconds_until(getattr(progress, "eta_next_epoch", math.inf)),
    )


def _seconds_until(dht_time: float) -> float | None:
    left = dht_time - get_dht_time()
    return left if 0 <= left < math.inf else None


def gradient_rounds_in_background(optimizer: hivemind.Optimizer) -> bool:
    """`delay_grad_averaging`: a step is announced (`tracker.update_epoch`) as its gradient round starts, not after."""
    return bool(optimizer.delay_grad_averaging)


def settle_gradient_round(optimizer: hivemind.Optimizer, timeout: float, interrupted: Callable[[], bool]) -> None:
    """Wait until the pre-scheduled gradient round (`optimizer.scheduled_grads`) is matched into a group or fails;
    one still matching after `timeout` seconds (or when `interrupted()`) is cancelled.

    hivemind keeps matching a pre-scheduled round until its deadline, also for a peer that has stopped training: a
    group formed around it afterwards would wait for a part that never comes, until the all-reduce timeout.
    """
    scheduled = optimizer.scheduled_grads
    deadline = time.monotonic() + timeout
    while still_matching(scheduled) and time.monotonic() < deadline and not interrupted():
        time.sleep(SETTLE_POLL)
    if still_matching(scheduled):
        cancel_round(scheduled)


def wait_for_swarm_progress(optimizer: hivemind.Optimizer, timeout: float) -> None:
    """Block until the tracker has read the swarm's progress once (`tracker.fetched_global_progress_this_epoch`)."""
    optimizer.tracker.fetched_global_progress_this_epoch.wait(timeout)


def set_refresh_period(optimizer: hivemind.Optimizer, seconds: float) -> None:
    """The most seconds between two reads of the swarm's progress (`tracker.max_refresh_period`, read per fetch)."""
    optimizer.tracker.max_refresh_period = seconds


def set_bandwidth(optimizer: hivemind.Optimizer, mbit: float) -> None:
    """Declare this peer's bandwidth to both averagers; each round's matchmaking gathers `averager.bandwidth` in this
    process (DecentralizedAverager.step), and hivemind's load_balance_peers splits the all-reduce by it."""
    for averager in (optimizer.state_averager, optimizer.grad_averager):
        if averager is not None:
            averager.bandwidth = mbit


def set_state_priority(optimizer: hivemind.Optimizer, priority: float) -> None:
    """Newcomers download the state from the peer with the highest priority (`state_averager.state_sharing_priority`,
    declared in the DHT under `<averager.prefix>.all_averagers`); a client-mode peer serves no state."""
    if not optimizer.client_mode:
        optimizer.state_averager.state_sharing_priority = priority


def own_state_priority(optimizer: hivemind.Optimizer) -> float:
    """This peer's declared state priority; -1 for a client-mode peer, which declares none."""
    return -1.0 if optimizer.client_mode else optimizer.state_averager.state_sharing_priority


def state_priorities(optimizer: hivemind.Optimizer) -> dict[PeerID, float]:
    """Every other peer that offers its state, with its declared priority (the key load_state_from_peers reads)."""
    averager = optimizer.state_averager
    key = f"{averager.prefix}.all_averagers"
    found = optimizer.dht.get(key, latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    own = optimizer.dht.peer_id
    priorities = {}
    for peer_id, info in entries.items():
        if info.value is None:
            continue
        peer = PeerID(peer_id)
        if peer != own:
            priorities[peer] = float(info.value)
    return priorities


def starting_peers(optimizer: hivemind.Optimizer) -> set[PeerID]:
    """Trainers of a new run that offer their state at a start priority (between 0 and 1: step 0, see
    joining.start_priority) but report no progress yet (`tracker.training_progress_key`, whose entries name their
    `peer_id`; a peer reports once it has trained a batch)."""
    announced = {peer for peer, priority in state_priorities(optimizer).items() if 0 < priority < 1}
    if not announced:
        return set()
    return announced - {PeerID.from_base58(peer) for peer in progress_peers(optimizer)}


def progress_peers(optimizer: hivemind.Optimizer) -> set[str]:
    """The peers (base58) that report training progress now (`tracker.training_progress_key`); a peer that left
    cleanly stored an empty report, and a vanished one's report expires after --metadata_expiration seconds."""
    found = optimizer.dht.get(optimizer.tracker.training_progress_key, latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    return {
        PeerID(entry.value["peer_id"]).to_base58()
        for entry in entries.values()
        if isinstance(entry.value, dict) and "peer_id" in entry.value
    }


# how hivemind reports an averaging round's end (at the optimizer's status level, INFO with verbose=True)
GRADIENT_ROUND_FAILED = re.compile(r"^Averaging gradients failed with (.*)$")
GRADIENT_ROUND_DONE = re.compile(r"^Averaged gradients with (\d+) peers$")
STATE_ROUND_FAILED = re.compile(r"^Averaging failed with (.*)$")
ROUND_LOGGERS = ("hivemind.optim.optimizer", "hivemind.optim.state_averager")


def own_samples_per_second(optimizer: hivemind.Optimizer) -> float:
    """This peer's throughput as hivemind measures it (`tracker.performance_ema.samples_per_second`)."""
    return float(optimizer.tracker.performance_ema.samples_per_second)


def sitting_out(optimizer: hivemind.Optimizer):
    """A context within which this peer's progress record says it makes no samples
    (`BoundedProgressTracker.sitting_out`; with hivemind's own tracker, nothing)."""
    tracker = optimizer.tracker
    return tracker.sitting_out() if isinstance(tracker, BoundedProgressTracker) else contextlib.nullcontext()


def report_step(optimizer: hivemind.Optimizer, step: int) -> None:
    """Tell the swarm this peer is at `step` with no samples (`tracker.report_local_progress`)."""
    optimizer.tracker.report_local_progress(step, samples_accumulated=0)


def master_parameters(optimizer: hivemind.Optimizer) -> list[torch.Tensor]:
    """The model's parameters as hivemind holds them (`state_averager.main_parameters`); with offload_optimizer
    the optimizer steps host copies of them (the documented `optimizer.opt.param_groups`)."""
    return list(optimizer.state_averager.main_parameters)


def set_step(optimizer: hivemind.Optimizer, step: int) -> None:
    """Move this peer to `step` and the learning-rate schedule with it (`state_averager.local_epoch`, then
    `state_averager._update_scheduler()`, which sets the scheduler to the averager's epoch)."""
    optimizer.state_averager.local_epoch = step
    optimizer.state_averager._update_scheduler()


def follow_schedule(optimizer: hivemind.Optimizer) -> None:
    """The learning rate follows the current global step after a state was loaded
    (`state_averager._update_scheduler()`; `load_state_dict` restores the step but not the scheduler)."""
    optimizer.state_averager._update_scheduler()


def has_pending_updates(optimizer: GuardedOptimizer, round_in_flight: bool = True) -> bool:
    """A background optimizer step or averaging round has not been applied yet (`state_averager.pending_updates`, or
    with `round_in_flight` the optimizer's round in flight)."""
    return (round_in_flight and optimizer.round_in_flight) or bool(optimizer.state_averager.pending_updates)


def apply_pending_updates(optimizer: GuardedOptimizer, timeout: float, round_in_flight: bool = True) -> bool:
    """Wait for every background update and apply it to the parameters; False if one still runs after `timeout` s.
    `round_in_flight`: also the optimizer's round in flight, if any (False: it lands at a later step).

    `state_averager.step(wait_for_delayed_updates=True)` waits for each update at most the all-reduce timeout and
    then leaves it running, so it is called again until `pending_updates` is empty or the time is up.
    """
    if round_in_flight:
        optimizer.finish_round_in_flight(timeout)
    averager = optimizer.state_averager
    deadline = time.monotonic() + timeout
    averager.step(wait_for_delayed_updates=True)
    while averager.pending_updates and time.monotonic() < deadline:
        averager.step(wait_for_delayed_updates=True)
    return not averager.pending_updates


def skip_parameter_averaging(optimizer: hivemind.Optimizer) -> None:
    """No parameter round at the coming global steps (`optimizer.average_state_every`, read at every step)."""
    optimizer.average_state_every = NO_STATE_AVERAGING


def start_parameter_round(
    optimizer: hivemind.Optimizer, group_bits: str, wait: float, timeout: float, group_size: int | None = None
) -> StepControl:
    """Start one parameter all-reduce that matches only peers under `group_bits` and begins in `wait` seconds, or as
    soon as `group_size` peers are in its group (`GuardedAverager.set_target_group_size`; None: hivemind's).

    Relies on: `scheduled_state`/`scheduled_grads` (rounds pre-scheduled for the next step, cancelled while still
    looking for a group: this peer will not make them), `state_averager.set_group_bits` (the matchmaking key),
    `schedule_step(scheduled_time, gather, timeout)` (hivemind makes the peer whose wait ends first the leader and
    starts the all-reduce when that wait ends; `gather` carries this peer's step to the others),
    `sync_epoch_when_averaging` (peers adopt the highest step gathered, the LR schedule with it), and
    `state_averager.step(averaging_round=True, averaging_control=..., delay_averaging=True)` (runs the round in the
    background; its result lands as a pending update). The returned control's result maps each peer to its step.

    The round sends fp32 (`GuardedAverager.set_compression`), whatever the run's codec: hivemind returns to each peer
    the average minus the value it received from it, in the round's codec, and the peer adds that to its own value.
    In fp16 each peer would keep the rounding of that difference (2^-11 of half the peers' divergence), which for
    values near 0 exceeds the agreement tolerance. In fp32 every peer ends at
    the average, up to fp32's rounding. It doubles the bytes of one round per run. A state downloaded from this peer
    from then on is fp32 too: a final round that came back partial ends with one peer's parameters downloaded.
    """
    for scheduled in (optimizer.scheduled_state, optimizer.scheduled_grads):
        if still_matching(scheduled):
            cancel_round(scheduled)
    if not getattr(optimizer, "model_is_outer", True):  # DiLoCo: the round averages the models, not the outer step's
        optimizer.take_model_into_outer()
    averager = optimizer.state_averager
    averager.set_group_bits(group_bits)
    if group_size is not None:
        averager.set_target_group_size(group_size)
    averager.set_compression(NoCompression())
    control = averager.schedule_step(
        scheduled_time=get_dht_time() + wait, gather=optimizer.local_epoch, timeout=timeout
    )
    averager.sync_epoch_when_averaging = True
    averager.step(
        averaging_round=True, averaging_control=control, delay_averaging=True, averaging_opts={"timeout": timeout}
    )
    return control


def partial_rounds(optimizer: hivemind.Optimizer) -> int:
    """Parameter rounds so far in which some averaged part did not come back: this peer kept its own values for it,
    so its parameters differ from those of the round's other peers."""
    return optimizer.state_averager.partial_rounds


def round_ledgers(optimizer: hivemind.Optimizer) -> dict[str, dict[str, float]]:
    """Each averager's rounds so far (`RoundLedger`): "gradients" (DiLoCo: its pseudo-gradients) and "parameters"."""
    averagers = {"gradients": getattr(optimizer, "grad_averager", None), "parameters": optimizer.state_averager}
    return {kind: averager.ledger.read() for kind, averager in averagers.items() if averager is not None}


def state_taken(optimizer: GuardedOptimizer) -> None:
    """After `take_state_of` brought a state: report this peer's new step, and let a download be due again only a
    refresh period later (hivemind's check that this peer is in sync would otherwise download it once more)."""
    report_step(optimizer, optimizer.local_epoch)
    optimizer.downloads.done(True, optimizer.tracker.max_refresh_period)


TAKE_ATTEMPTS = 3  # downloads of one named peer's state tried before giving up
TAKE_RETRY_PAUSE = 1.0  # seconds between two of them


def take_state_of(optimizer: hivemind.Optimizer, peer_id: str, step: int, timeout: float) -> bool:
    """Download the training state (parameters included) at global step `step` from peer `peer_id` (base58) alone
    and take it, waiting at most `timeout` seconds; whether it came."""
    averager = optimizer.state_averager
    # the ceiling a state may have is set afresh: the one left by this peer's last download (the swarm's step then)
    # would refuse a final state of any later step
    averager.state_step_ceiling = step
    before = averager.states_downloaded
    deadline = time.monotonic() + timeout
    # asked again (TAKE_ATTEMPTS in all, within `timeout`): a stream cut short (the sender busy, a connection reset)
    # says nothing of the state; a peer whose state failed the checks is left out, and asked no more
    for attempt in range(TAKE_ATTEMPTS):
        try:
            averager.load_state_from_peers(source=peer_id, timeout=max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        if averager.states_downloaded > before:
            return True
        left_out = {PeerID(peer).to_base58() for peer in averager.left_out_peers()}
        if peer_id in left_out or deadline - time.monotonic() < TAKE_RETRY_PAUSE + 1.0:
            return False
        if attempt + 1 < TAKE_ATTEMPTS:
            time.sleep(TAKE_RETRY_PAUSE)
    return False


def unbacked_claims(optimizer: hivemind.Optimizer) -> dict[str, int]:
    """Steps other serving peers claim beyond the swarm's step this peer follows, and beyond the usual one-step lag
    (no other peer backs them, and this one cannot vouch for their claimants), by peer id (base58)."""
    tracker = optimizer.tracker
    if not isinstance(tracker, BoundedProgressTracker):
        return {}
    followed = tracker.global_epoch
    return {PeerID(peer).to_base58(): step for peer, step in tracker.claims_ahead.items() if step > followed + 1}


def left_out_peer_names(optimizer: hivemind.Optimizer) -> set[str]:
    """The peers (base58) this peer's averagers have left out (`GuardedOptimizer`)."""
    return {PeerID(peer).to_base58() for peer in optimizer._left_out_peers()}
