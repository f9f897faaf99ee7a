"""How a trainer ends: whether to stop now (the rules of sahajbert.stopping), the final round with the trainers that
stop at --max_steps with it, and staying up until its groupmates and an aux peer have what they need from it."""

import logging
import time
from concurrent.futures import Future

from sahajbert import records
from sahajbert.adaptive import Timing
from sahajbert.hivemind_ext.optim import accessors
from sahajbert.peer_context import PeerContext
from sahajbert.signals import StopRequest
from sahajbert.stopping import (
    FRESH_READ_TIMEOUT,
    FinalRound,
    joins_last_step,
    last_step_is_next,
    settle,
    should_settle,
    should_stop,
)

# the trainer's lines keep the trainer's logger name, whichever of its parts says them: users filter on it
logger = logging.getLogger("sahajbert.trainer")
# matchmaking times a peer that would stop waits for its last gradient round to be matched or fail (the leader's
# matchmaking time counts from the leader's step, which came first)
SETTLE_MATCHMAKING_TIMES = 2
# seconds between reads of the final round's declarations while a peer waits for its groupmates' (one DHT get each)
FINISHED_POLL_PERIOD = 0.5
# seconds a trainer that ended the run waits, beyond an aux peer's own refresh period, for that aux peer to have saved
# the final model (it downloads it from a trainer, at most a state download's time)
ARCHIVE_WAIT_MARGIN = 10.0
# seconds a trainer waits for its last metrics record (its end) to be stored before it leaves
LAST_RECORD_WAIT = 10.0


