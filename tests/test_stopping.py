"""The stop and final-round rules, run through the hivemind adapter against stand-ins for hivemind's internals.

The stand-ins are shaped like what `sahajbert.hivemind_compat` reads (hivemind 1.1.12): the optimizer's tracker,
its pre-scheduled rounds and its state averager. Our own code runs unchanged on them.
"""

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time

from sahajbert import hivemind_compat as compat
from sahajbert.stopping import FINAL_GROUP_BITS, FinalRound, last_step_is_next, should_stop


class StandInControl(Future):
    """Like hivemind's StepControl: a future of {peer: gathered step}, with a matchmaking stage."""

    def __init__(self, stage=AveragingStage.LOOKING_FOR_GROUP):
        super().__init__()
        self.stage = stage


class StandInAverager:
    """Like hivemind's TrainingStateAverager, as far as the final round and the pending-update wait touch it."""

    def __init__(self, round_result=None, round_error=None, pending_rounds=0, rounds_land=True):
        self.calls = []
        self.round_result, self.round_error = round_result, round_error
        self.pending_updates = set(range(pending_rounds))
        self.rounds_land = rounds_land
        self.sync_epoch_when_averaging = False

    def set_group_bits(self, bits):
        self.calls.append(("set_group_bits", bits))

    def schedule_step(self, scheduled_time, gather, timeout):
        self.calls.append(("schedule_step", scheduled_time - get_dht_time(), gather, timeout))
        self.control = StandInControl()
        return self.control

    def step(self, wait_for_delayed_updates=False, averaging_round=False, averaging_control=None, **kwargs):
        if wait_for_delayed_updates:
            if self.pending_updates and self.rounds_land:
                self.pending_updates.pop()  # hivemind's wait gives up after one round's timeout: one lands per call
            return
        self.calls.append(("step", averaging_round, kwargs.get("delay_averaging")))
        control = averaging_control

        def finish():  # the round ends a moment later, in the background, as hivemind's does
            time.sleep(0.2)
            control.set_exception(self.round_error) if self.round_error else control.set_result(self.round_result)

        threading.Thread(target=finish, daemon=True).start()


def stand_in_optimizer(local=0, swarm=0, peers=1, gradient_stage=None, averager=None):
    scheduled_grads = None if gradient_stage is None else StandInControl(gradient_stage)
    return SimpleNamespace(
        local_epoch=local,
        tracker=SimpleNamespace(
            global_epoch=swarm,
            global_progress=SimpleNamespace(num_peers=peers, samples_accumulated=0, target_batch_size=64),
        ),
        scheduled_grads=scheduled_grads,
        scheduled_state=None,
        state_averager=averager or StandInAverager(),
    )


@pytest.mark.parametrize(
    "local, swarm, stage, expected",
    [
        (3, 3, None, False),  # the swarm is not at step 5 yet
        (5, 5, None, True),  # everyone is there
        (4, 5, None, True),  # a lagging label: stop on the swarm's step, not with a lonely catch-up step
        (4, 5, AveragingStage.AWAITING_TRIGGER, False),  # matched into the last round: make it with the others
        (4, 5, AveragingStage.LOOKING_FOR_GROUP, True),  # not matched yet: nobody waits for this peer
    ],
)
def test_a_trainer_stops_when_the_swarm_reaches_max_steps(local, swarm, stage, expected):
    position = compat.position(stand_in_optimizer(local=local, swarm=swarm, gradient_stage=stage))
    assert should_stop(position, max_steps=5) is expected
    assert should_stop(position, max_steps=None) is False


def test_a_finished_gradient_round_holds_nobody_back():
    optimizer = stand_in_optimizer(local=4, swarm=5, gradient_stage=AveragingStage.AWAITING_TRIGGER)
    optimizer.scheduled_grads.set_result({})
    assert should_stop(compat.position(optimizer), max_steps=5)


@pytest.mark.parametrize("local, swarm, expected", [(3, 3, False), (4, 4, True), (3, 5, True), (0, 0, False)])
def test_the_last_step_is_known_in_advance(local, swarm, expected):
    assert last_step_is_next(compat.position(stand_in_optimizer(local=local, swarm=swarm)), max_steps=5) is expected


@pytest.mark.parametrize("peers_now, last_step_peers, needed", [(1, 1, False), (1, 2, True), (2, 0, True)])
def test_the_final_round_is_skipped_only_by_a_peer_that_was_always_alone(peers_now, last_step_peers, needed):
    assert FinalRound.needed(peers_now, last_step_peers) is needed


@pytest.mark.parametrize("client_mode, wait", [(False, 2.0), (True, 4.0)])
def test_the_final_round_averages_under_its_own_key_and_adopts_the_highest_step(client_mode, wait):
    averager = StandInAverager(round_result={"peer a": 5, "peer b": 6})
    optimizer = stand_in_optimizer(
        local=5, swarm=6, peers=2, gradient_stage=AveragingStage.LOOKING_FOR_GROUP, averager=averager
    )
    optimizer.scheduled_state = StandInControl(AveragingStage.AWAITING_TRIGGER)
    final_round = FinalRound(window=2.0, client_mode=client_mode, averaging_timeout=3.0)
    assert final_round.run(optimizer, last_step_peers=2) == 2
    assert averager.calls[0] == ("set_group_bits", FINAL_GROUP_BITS)
    name, waits, gathered, timeout = averager.calls[1]
    # a client-mode peer waits twice the window, so that it can follow a leader that comes up to a window later
    assert name == "schedule_step" and waits == pytest.approx(wait, abs=0.5) and gathered == 5
    assert timeout == wait + 3.0
    assert averager.calls[2] == ("step", True, True) and averager.sync_epoch_when_averaging
    assert optimizer.scheduled_grads.cancelled(), "a round still looking for a group is one this peer will not make"
    assert not optimizer.scheduled_state.cancelled(), "a matched round is left to finish"


def test_a_final_round_nobody_joined_keeps_the_parameters():
    averager = StandInAverager(round_error=TimeoutError("no group"))
    optimizer = stand_in_optimizer(local=5, swarm=5, peers=2, averager=averager)
    assert FinalRound(window=0.5, client_mode=False, averaging_timeout=1.0).run(optimizer, last_step_peers=2) == 0


def test_a_peer_alone_does_not_wait_for_a_final_round():
    averager = StandInAverager()
    optimizer = stand_in_optimizer(local=5, swarm=5, peers=1, averager=averager)
    started = time.monotonic()
    assert FinalRound(window=30.0, client_mode=False, averaging_timeout=30.0).run(optimizer, last_step_peers=1) == 0
    assert averager.calls == [] and time.monotonic() - started < 5.0


def test_pending_updates_are_waited_for_until_they_land_or_time_runs_out():
    assert compat.apply_pending_updates(stand_in_optimizer(averager=StandInAverager(pending_rounds=3)), timeout=5.0)
    optimizer = stand_in_optimizer(averager=StandInAverager(pending_rounds=1, rounds_land=False))
    assert not compat.apply_pending_updates(optimizer, timeout=0.2)
    assert compat.has_pending_updates(optimizer)
