"""The state of one averaging round, read from hivemind's StepControl (`hivemind/averaging/control.py`)."""

import multiprocessing as mp

from hivemind.averaging.control import AveragingStage, StepControl

MATCHING_STAGES = (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
SETTLE_POLL = 0.1  # seconds between looks at a round's stage


def round_succeeded(control: StepControl) -> bool:
    """The round ended with its group's result (not cancelled, failed, or still running)."""
    return control.done() and not control.cancelled() and control.exception() is None


def still_matching(scheduled: StepControl | None) -> bool:
    return (
        scheduled is not None
        and not scheduled.done()
        and not cancel_sent(scheduled)
        and scheduled.stage in MATCHING_STAGES
    )


def cancel_sent(control: StepControl) -> bool:
    """This process has already called the round off (its cancel future is set: hivemind's StepControl.cancel)."""
    return control._cancel is not None and control._cancel.done()


def cancel_round(control: StepControl | None) -> None:
    """Call off a round this peer will not make, once. A second StepControl.cancel raises InvalidStateError (its
    cancel future is already set), and a round called off still reads "looking for a group" until the averager's
    process has seen the cancel, so a round called off (a DiLoCo outer round at the last step) may be found still
    matching by the next caller (the final parameter round's start), which must not cancel it again."""
    if control is not None and not cancel_sent(control):
        control.cancel()


def round_pending(scheduled: StepControl | None) -> bool:
    """A round scheduled ahead and not yet begun: still looking for its group, or formed and waiting for this peer."""
    return scheduled is not None and not scheduled.done() and not scheduled.triggered


def round_steps(control: StepControl) -> list[int] | None:
    """The steps gathered from every peer of a finished round, or None if it failed, was cancelled or is running."""
    if not round_succeeded(control):
        return None
    return sorted(control.result().values())


def round_peers(control: StepControl) -> set[str]:
    """The peers (base58) of a finished round, this one included; empty if it failed, was cancelled or is running."""
    return {peer.to_base58() for peer in control.result()} if round_succeeded(control) else set()


class RoundLedger:
    """An averager's rounds so far, counted in its process (matchmaking, all-reduce) and read in the process that
    made it: how long finding a group took, how large the groups were, how long their all-reduce ran."""

    FIELDS = (
        "matchmakings",  # look_for_group calls that ended (a group found or not)
        "matchmaking_seconds",  # their wall seconds together, from the call to its group (or to giving up)
        "groups",  # those that found a group (this peer's own included)
        "group_peers",  # the peers in those groups, together
        "largest_group",
        "allreduces",  # all-reduces this averager ran to their end
        "allreduce_seconds",  # their wall seconds together
    )

    def __init__(self):
        self._values = mp.Array("d", len(self.FIELDS))

    def matched(self, seconds: float, group_size: int | None) -> None:
        with self._values.get_lock():  # one update: a read sees a matchmaking with its group, or neither
            self._add(matchmakings=1, matchmaking_seconds=seconds)
            if group_size is not None:
                self._add(groups=1, group_peers=group_size)
                index = self.FIELDS.index("largest_group")
                self._values[index] = max(self._values[index], group_size)

    def reduced(self, seconds: float) -> None:
        self._add(allreduces=1, allreduce_seconds=seconds)

    def _add(self, **amounts: float) -> None:
        with self._values.get_lock():  # multiprocessing's default lock is reentrant
            for name, amount in amounts.items():
                self._values[self.FIELDS.index(name)] += amount

    def read(self) -> dict[str, float]:
        with self._values.get_lock():
            return dict(zip(self.FIELDS, self._values[:]))
