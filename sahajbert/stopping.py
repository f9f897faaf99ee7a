"""When a trainer stops at --max_steps, and how the trainers that stop together end with one model."""

import logging
import time
from dataclasses import dataclass, field

from sahajbert.hivemind_ext.averaging.control import round_peers, round_steps
from sahajbert.hivemind_ext.optim import accessors
from sahajbert.hivemind_ext.optim.accessors import SwarmPosition
from sahajbert.hivemind_ext.optim.optimizer import GuardedOptimizer
from sahajbert.records import FinishedRecord

logger = logging.getLogger(__name__)
# seconds a peer waits for a fresh read of the swarm's progress before a global step it would start or the final round
FRESH_READ_TIMEOUT = 10.0
FINAL_GROUP_BITS = "1"  # the final round's own matchmaking key: it never pairs with another peer's regular round


def pending_update_timeout(averaging_timeout: float) -> float:
    """Seconds to wait for background rounds still running before parameters are saved, restored or averaged once
    more: twice the all-reduce timeout, since hivemind's own wait gives up after one."""
    return 2 * averaging_timeout


def swarm_reached(position: SwarmPosition, max_steps: int | None) -> bool:
    """Whether the SWARM is at --max_steps, not only this peer.

    A peer whose step labels lag one behind the others' (it joined or caught up while they stepped) would otherwise
    see the swarm ahead, step at once to catch up, find no one left to average with and make a last step alone.
    Stopping on the swarm's step ends it on the same all-reduce as the rest, under a label one lower.
    """
    return max_steps is not None and max(position.local_step, position.swarm_step) >= max_steps


def should_stop(position: SwarmPosition, max_steps: int | None) -> bool:
    """The swarm reached --max_steps, and no gradient round this peer was matched into waits for its part.

    hivemind groups peers for a step's all-reduce in advance: when another peer's step takes the swarm to the last
    step while this one still computes, this peer makes that step too, or the group would wait for its part until
    next_chunk_timeout and the two would end one update apart.
    """
    return swarm_reached(position, max_steps) and not position.gradient_round_waiting


def joins_last_step(
    after_step: SwarmPosition, now: SwarmPosition, max_steps: int | None, rounds_in_background: bool
) -> bool:
    """Another peer's step took the swarm to the last step since this peer's last step, after which it was level.

    With gradient rounds in the background (delayed updates) a peer announces its step as the round starts: this
    peer's samples counted toward that step, and the other peer's round keeps looking for a group until the round
    timeout after its step, so this peer makes the step too, in that round (stopping instead left the other alone in
    it until that timeout, then stepping with its own gradients). The step may show during this peer's next pass or
    before it begins (a tracker's view is up to a refresh period old, so a step taken during the pass that just ended
    can show only after this peer's own step call): both count. In lockstep the step is announced after its round
    has ended. A peer whose step lagged after its last step (`swarm_reached`) stops as before.
    """
    return (
        rounds_in_background
        and max_steps is not None
        and after_step.swarm_step <= after_step.local_step == now.local_step < max_steps
        and now.swarm_step == now.local_step + 1 == max_steps
    )


def should_settle(position: SwarmPosition, max_steps: int | None) -> bool:
    """The swarm reached --max_steps while this peer's gradient round for that step is still being matched.

    Another peer's step can take the swarm to the last step before hivemind has matched the round it pre-scheduled
    here; stopping at once would leave the group that then forms around this peer waiting for its part. Settle the
    round first (`accessors.settle_gradient_round`): once matched, `should_stop` makes the peer take that step too.
    """
    return swarm_reached(position, max_steps) and position.gradient_round_matching


def last_step_is_next(position: SwarmPosition, max_steps: int | None) -> bool:
    """The coming global step is the run's last (hivemind numbers it one past the higher of both steps)."""
    return max_steps is not None and max(position.local_step + 1, position.swarm_step) >= max_steps


# global steps over which the final round counts the swarm's peers (a slow peer's record can lapse for one of them)
RECENT_STEPS = 3


