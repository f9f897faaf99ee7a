"""Every use of hivemind beyond its documented API, in one package (the fence); checked against hivemind 1.1.12.

hivemind.Optimizer documents its constructor, `step()`, `zero_grad()`, `local_epoch`, `is_synchronized_with_peers()`,
`load_state_from_peers()`, `state_dict()`/`load_state_dict()`, `opt` and `shutdown()`. A trainer and the aux peer
also need what only its internals show: the swarm's progress as its ProgressTracker sees it, the master parameters
and the background rounds of its TrainingStateAverager, and the averager's matchmaking for the final parameter
round. The rest of the package reaches hivemind only through the documented API and this package
(tests/test_code_shape.py holds the allowlist); this package imports nothing else of the project: the project's
policies (the robust rules, the record lifetime, the access gate, the aggregation rule, the waits) are passed in,
to `install()` or to the constructors.

By concern, as hivemind splits its own code:
- `patches`: every global replacement of hivemind code, listed with what it replaces, applied by `install()`;
- `compression`: the fixed 8-bit codecs; `p2p`: the stream-message bound, p2pd flags, our protocols' handlers;
  `identity`: identity files and peer ids of keys;
- `dht`: bounded records (`storage`), bounded requests per caller (`protocol`), the DHT process (`process`);
- `averaging`: round states (`control`), matchmaking, the robust all-reduce (`allreduce`), the guarded averagers
  (`averager`: admission, checked state downloads, vouching);
- `optim`: the bounded progress tracker (`progress`), GuardedOptimizer (`optimizer`), DiLoCo (`diloco`), and the
  accessors the trainer, the aux peer and the stopping rules ask (`accessors`).

After a hivemind upgrade, check these and nothing else (then set CHECKED_VERSION and requirements.txt's pin):
1. each entry of `patches.PATCHES`: the name it replaces still exists and is still looked up where it says;
2. the bodies copied from hivemind, each of which names its source in its docstring:
   `p2p._bounded_receive_raw_data`, `p2p.make_process_args`, `compression._FixedExtract.extract`,
   `compression.Uniform8Bit.quantize`, `averaging.averager.GuardedAverager._run_allreduce_inplace_`,
   `GuardedAverager._load_state_from_peers` and `_download_state_from`,
   `GuardedStateAverager._apply_optimizer_parameters_`, `optim.progress.BoundedProgressTracker._progress_fetcher`,
   `optim.optimizer.GuardedOptimizer.load_state_from_peers`, `_make_progress_tracker`, `_make_state_averager`,
   `optim.diloco.DiLoCoOptimizer._load_local_gradients_into_optimizer`;
3. the internals the other classes and functions read, each named in its docstring: `optim.accessors` (run against
   stand-ins shaped like these internals by `tests/test_stopping.py`), the all-reduce runner's and reducer's
   fields (`averaging.allreduce`), the matchmaking's (`averaging.matchmaking`), the DHT's (`dht`).
`tests/test_stopping.py` runs the accessors and the patches' installation; tests/test_bounds.py, test_robust.py and
test_training_parts.py run the rest against real hivemind objects.
"""

import hivemind

from sahajbert.hivemind_ext import patches, policy
from sahajbert.hivemind_ext.averaging.averager import GuardedAverager, GuardedGradientAverager, GuardedStateAverager
from sahajbert.hivemind_ext.averaging.control import cancel_round, round_peers, round_steps
from sahajbert.hivemind_ext.dht.process import GuardedDHT, drain_dht_calls
from sahajbert.hivemind_ext.dht.protocol import requests_served
from sahajbert.hivemind_ext.optim.accessors import (
    GRADIENT_ROUND_DONE,
    GRADIENT_ROUND_FAILED,
    ROUND_LOGGERS,
    STATE_ROUND_FAILED,
    SwarmPosition,
    apply_pending_updates,
    follow_schedule,
    gradient_rounds_in_background,
    has_pending_updates,
    left_out_peer_names,
    master_parameters,
    own_samples_per_second,
    own_state_priority,
    partial_rounds,
    position,
    progress_peers,
    report_step,
    round_ledgers,
    set_bandwidth,
    set_refresh_period,
    set_state_priority,
    set_step,
    settle_gradient_round,
    skip_parameter_averaging,
    start_parameter_round,
    starting_peers,
    state_priorities,
    state_taken,
    take_state_of,
    unbacked_claims,
    wait_for_swarm_progress,
)
from sahajbert.hivemind_ext.optim.diloco import NOTE_PERIOD, DiLoCoOptimizer
from sahajbert.hivemind_ext.optim.optimizer import GuardedOptimizer, gradient_averager_factory
from sahajbert.hivemind_ext.optim.progress import BoundedProgressTracker, request_progress_read

CHECKED_VERSION = "1.1.12"  # the hivemind release the patches and the copied bodies follow (requirements.txt pins it)


class UnsupportedHivemind(RuntimeError):
    """The installed hivemind is not the release the fence was checked against."""


def install(*, rules, max_record_lifetime: float) -> None:
    """Make this process (and the DHT and averager processes it starts afterwards) use the fence: check hivemind's
    version, keep the project's policies for the fence's mechanisms, and apply `patches.PATCHES` (once: a second
    call only updates the policies). A peer calls it when it joins, before it starts its DHT.

    `rules`: the robust rules the averagers and the progress tracker apply (`sahajbert.robust`; see
    `policy.rules`); `max_record_lifetime`: seconds, the longest a DHT record another peer stores is kept here.
    Raises UnsupportedHivemind (one line, what to install) if hivemind is not CHECKED_VERSION.
    """
    installed = getattr(hivemind, "__version__", "unknown")
    if installed != CHECKED_VERSION:
        raise UnsupportedHivemind(
            f"hivemind {installed} is installed, but this code relies on hivemind {CHECKED_VERSION}'s internals "
            f"(sahajbert/hivemind_ext): pip install hivemind=={CHECKED_VERSION}"
        )
    policy.give(rules=rules, max_record_lifetime=float(max_record_lifetime))
    patches.apply()


__all__ = [
    "CHECKED_VERSION",
    "UnsupportedHivemind",
    "install",
    "BoundedProgressTracker",
    "DiLoCoOptimizer",
    "GuardedAverager",
    "GuardedDHT",
    "GuardedGradientAverager",
    "GuardedOptimizer",
    "GuardedStateAverager",
    "NOTE_PERIOD",
    "GRADIENT_ROUND_DONE",
    "GRADIENT_ROUND_FAILED",
    "ROUND_LOGGERS",
    "STATE_ROUND_FAILED",
    "SwarmPosition",
    "apply_pending_updates",
    "cancel_round",
    "drain_dht_calls",
    "follow_schedule",
    "gradient_averager_factory",
    "gradient_rounds_in_background",
    "has_pending_updates",
    "left_out_peer_names",
    "master_parameters",
    "own_samples_per_second",
    "own_state_priority",
    "partial_rounds",
    "position",
    "report_step",
    "requests_served",
    "round_ledgers",
    "request_progress_read",
    "round_peers",
    "round_steps",
    "set_bandwidth",
    "set_refresh_period",
    "set_state_priority",
    "set_step",
    "settle_gradient_round",
    "skip_parameter_averaging",
    "start_parameter_round",
    "progress_peers",
    "starting_peers",
    "state_priorities",
    "state_taken",
    "take_state_of",
    "unbacked_claims",
    "wait_for_swarm_progress",
]
