"""Every use of hivemind beyond its documented API, in one place; checked against hivemind 1.1.12.

hivemind.Optimizer documents its constructor, `step()`, `zero_grad()`, `local_epoch`, `is_synchronized_with_peers()`,
`load_state_from_peers()`, `state_dict()`/`load_state_dict()`, `opt` and `shutdown()`. A trainer and the aux peer
also need what only its internals show: the swarm's progress as its ProgressTracker sees it, the master parameters
and the background rounds of its TrainingStateAverager, and the averager's matchmaking for the final parameter
round. Each function says what it relies on. After a hivemind upgrade, check these functions and nothing else:
`tests/test_stopping.py` runs them against stand-ins shaped like these internals.
"""

import re
import time
from dataclasses import dataclass
from functools import partial

import hivemind
import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.optim.grad_averager import GradientAverager
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

CHECKED_VERSION = "1.1.12"
# an `average_state_every` that no global step number is a multiple of: no parameter round at the coming steps
NO_STATE_AVERAGING = 2**62


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
    )


def wait_for_swarm_progress(optimizer: hivemind.Optimizer, timeout: float) -> None:
    """Block until the tracker has read the swarm's progress once (`tracker.fetched_global_progress_this_epoch`)."""
    optimizer.tracker.fetched_global_progress_this_epoch.wait(timeout)


def read_progress_now(optimizer: hivemind.Optimizer, timeout: float) -> bool:
    """Make the tracker read the swarm's progress from the DHT now and wait for it; False if no read came in time.

    The fetcher sleeps until `global_progress.next_fetch_time` or until `global_state_updated` is set; when woken it
    re-reads the (now past) fetch time, fetches, and sets `fetched_global_progress_this_epoch`.
    """
    tracker = optimizer.tracker
    tracker.fetched_global_progress_this_epoch.clear()
    tracker.global_progress.next_fetch_time = get_dht_time()
    tracker.global_state_updated.set()
    return tracker.fetched_global_progress_this_epoch.wait(timeout)


def step_would_be_global(optimizer: hivemind.Optimizer, batch_size: int) -> bool:
    """Would `optimizer.step(batch_size)` start a global step, by the tracker's current view? (hivemind adds the
    batch to `global_progress.samples_accumulated`, then checks `tracker.ready_to_update_epoch`.)"""
    tracker = optimizer.tracker
    progress = tracker.global_progress
    return (
        tracker.global_epoch > tracker.local_progress.epoch
        or progress.samples_accumulated + batch_size >= tracker.target_batch_size
        or get_dht_time() >= progress.eta_next_epoch
    )


def set_refresh_period(optimizer: hivemind.Optimizer, seconds: float) -> None:
    """The most seconds between two reads of the swarm's progress (`tracker.max_refresh_period`, read per fetch)."""
    optimizer.tracker.max_refresh_period = seconds


def set_bandwidth(optimizer: hivemind.Optimizer, mbit: float) -> None:
    """Declare this peer's bandwidth to both averagers; each round's matchmaking gathers `averager.bandwidth` in this
    process (DecentralizedAverager.step), and hivemind's load_balance_peers splits the all-reduce by it."""
    for averager in (optimizer.state_averager, optimizer.grad_averager):
        if averager is not None:
            averager.bandwidth = mbit


def gradient_averager_factory(**averager_opts):
    """hivemind 1.1.x gives `averager_opts` to the state averager only: the gradient averager, made by this factory
    (the documented `grad_averager_factory`), gets the same bandwidth and group size."""
    return partial(GradientAverager, **averager_opts) if averager_opts else None


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
    trainer.start_priority) but report no progress yet (`tracker.training_progress_key`, whose entries name their
    `peer_id`; a peer reports once it has trained a batch)."""
    announced = {peer for peer, priority in state_priorities(optimizer).items() if 0 < priority < 1}
    if not announced:
        return set()
    found = optimizer.dht.get(optimizer.tracker.training_progress_key, latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    reporting = {
        PeerID(entry.value["peer_id"])
        for entry in entries.values()
        if isinstance(entry.value, dict) and "peer_id" in entry.value
    }
    return announced - reporting


# how hivemind reports an averaging round's end (at the optimizer's status level, INFO with verbose=True)
GRADIENT_ROUND_FAILED = re.compile(r"^Averaging gradients failed with (.*)$")
GRADIENT_ROUND_DONE = re.compile(r"^Averaged gradients with (\d+) peers$")
STATE_ROUND_FAILED = re.compile(r"^Averaging failed with (.*)$")
ROUND_LOGGERS = ("hivemind.optim.optimizer", "hivemind.optim.state_averager")


def own_samples_per_second(optimizer: hivemind.Optimizer) -> float:
    """This peer's throughput as hivemind measures it (`tracker.performance_ema.samples_per_second`)."""
    return float(optimizer.tracker.performance_ema.samples_per_second)


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


def prefer_as_state_donor(optimizer: hivemind.Optimizer) -> None:
    """Newcomers download the state from this peer first (`state_averager.state_sharing_priority`, highest wins)."""
    optimizer.state_averager.state_sharing_priority = optimizer.local_epoch


def has_pending_updates(optimizer: hivemind.Optimizer) -> bool:
    """A background optimizer step or averaging round has not been applied yet (`state_averager.pending_updates`)."""
    return bool(optimizer.state_averager.pending_updates)


def apply_pending_updates(optimizer: hivemind.Optimizer, timeout: float) -> bool:
    """Wait for every background update and apply it to the parameters; False if one still runs after `timeout` s.

    `state_averager.step(wait_for_delayed_updates=True)` waits for each update at most the all-reduce timeout and
    then leaves it running, so it is called again until `pending_updates` is empty or the time is up.
    """
    averager = optimizer.state_averager
    deadline = time.monotonic() + timeout
    averager.step(wait_for_delayed_updates=True)
    while averager.pending_updates and time.monotonic() < deadline:
        averager.step(wait_for_delayed_updates=True)
    return not averager.pending_updates


