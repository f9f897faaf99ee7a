"""The stop and final-round rules, run through the hivemind fence against stand-ins for hivemind's internals, and
the fence's installation: what an upgrade of hivemind must check first (see `sahajbert.hivemind_ext`'s docstring).

The stand-ins are shaped like what `sahajbert.hivemind_ext.optim.accessors` reads (hivemind 1.1.12): the
optimizer's tracker, its pre-scheduled rounds and its state averager. Our own code runs unchanged on them. The
patches are checked against the installed hivemind itself: each name they replace exists, and holds ours.
"""

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from hivemind.averaging.control import AveragingStage
from hivemind.compression import Float16Compression, NoCompression
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from sahajbert import hivemind_ext as compat
from sahajbert.stopping import (
    FINAL_GROUP_BITS,
    FinalRound,
    joins_last_step,
    last_step_is_next,
    settle,
    should_settle,
    should_stop,
)

from .swarm_helpers import loopback_dhts, sgd_state_averager, signed_dhts


class StandInControl(Future):
    """Like hivemind's StepControl: a future of {peer: gathered step}, with a matchmaking stage."""

    def __init__(self, stage=AveragingStage.LOOKING_FOR_GROUP):
        super().__init__()
        self.stage = stage
        self._cancel = None  # hivemind's: the cancel future, set by StepControl.cancel


class StandInAverager:
    """Like hivemind's TrainingStateAverager, as far as the final round and the pending-update wait touch it."""

    def __init__(self, round_result=None, round_error=None, pending_rounds=0, rounds_land=True):
        self.calls = []
        self.round_result, self.round_error = round_result, round_error
        self.pending_updates = set(range(pending_rounds))
        self.rounds_land = rounds_land
        self.sync_epoch_when_averaging = False
        self.partial_rounds = 0  # hivemind's "received N% results" rounds, as GuardedAverager counts them

    def set_group_bits(self, bits):
        self.calls.append(("set_group_bits", bits))

    def set_target_group_size(self, size):
        self.calls.append(("set_target_group_size", size))

    def set_compression(self, codec):
        self.calls.append(("set_compression", type(codec)))

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


class StandInTracker:
    """Like hivemind's ProgressTracker: its fetcher reads the swarm's progress when woken (global_state_updated)."""

    def __init__(self, swarm, peers):
        self.global_epoch = swarm
        self.global_progress = SimpleNamespace(num_peers=peers, samples_accumulated=0, target_batch_size=64)
        self.fetched_global_progress_this_epoch = threading.Event()
        self.global_state_updated = SimpleNamespace(set=self.fetched_global_progress_this_epoch.set)


class StandInOptimizer(SimpleNamespace):
    """Shaped like GuardedOptimizer where the accessors and the final round read it, answering the loop's questions
    as a data-parallel peer does (no round in flight; a read of the progress wakes the tracker's fetcher)."""

    round_in_flight = False

    def read_progress_now(self, timeout):
        compat.request_progress_read(self.tracker)
        return self.tracker.fetched_global_progress_this_epoch.wait(timeout)

    def finish_round_in_flight(self, timeout=None):
        pass