class FinalRound:
    """One last parameter average among the trainers that stop at --max_steps, so that they end with one model.

    With delayed parameter updates each peer applies the run's last update on its own, after its loop, and the
    parameter averaging that pulls peers together during a run happens inside the next global step, which the last
    step does not have. hivemind's matchmaking makes the peer whose wait ends first the leader and starts the
    all-reduce when that wait ends, so every peer that arrives within `window` seconds of the first joins one group.
    The round matches under its own key and the last global step makes no regular parameter round (see the
    trainer), so a slower peer's regular round, triggered late, never pairs with it and gives partial results.

    The round starts before its window ends once its group holds as many peers as the swarm had at any of this
    peer's last RECENT_STEPS steps or has now, whichever is most (a run's end then takes seconds, not a window, when
    every peer is there). Otherwise it waits out its window: the progress tracker cannot tell whether another peer is
    still coming, since hivemind stops reporting a peer that caught up by downloading the state at the last step, and
    a count taken while a slow peer's record had lapsed is one short (a group started without that peer leaves it
    with other parameters).
    """

    def __init__(self, window: float, client_mode: bool, averaging_timeout: float):
        self.window = window
        # a client-mode peer cannot lead a group, and a leader takes only followers whose own wait ends after its
        # own: waiting twice the window lets a client join a leader that arrives up to `window` after it
        self.wait = 2 * window if client_mode else window
        self.timeout = self.wait + averaging_timeout
        self.pending_update_timeout = pending_update_timeout(averaging_timeout)

    @staticmethod
    def needed(peers_now: int, recent_peers: int) -> bool:
        """Skip the round only for a peer that was alone both at its recent global steps and now."""
        return max(peers_now, recent_peers) >= 2

    @staticmethod
    def recent_peers(peer_counts: list[int]) -> int:
        """The most peers counted at the last RECENT_STEPS global steps, given the counts of every step in order."""
        return max(peer_counts[-RECENT_STEPS:], default=0)

    def run(self, optimizer: GuardedOptimizer, recent_peers: int) -> int:
        """Average parameters with the peers that finish within the window; how many took part (0: none joined).
        Then `self.group` holds their peer ids (base58), and `self.complete` says whether every averaged part came
        back to this peer."""
        self.complete, self.group = True, set()
        partial_before = accessors.partial_rounds(optimizer)
        # the higher of the tracker's last view and a fresh read: a peer whose record just expired (its reports
        # held up by a slow link) may still come, and a skipped round cannot be made up for
        peers_seen = accessors.position(optimizer).peers
        optimizer.read_progress_now(FRESH_READ_TIMEOUT)
        peers_now = max(peers_seen, accessors.position(optimizer).peers)
        if not self.needed(peers_now, recent_peers):
            return 0
        expected = max(peers_now, recent_peers)
        logger.info(
            f"averaging parameters with the peers that finish within {self.window:.0f} s, for a common final model "
            f"(at once when all {expected} are there)"
        )
        control = accessors.start_parameter_round(optimizer, FINAL_GROUP_BITS, self.wait, self.timeout, expected)
        deadline = time.monotonic() + self.timeout + 5.0  # seconds: the round's own timeout ends it first
        while not control.done() and time.monotonic() < deadline:
            time.sleep(0.5)
        accessors.apply_pending_updates(optimizer, self.pending_update_timeout)
        steps = round_steps(control)
        if steps is None:
            logger.info("no other peer joined the final parameter round: this peer keeps those of its last round")
            return 0
        self.complete = accessors.partial_rounds(optimizer) == partial_before
        self.group = round_peers(control)
        logger.info(f"final parameters averaged by {len(steps)} peers (their steps: {steps})")
        return len(steps)


@dataclass(frozen=True)
class Settlement:
    """Whose parameters a final round's peers take when some part of it came back partial: each peer keeps its own
    values for the parts it missed, so they would end with different models. `source`: None when nothing is to be
    done (every part came back to every peer, or no peer serves its state); `takers`: the peers that download it."""

    source: str | None = None
    takers: frozenset[str] = field(default_factory=frozenset)


def settle(records: list[FinishedRecord]) -> Settlement:
    """The same settlement on every peer that reads the same records: the source is the lowest peer id among the
    peers that serve their state and got all their parts back (they hold the group's average), else among all that
    serve it. A complete peer takes nothing from a complete source: it holds the same average already."""
    if all(record.complete for record in records):
        return Settlement()
    source = _source(records)
    if source is None:
        return Settlement()
    takers = frozenset(
        record.peer_id
        for record in records
        if record.peer_id != source.peer_id and not (record.complete and source.complete)
    )
    return Settlement(source.peer_id, takers)


def final_source(records: list[FinishedRecord]) -> str | None:
    """The peer (base58) whose parameters are the run's final model, by `settle`'s rule (whether or not a part came
    back partial); None if none serves its state (client-mode peers only)."""
    source = _source(records)
    return None if source is None else source.peer_id


def _source(records: list[FinishedRecord]) -> FinishedRecord | None:
    """The lowest peer id among the peers that serve their state and got all their parts back, else among all that
    serve it."""
    servers = [record for record in records if record.serves_state]
    candidates = [record for record in servers if record.complete] or servers
    return min(candidates, key=lambda record: record.peer_id, default=None)