def skip_parameter_averaging(optimizer: hivemind.Optimizer) -> None:
    """No parameter round at the coming global steps (`optimizer.average_state_every`, read at every step)."""
    optimizer.average_state_every = NO_STATE_AVERAGING


def start_parameter_round(optimizer: hivemind.Optimizer, group_bits: str, wait: float, timeout: float) -> StepControl:
    """Start one parameter all-reduce that matches only peers under `group_bits` and begins in `wait` seconds.

    Relies on: `scheduled_state`/`scheduled_grads` (rounds pre-scheduled for the next step, cancelled while still
    looking for a group: this peer will not make them), `state_averager.set_group_bits` (the matchmaking key),
    `schedule_step(scheduled_time, gather, timeout)` (hivemind makes the peer whose wait ends first the leader and
    starts the all-reduce when that wait ends; `gather` carries this peer's step to the others),
    `sync_epoch_when_averaging` (peers adopt the highest step gathered, the LR schedule with it), and
    `state_averager.step(averaging_round=True, averaging_control=..., delay_averaging=True)` (runs the round in the
    background; its result lands as a pending update). The returned control's result maps each peer to its step.
    """
    for scheduled in (optimizer.scheduled_state, optimizer.scheduled_grads):
        if scheduled is not None and scheduled.stage == AveragingStage.LOOKING_FOR_GROUP:
            scheduled.cancel()
    averager = optimizer.state_averager
    averager.set_group_bits(group_bits)
    control = averager.schedule_step(
        scheduled_time=get_dht_time() + wait, gather=optimizer.local_epoch, timeout=timeout
    )
    averager.sync_epoch_when_averaging = True
    averager.step(
        averaging_round=True, averaging_control=control, delay_averaging=True, averaging_opts={"timeout": timeout}
    )
    return control


def round_steps(control: StepControl) -> list[int] | None:
    """The steps gathered from every peer of a finished round, or None if it failed, was cancelled or is running."""
    if not control.done() or control.cancelled() or control.exception() is not None:
        return None
    return sorted(control.result().values())


def is_identity_file(path: str) -> bool:
    """Is `path` a peer identity as hivemind writes it (P2P.generate_identity): a libp2p PrivateKey protobuf holding an
    RSA key in DER? The p2p daemon itself only says "proto: cannot parse invalid wire-format data" of a bad one."""
    from cryptography.hazmat.primitives import serialization
    from google.protobuf.message import DecodeError
    from hivemind.proto import crypto_pb2

    try:
        with open(path, "rb") as f:
            key = crypto_pb2.PrivateKey.FromString(f.read())
        serialization.load_der_private_key(key.data, password=None)
    except (OSError, DecodeError, ValueError, TypeError):
        return False
    return key.key_type == crypto_pb2.KeyType.RSA


# a relayed connection is reset after this much data (bytes, each way) or time (s): the most libp2p accepts
RELAY_DATA_LIMIT = 1 << 32
RELAY_TIME_LIMIT = 3600

# p2pd flags that hivemind.P2P.create does not pass on: added to every p2p daemon this process starts, through
# `P2P._make_process_args` (its one place that turns keyword arguments into the daemon's command line)
_DAEMON_FLAGS: dict[str, object] = {}


def set_daemon_flags(**flags) -> None:
    """Extra p2pd flags for the daemons this process (and the DHT process it forks) starts from now on."""
    from hivemind.p2p.p2p_daemon import P2P

    if not getattr(P2P._make_process_args, "_sahajbert", False):
        original = P2P._make_process_args

        def make_process_args(*args, **kwargs):
            return original(*args, **{**kwargs, **_DAEMON_FLAGS})

        make_process_args._sahajbert = True
        P2P._make_process_args = staticmethod(make_process_args)
    _DAEMON_FLAGS.clear()
    _DAEMON_FLAGS.update(flags)


def relay_options(auto_relay: bool, relays: list[str], reachability: str, client_mode: bool) -> dict:
    """hivemind.DHT keyword arguments, and the p2pd flags hivemind lacks, for NAT traversal over libp2p relays.

    - A NAT'd peer books a slot on the given relays as soon as AutoNAT finds it private. p2pd's default relay
      discovery waits 3 minutes for 4 candidates; `-relayDiscovery=0` with `-trustedRelays` uses these at once.
    - Every peer that accepts connections relays (p2pd's `-relayService`, on by default) with limits sized for
      averaging: libp2p's default is 128 KiB and 2 minutes per relayed connection, which resets an all-reduce a
      fraction of the way in (a state download then ends early: "shape ... is invalid for input of size ...").
      p2pd (learning-at-home's, main.go) starts two relay services on one protocol: one with libp2p's defaults at
      start-up, and one with these limits once AutoNAT finds the peer public; the later one takes the protocol
      over. So a relay must not force its reachability public (`--reachability public` makes the two start
      together, and either may win), and libp2p's bounds hold: asked for more than its 1 h reservation or
      4 GiB, the second service fails to start (measured here with 24 h and with 1 TiB).
    """
    options: dict = {}
    flags: dict[str, object] = {"relayDataLimit": RELAY_DATA_LIMIT, "relayTimeLimit": f"{RELAY_TIME_LIMIT}s"}
    if reachability != "auto":
        options["force_reachability"] = reachability
    if auto_relay and relays and not client_mode:
        options.update(use_auto_relay=True, trusted_relays=list(relays))
        flags["relayDiscovery"] = False
    return {"dht": options, "daemon": flags}