def stand_in_optimizer(local=0, swarm=0, peers=1, gradient_stage=None, averager=None):
    scheduled_grads = None if gradient_stage is None else StandInControl(gradient_stage)
    return StandInOptimizer(
        local_epoch=local,
        tracker=StandInTracker(swarm, peers),
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


@pytest.mark.parametrize(
    "after_step, now, background, joins",
    [
        # another peer began the last step since this peer's last step (shown during the next pass or before it):
        # its round waits for us
        ((4, 4), (4, 5), True, True),
        ((4, 4), (4, 5), False, False),  # lockstep: that step was announced after its round ended
        ((4, 5), (4, 5), True, False),  # this peer lagged after its last step (a label one lower): stop on the swarm's
        ((3, 3), (3, 4), True, False),  # not the last step: the loop goes on anyway, nothing to decide
        ((5, 5), (5, 6), True, False),  # this peer is already at --max_steps
    ],
)
def test_a_peer_whose_pass_was_under_way_makes_the_last_step_with_the_others(after_step, now, background, joins):
    def at(steps):
        return compat.position(stand_in_optimizer(local=steps[0], swarm=steps[1]))

    assert joins_last_step(at(after_step), at(now), 5, rounds_in_background=background) is joins
    assert not joins_last_step(at(after_step), at(now), None, rounds_in_background=background)


@pytest.mark.parametrize(
    "stage, settles",
    [(AveragingStage.LOOKING_FOR_GROUP, True), (AveragingStage.IDLE, True), (AveragingStage.AWAITING_TRIGGER, False)],
)
def test_a_last_round_still_being_matched_is_settled_before_stopping(stage, settles):
    assert should_settle(compat.position(stand_in_optimizer(local=4, swarm=5, gradient_stage=stage)), 5) is settles
    assert not should_settle(compat.position(stand_in_optimizer(local=3, swarm=3, gradient_stage=stage)), 5)
    assert not should_settle(compat.position(stand_in_optimizer(local=4, swarm=5)), 5)


def test_a_peer_matched_while_it_settles_makes_the_last_step():
    optimizer = stand_in_optimizer(local=4, swarm=5, gradient_stage=AveragingStage.LOOKING_FOR_GROUP)

    def group_forms():  # hivemind's matchmaking runs in the averager's process and moves the stage on
        time.sleep(0.3)
        optimizer.scheduled_grads.stage = AveragingStage.AWAITING_TRIGGER

    threading.Thread(target=group_forms, daemon=True).start()
    compat.settle_gradient_round(optimizer, timeout=60, interrupted=lambda: False)
    assert not optimizer.scheduled_grads.cancelled()
    assert should_stop(compat.position(optimizer), max_steps=5) is False


@pytest.mark.parametrize("interrupted", [False, True])
def test_a_round_still_unmatched_when_settling_ends_is_cancelled(interrupted):
    optimizer = stand_in_optimizer(local=4, swarm=5, gradient_stage=AveragingStage.LOOKING_FOR_GROUP)
    compat.settle_gradient_round(optimizer, timeout=60 if interrupted else 0.3, interrupted=lambda: interrupted)
    assert optimizer.scheduled_grads.cancelled()  # no group can form later around a part this peer will not send
    assert should_stop(compat.position(optimizer), max_steps=5)


@pytest.mark.parametrize("local, swarm, expected", [(3, 3, False), (4, 4, True), (3, 5, True), (0, 0, False)])
def test_the_last_step_is_known_in_advance(local, swarm, expected):
    assert last_step_is_next(compat.position(stand_in_optimizer(local=local, swarm=swarm)), max_steps=5) is expected


@pytest.mark.parametrize("peers_now, recent_peers, needed", [(1, 1, False), (1, 2, True), (2, 0, True)])
def test_the_final_round_is_skipped_only_by_a_peer_that_was_always_alone(peers_now, recent_peers, needed):
    assert FinalRound.needed(peers_now, recent_peers) is needed


@pytest.mark.parametrize(
    "counts, expected",
    [([3, 3, 3, 2], 3), ([3, 2, 2, 2], 2), ([2], 2), ([], 0)],
    ids=["one-step-lapse", "left-3-steps-ago", "one-step", "no-step"],
)
def test_the_final_round_expects_the_most_peers_of_the_recent_steps(counts, expected):
    # a slow peer's record lapsing at the last step must not start the round without it; a peer that left RECENT_STEPS
    # steps ago is no longer waited for
    assert FinalRound.recent_peers(counts) == expected


@pytest.mark.parametrize("client_mode, wait", [(False, 2.0), (True, 4.0)])
def test_the_final_round_averages_under_its_own_key_and_adopts_the_highest_step(client_mode, wait):
    peer_a, peer_b = PeerID(b"peer a"), PeerID(b"peer b")
    averager = StandInAverager(round_result={peer_a: 5, peer_b: 6})
    optimizer = stand_in_optimizer(
        local=5, swarm=6, peers=2, gradient_stage=AveragingStage.LOOKING_FOR_GROUP, averager=averager
    )
    optimizer.scheduled_state = StandInControl(AveragingStage.AWAITING_TRIGGER)
    final_round = FinalRound(window=2.0, client_mode=client_mode, averaging_timeout=3.0)
    assert final_round.run(optimizer, recent_peers=2) == 2
    assert averager.calls[0] == ("set_group_bits", FINAL_GROUP_BITS)
    assert averager.calls[1] == ("set_target_group_size", 2), "it starts once the two peers are in its group"
    assert averager.calls[2] == ("set_compression", NoCompression), "it sends fp32, whatever the run's codec"
    name, waits, gathered, timeout = averager.calls[3]
    # a client-mode peer waits twice the window, so that it can follow a leader that comes up to a window later
    assert name == "schedule_step" and waits == pytest.approx(wait, abs=0.5) and gathered == 5
    assert timeout == wait + 3.0
    assert averager.calls[4] == ("step", True, True) and averager.sync_epoch_when_averaging
    assert optimizer.scheduled_grads.cancelled(), "a round still looking for a group is one this peer will not make"
    assert not optimizer.scheduled_state.cancelled(), "a matched round is left to finish"
    assert final_round.group == {peer_a.to_base58(), peer_b.to_base58()} and final_round.complete


def test_a_final_round_nobody_joined_keeps_the_parameters():
    averager = StandInAverager(round_error=TimeoutError("no group"))
    optimizer = stand_in_optimizer(local=5, swarm=5, peers=2, averager=averager)
    assert FinalRound(window=0.5, client_mode=False, averaging_timeout=1.0).run(optimizer, recent_peers=2) == 0


def test_a_peer_alone_does_not_wait_for_a_final_round():
    averager = StandInAverager()
    optimizer = stand_in_optimizer(local=5, swarm=5, peers=1, averager=averager)
    started = time.monotonic()
    assert FinalRound(window=30.0, client_mode=False, averaging_timeout=30.0).run(optimizer, recent_peers=1) == 0
    assert averager.calls == [] and time.monotonic() - started < 5.0


def test_pending_updates_are_waited_for_until_they_land_or_time_runs_out():
    assert compat.apply_pending_updates(stand_in_optimizer(averager=StandInAverager(pending_rounds=3)), timeout=5.0)
    optimizer = stand_in_optimizer(averager=StandInAverager(pending_rounds=1, rounds_land=False))
    assert not compat.apply_pending_updates(optimizer, timeout=0.2)
    assert compat.has_pending_updates(optimizer)


def test_a_final_round_starts_once_every_expected_peer_is_in_its_group():
    # two real state averagers (hivemind processes) on loopback; a window far longer than the test waits: only a
    # group that starts when it is full can finish in time
    import torch

    window = 600.0
    peers = []
    with loopback_dhts(2) as dhts:
        try:
            for index, dht in enumerate(dhts):
                # two peers' parameters a few updates apart
                parameters = [torch.nn.Parameter(torch.linspace(1.0, 2.0, 4) + 0.01 * index)]
                averager = sgd_state_averager(dht, parameters, "ending")
                peers.append((parameters, averager, stand_in_optimizer(local=3 + index, averager=averager)))
            controls = [
                compat.start_parameter_round(optimizer, FINAL_GROUP_BITS, window, window + 60, group_size=2)
                for _, _, optimizer in peers
            ]
            for control in controls:
                assert sorted(control.result(timeout=window / 4).values()) == [3, 4]
            for parameters, _, optimizer in peers:
                compat.apply_pending_updates(optimizer, timeout=30)
                assert torch.allclose(parameters[0].detach(), torch.linspace(1.0, 2.0, 4) + 0.005)
        finally:
            for _, averager, _ in peers:
                averager.shutdown()


def test_the_final_round_leaves_peers_that_drifted_apart_with_the_same_parameters_whatever_the_run_codec():
    # two real state averagers that average in fp16, as trainers do, whose values differ by up to 16 (overlapped
    # DiLoCo peers drift apart between rounds) on weights of -5,000 to 5,000 (a tiny model's grew that large at a
    # constant learning rate), through 0. hivemind returns to each peer the average minus what it received from it,
    # in the round's codec, which the peer adds to its own value: in fp16 each kept its own rounding of that
    # difference (up to 0.004 apart at a difference of 8) and of the value it sent (up to 4 at 5,000)
    import torch

    peers = []
    start = []
    with loopback_dhts(2) as dhts:
        try:
            for index, dht in enumerate(dhts):
                drift = 16.0 * torch.rand(1000, generator=torch.Generator().manual_seed(index))
                start.append(torch.linspace(-5000.0, 5000.0, 1000) + drift)
                parameters = [torch.nn.Parameter(start[-1].clone())]
                averager = sgd_state_averager(dht, parameters, "exact", compression=Float16Compression())
                peers.append((parameters, averager, stand_in_optimizer(local=3, averager=averager)))
            controls = [
                compat.start_parameter_round(optimizer, FINAL_GROUP_BITS, 600.0, 660.0, group_size=2)
                for _, _, optimizer in peers
            ]
            for control in controls:
                assert len(control.result(timeout=150)) == 2
            for _, _, optimizer in peers:
                assert compat.apply_pending_updates(optimizer, timeout=30)
            (a, *_), (b, *_) = peers
            # the same values up to fp32's rounding of the returned difference (an ulp of 4,096-8,192 is 0.0005)
            assert float((a[0] - b[0]).detach().abs().max()) <= 1e-3
            assert float((a[0].detach() - (start[0] + start[1]) / 2).abs().max()) <= 1e-3, "the average, in fp32"
        finally:
            for _, averager, _ in peers:
                averager.shutdown()


def test_the_final_rounds_peers_declare_its_end_in_the_runs_schema():
    # a trainer stays up after its final round until every peer of its group declared its own round ended: a record
    # the run's validators refused would hold each trainer for a round timeout at every run's end
    from sahajbert.records import FinishedRecord, declare_finished, fetch_finished

    run_id = "ending"

    def record(step, peer, **kwargs):
        return FinishedRecord(step=step, peer_id=peer, complete=True, serves_state=True, **kwargs)

    with signed_dhts(run_id, 2) as ((first, first_key), (second, second_key)):
        assert fetch_finished(second, run_id, 5) == []
        assert declare_finished(first, run_id, first_key, record(5, "a"))
        assert declare_finished(second, run_id, second_key, record(4, "b"))
        assert fetch_finished(second, run_id, 5) == [record(5, "a")], (
            "a declaration at another step is not this round's"
        )
        assert declare_finished(second, run_id, second_key, record(5, "b"))
        assert sorted(r.peer_id for r in fetch_finished(first, run_id, 5)) == ["a", "b"]
        assert declare_finished(second, run_id, second_key, record(5, "b", adopted=True))
        assert [r.adopted for r in fetch_finished(first, run_id, 5) if r.peer_id == "b"] == [True], "a later one wins"
        negative = {**record(5, "b").dict(), "step": -1}
        assert not second.store(f"{run_id}_finished", negative, get_dht_time() + 60, subkey=second_key), "schema"


def finished(peer, complete=True, serves_state=True):
    from sahajbert.records import FinishedRecord

    return FinishedRecord(step=8, peer_id=peer, complete=complete, serves_state=serves_state)


@pytest.mark.parametrize(
    "records, source, takers",
    [
        # every part came back everywhere: one average already
        ([finished("A"), finished("B"), finished("C")], None, set()),
        # a complete peer holds the average: only the partial ones take it (the lowest complete id, on every peer)
        (
            [finished("A", complete=False), finished("B"), finished("C"), finished("D", complete=False)],
            "B",
            {"A", "D"},
        ),
        # all partial (two NAT'd trainers whose streams through the relay stalled): everyone takes the lowest id's
        ([finished("B", complete=False), finished("A", complete=False)], "A", {"B"}),
        # the source must serve its state (not a client-mode peer); a complete client takes nothing from a complete one
        ([finished("A", serves_state=False), finished("B", complete=False), finished("C")], "C", {"B"}),
        # the only complete peer cannot serve: a partial server is the source and everyone else takes its parameters
        ([finished("A", serves_state=False), finished("B", complete=False)], "B", {"A"}),
        # nobody serves: nothing can be done
        ([finished("A", complete=False, serves_state=False), finished("B", serves_state=False)], None, set()),
    ],
)
def test_a_final_round_that_came_back_partial_settles_on_one_peers_parameters(records, source, takers):
    settlement = settle(records)
    assert settlement.source == source and settlement.takers == takers
    assert settle(list(reversed(records))) == settlement, "the same on every peer, whatever order it reads them in"


def installed_value(patch):
    return patch.owner[patch.name] if isinstance(patch.owner, dict) else getattr(patch.owner, patch.name)


def is_ours(patch) -> bool:
    made = patch.make()
    if isinstance(made, staticmethod):
        return installed_value(patch) is made.__func__
    if isinstance(made, type):
        return installed_value(patch) is made
    return type(installed_value(patch)) is type(made)  # a codec instance


def test_install_applies_every_patch_once_and_keeps_the_policies():
    from sahajbert import robust
    from sahajbert.flags import MAX_RECORD_LIFETIME
    from sahajbert.hivemind_ext import patches, policy

    # installed for the session by conftest.py, as a peer installs it when it joins
    assert all(is_ours(patch) for patch in patches.PATCHES), [p.replaces for p in patches.PATCHES if not is_ours(p)]
    before = [installed_value(patch) for patch in patches.PATCHES]
    compat.install(rules=robust, max_record_lifetime=MAX_RECORD_LIFETIME)
    assert [installed_value(patch) for patch in patches.PATCHES] == before  # idempotent: nothing made anew
    assert policy.rules() is robust and policy.max_record_lifetime() == MAX_RECORD_LIFETIME


def test_install_refuses_a_hivemind_other_than_the_one_the_fence_follows(monkeypatch):
    import hivemind

    from sahajbert.cli import UserError
    from sahajbert.swarm import install_hivemind_ext

    monkeypatch.setattr(hivemind, "__version__", "1.1.13")
    with pytest.raises(compat.UnsupportedHivemind, match="pip install hivemind==1.1.12"):
        compat.install(rules=None, max_record_lifetime=1.0)
    with pytest.raises(UserError, match="hivemind 1.1.13 is installed"):
        install_hivemind_ext()