class Ending:
    """When a trainer stops, and how it ends the run with the others: with --max_steps and a final averaging window,
    trainers that reach the last step average their parameters once more (sahajbert.stopping.FinalRound)."""

    def __init__(
        self,
        context: PeerContext,
        timing: Timing,
    ):
        self.optimizer, self.dht, self.public_key = context.optimizer, context.dht, context.public_key
        peer_args = context.peer_args
        self.run_id, self.max_steps = peer_args.swarm_args.run_id, peer_args.training_args.max_steps
        self.timing = timing
        self.final_round = (
            FinalRound(timing.final_averaging_window, self.dht.client_mode, timing.averaging_timeout)
            if self.max_steps is not None and timing.final_averaging_window > 0
            else None
        )

    def should_stop(self, after_step: accessors.SwarmPosition, stop: StopRequest) -> bool:
        """Whether to stop now; `after_step`: where things stood after this peer's last step (or its start)."""
        max_steps = self.max_steps
        position = accessors.position(self.optimizer)
        in_background = accessors.gradient_rounds_in_background(self.optimizer)
        if joins_last_step(after_step, position, max_steps, in_background):
            return False
        if should_settle(position, max_steps):
            timeout = SETTLE_MATCHMAKING_TIMES * self.timing.matchmaking_time
            accessors.settle_gradient_round(self.optimizer, timeout, interrupted=lambda: bool(stop))
            position = accessors.position(self.optimizer)  # settling changed the round's stage
        if should_stop(position, max_steps) and position.local_step < max_steps:
            # stopping on the other peers' word: only on a fresh read. The last one may predate this peer's last
            # round, which changes whom it counts (peers vouched for, peers left out), and a stop cannot be undone
            self.optimizer.read_progress_now(FRESH_READ_TIMEOUT)
            position = accessors.position(self.optimizer)
        return should_stop(position, max_steps)

    def before_step(self) -> None:
        """Before a step that may be the run's last global step: when a final round follows, that step makes no
        parameter round (a background round still pending would hold this peer back from the final round, or pair
        with another peer's final round and be triggered late)."""
        if self.final_round is not None and last_step_is_next(accessors.position(self.optimizer), self.max_steps):
            accessors.skip_parameter_averaging(self.optimizer)

    def end_with_the_others(self, peer_counts: list[int]) -> None:
        """The final round, if this run has one, and the settlement after it; `peer_counts`: the peers counted at
        each of this peer's global steps, in order."""
        if self.final_round is None:
            return
        self.final_round.run(self.optimizer, FinalRound.recent_peers(peer_counts))
        self._end_together(self.final_round.group, self.final_round.complete)

    def wait_for_archive(self) -> None:
        """After a final round, a peer that serves its state stays up for an aux peer saving the final model."""
        if self.final_round is not None and not self.dht.client_mode:
            self._wait_for_archive(self.optimizer.local_epoch)

    @staticmethod
    def wait_for_record(last_record: Future) -> None:
        """Wait for this peer's last metrics record to be stored, at most LAST_RECORD_WAIT seconds."""
        try:
            last_record.result(timeout=LAST_RECORD_WAIT)
        except Exception as e:  # the monitors then see this peer depart instead: worth a line, not a failure
            logger.info(f"could not store this peer's last record for the monitors: {type(e).__name__}")

    def _end_together(self, group: set[str], complete: bool) -> None:
        """Declare that this peer's final round ended (and whether all its parts came back), then stay up until the
        other peers of its `group` (base58 peer ids, this one's included) have declared the same, at most one round
        timeout. A round ends here once this peer's own averaged parts have arrived, while the parts it averaged for
        slower groupmates may still be on their way; had its process (and p2p daemon) exited then, a groupmate on a
        slow link would end with partial results and parameters of its own (benchmarks/README.md, netswarm).

        If a part came back partial to any peer, the peers settle on one peer's parameters (`stopping.settle`): the
        others download its state, and it stays up serving it until they declare they have it, at most one state
        download: streams through a relay can stall, and then each peer gets only its own parts back. Only the
        records of the round's peers count, less any
        peer this one has left out (a peer caught returning implausible averages could name itself the source)."""
        run_id, step = self.run_id, self.optimizer.local_epoch
        own = records.FinishedRecord(
            step=step, peer_id=self.dht.peer_id.to_base58(), complete=complete, serves_state=not self.dht.client_mode
        )
        records.declare_finished(self.dht, run_id, self.public_key, own)
        if len(group) < 2:
            return
        groupmates = group - accessors.left_out_peer_names(self.optimizer)
        finished = self._await_final_records(
            groupmates,
            lambda finished: len(finished) >= len(groupmates),
            self.timing.averaging_timeout,
            "not every peer of the final round said its round ended: leaving anyway",
        )
        settlement = settle(finished)
        if own.peer_id in settlement.takers:
            if accessors.take_state_of(self.optimizer, settlement.source, step, self.timing.load_state_timeout):
                logger.info(
                    f"a part of the final round came back partial: this peer took the parameters of peer "
                    f"{settlement.source}, for one final model"
                )
                records.declare_finished(self.dht, run_id, self.public_key, own.copy(update={"adopted": True}))
            else:
                logger.warning(f"could not download the final parameters of peer {settlement.source}: keeping its own")
        elif own.peer_id == settlement.source and settlement.takers:
            logger.info("a part of the final round came back partial: serving this peer's parameters to the others")
            self._await_final_records(
                groupmates,
                lambda finished: settlement.takers <= {record.peer_id for record in finished if record.adopted},
                self.timing.load_state_timeout,
                "not every peer took this peer's final parameters: leaving anyway",
            )

    def _wait_for_archive(self, step: int) -> None:
        """If an aux peer saves the run's final model, stay up (serving this peer's state) until it has saved the model
        of `step`, at most a state download's time after its next look."""
        run_id = self.run_id
        archives = records.fetch_archives(self.dht, run_id)
        if not archives:
            return
        deadline = time.monotonic() + self.timing.load_state_timeout + max(a.refresh_period for a in archives)
        deadline += ARCHIVE_WAIT_MARGIN
        logger.info(f"waiting for the aux peer to save the final model of step {step}")
        while not any(archive.step >= step for archive in records.fetch_archives(self.dht, run_id)):
            if time.monotonic() >= deadline:
                logger.info("the aux peer did not say it saved the final model: leaving anyway")
                return
            time.sleep(FINISHED_POLL_PERIOD)

    def _await_final_records(
        self, peers: set[str], done, timeout: float, giving_up: str
    ) -> list[records.FinishedRecord]:
        """Poll the final round's declarations of `peers` at this peer's step until `done(declared)`, at most
        `timeout` seconds (then log `giving_up`); the declarations last read."""
        run_id, step = self.run_id, self.optimizer.local_epoch
        deadline = time.monotonic() + timeout

        def read() -> list[records.FinishedRecord]:
            return [record for record in records.fetch_finished(self.dht, run_id, step) if record.peer_id in peers]

        while not done(declared := read()):
            if time.monotonic() >= deadline:
                logger.info(giving_up)
                break
            time.sleep(FINISHED_POLL_PERIOD)
        return declared
