"""The DHT traffic a peer makes while it trains: its matchmaking reads and its progress reports are paced.

Each test runs hivemind's own class beside ours on a real DHT (in its process), counting the calls that reach it.
"""

import asyncio
import time

import hivemind
import pytest
from hivemind.averaging.control import StepControl
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.timed_storage import ValueWithExpiration

from sahajbert import hivemind_ext as compat
from sahajbert.hivemind_ext.averaging.matchmaking import LEADER_READ_SECONDS, PacedLeaders
from sahajbert.hivemind_ext.optim.progress import REPORT_PACE_SECONDS
from sahajbert.localswarm import wait_for

SEARCH_SECONDS = 3.0  # how long a lone peer looks for a leader
PASSES = 20  # progress reports made one after the other, as a trainer's passes make them
PASS_SECONDS = 0.05  # the tiny model's pass on 2 cores takes about this long


class CountedDHT:
    """hivemind's DHT, counting the reads and stores that this process asks of it, by key."""

    def __init__(self, dht):
        self.dht, self.reads, self.stores = dht, {}, {}
        self.values: dict[str, list] = {}  # what each store of a key held, in order

    def __getattr__(self, name):
        return getattr(self.dht, name)

    def get(self, key, *args, **kwargs):
        self.reads[key] = self.reads.get(key, 0) + 1
        return self.dht.get(key, *args, **kwargs)

    def store(self, key, *args, **kwargs):
        self.stores[key] = self.stores.get(key, 0) + 1
        self.values.setdefault(key, []).append(kwargs.get("value"))
        return self.dht.store(key, *args, **kwargs)


@pytest.fixture(scope="module")
def dht():
    node = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield node
    node.shutdown()


async def lone_search(leaders_class, dht) -> int:
    """How many times a peer that no other peer joins reads its group key while it looks for a leader."""
    counted = CountedDHT(dht)
    key_manager = GroupKeyManager(
        counted, prefix=f"lone-{leaders_class.__name__}", initial_group_bits="", target_group_size=None
    )
    leaders = leaders_class(dht.peer_id, min_matchmaking_time=5.0, target_group_size=None)
    step = StepControl(
        scheduled_time=get_dht_time(),
        deadline=get_dht_time() + SEARCH_SECONDS,
        allow_retries=True,
        weight=1.0,
        data_for_gather=b"",
    )
    step.attach(MPFuture(), MPFuture())  # as an averager attaches its round's control
    async with leaders.begin_search(step, key_manager, declare=False):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(leaders.pop_next_leader(), SEARCH_SECONDS)
    return sum(counted.reads.values())


def test_a_peer_looking_for_a_leader_reads_its_group_key_at_a_pace(dht):
    # hivemind's search reads the key again as soon as a read ends, while the peer waits for a leader; ours reads it
    # at most every LEADER_READ_SECONDS
    plain = asyncio.run(lone_search(PotentialLeaders, dht))
    paced = asyncio.run(lone_search(PacedLeaders, dht))
    assert 1 <= paced <= SEARCH_SECONDS / LEADER_READ_SECONDS + 1, (plain, paced)
    assert plain > 2 * paced, (plain, paced)


def make_tracker(tracker_class, dht, prefix: str, target_batch_size: int = 10_000):
    counted = CountedDHT(dht)
    # no periodic read or report within the test: each read is one the test asks for
    periods = dict(min_refresh_period=600, max_refresh_period=600, default_refresh_period=600, metadata_expiration=600)
    tracker = tracker_class(dht=counted, prefix=prefix, target_batch_size=target_batch_size, start=True, **periods)
    return tracker, counted


def test_a_trainers_passes_are_published_at_a_pace_and_a_step_change_at_once(dht):
    # hivemind publishes a report after every pass (each waited for here, the control); ours, with a pass every
    # PASS_SECONDS, at most every REPORT_PACE_SECONDS (a tracker's min_refresh_period of 600 s does not slow it), the
    # last pass's samples included; a step change is published as one store of its own
    plain, counted = make_tracker(ProgressTracker, dht, "passes-plain")
    try:
        for done in range(1, PASSES + 1):
            plain.report_local_progress(0, 8 * done)
            wait_for(lambda d=done: published(dht, plain) == (0, 8 * d), 30, f"pass {done}'s report")
        assert counted.stores[plain.training_progress_key] == PASSES
    finally:
        plain.shutdown()

    tracker, counted = make_tracker(compat.BoundedProgressTracker, dht, "passes-ours")
    try:
        began = time.monotonic()
        for done in range(1, PASSES + 1):
            tracker.report_local_progress(0, 8 * done)
            time.sleep(PASS_SECONDS)  # a pass's compute
        wait_for(lambda: published(dht, tracker) == (0, 8 * PASSES), 30, "the last pass's samples")
        seconds = time.monotonic() - began
        stores = counted.stores[tracker.training_progress_key]
        assert stores <= seconds / REPORT_PACE_SECONDS + 2, (stores, seconds)
        with tracker.pause_updates():
            tracker.update_epoch(1)
        wait_for(lambda: published(dht, tracker) == (1, 0), 30, "the step change")
        # one store of the step's own (a pass's paced publication still due may repeat the last pass's record: on a
        # loaded machine the store before it already carried that pass)
        new_step = [value for value in counted.values[tracker.training_progress_key] if value["epoch"] == 1]
        assert len(new_step) == 1 and new_step[0]["samples_accumulated"] == 0, new_step
    finally:
        tracker.shutdown()


def test_a_peer_that_sits_out_says_so_and_no_reader_counts_samples_it_does_not_make(dht):
    # a trainer that measured its pace saves a checkpoint: hivemind's readers extrapolate each record at its samples/s
    # from when it was written, so its record as last published says the batch fills while it makes nothing (the
    # control); within sitting_out its record says 0 samples/s at once, and a reader's estimate never comes due.
    # Afterwards the record has the pace measured before, the time within not counted
    tracker, counted = make_tracker(compat.BoundedProgressTracker, dht, "sitting-out")
    reader = ProgressTracker(dht=dht, prefix="sitting-out-reader", target_batch_size=10_000, start=False)
    try:
        for done in range(1, PASSES + 1):
            tracker.report_local_progress(0, 8 * done)
            time.sleep(PASS_SECONDS)  # a pass's compute
        wait_for(lambda: published(dht, tracker) == (0, 8 * PASSES), 30, "the last pass's samples")
        pace = tracker.performance_ema.samples_per_second
        assert own_record(dht, tracker)["samples_per_second"] == pytest.approx(pace)
        control = reader._parse_swarm_progress_data(dht.get(tracker.training_progress_key, latest=True).value)
        assert control.eta_next_epoch - get_dht_time() < 10_000 / pace, "the control's estimate comes due"
        with tracker.sitting_out():
            wait_for(lambda: own_record(dht, tracker)["samples_per_second"] == 0.0, 30, "the record saying it")
            assert own_record(dht, tracker)["samples_accumulated"] == 8 * PASSES
            view = reader._parse_swarm_progress_data(dht.get(tracker.training_progress_key, latest=True).value)
            assert view.samples_accumulated == 8 * PASSES and view.eta_next_epoch - get_dht_time() > 10**9
        wait_for(lambda: own_record(dht, tracker)["samples_per_second"] > 0.0, 30, "the record with its pace again")
        assert own_record(dht, tracker)["samples_per_second"] == pytest.approx(pace)
    finally:
        tracker.shutdown()


def own_record(dht, tracker) -> dict:
    """The tracker's own record as the DHT holds it."""
    return dht.get(tracker.training_progress_key, latest=True).value[tracker._local_public_key].value


def published(dht, tracker) -> tuple[int, int] | None:
    """(step, samples) of the tracker's own record as the DHT holds it; None if it holds none."""
    found = dht.get(tracker.training_progress_key, latest=True)
    record = found.value.get(tracker._local_public_key) if found is not None else None
    return None if record is None else (record.value["epoch"], record.value["samples_accumulated"])


def test_a_read_of_the_swarms_progress_counts_this_peers_own_samples_as_they_are_now(dht):
    # the DHT holds this peer's record as last published; the samples of passes since (not yet published) still
    # count toward the step in this peer's own reading of the swarm
    tracker, _ = make_tracker(compat.BoundedProgressTracker, dht, "own-record")
    try:
        tracker.report_local_progress(0, 8)
        wait_for(lambda: published(dht, tracker) == (0, 8), 30, "the first report")
        with tracker.reports_held():
            tracker.report_local_progress(0, 40)
        compat.request_progress_read(tracker)
        wait_for(tracker.fetched_global_progress_this_epoch.is_set, 30, "the read")
        assert published(dht, tracker) == (0, 8), "the newer samples were not published"
        assert tracker.global_progress.samples_accumulated == 40
        assert tracker.global_progress.num_peers == 1
    finally:
        tracker.shutdown()


def read_beside(tracker, other_epoch: int, other_samples: int):
    """The tracker's reading of the swarm's progress (its own parsing, as hivemind's fetcher takes a read in) when the
    records are its own and one other peer's at `other_epoch` with `other_samples`. (In a real swarm that record is
    signed with the other peer's key, which this process cannot make.)"""
    expiration = get_dht_time() + 60
    other = dict(peer_id=b"other", epoch=other_epoch, samples_accumulated=other_samples, samples_per_second=0.5)
    other.update(time=get_dht_time(), client_mode=False)
    records = {
        tracker._local_public_key: ValueWithExpiration(tracker.local_progress.dict(), expiration),
        b"other": ValueWithExpiration(other, expiration),
    }
    tracker.global_progress = tracker._parse_swarm_progress_data(records)
    return tracker.global_progress


def test_a_step_the_swarms_batch_backed_is_followed_until_this_peer_makes_it(dht):
    # an honest trainer that is not yet vouched for (no round together so far) starts step 1 once the two trainers'
    # samples fill the batch; the other follows it, on one peer's word, because its own reads counted the batch, and
    # must go on following it at every read until its pass ends and it steps (at the sahajbert preset a pass outlasts
    # several reads: the claim was dropped at the second read, and the peer made step 1 alone)
    tracker, _ = make_tracker(compat.BoundedProgressTracker, dht, "half-batch", target_batch_size=64)
    try:
        tracker.report_local_progress(0, 40)
        view = read_beside(tracker, 0, 24)
        assert (view.epoch, view.samples_accumulated, view.num_peers) == (0, 64, 2)
        assert [read_beside(tracker, 1, 0).epoch for _ in range(3)] == [1, 1, 1]
        with tracker.pause_updates():
            tracker.update_epoch(1)
        view = read_beside(tracker, 1, 8)
        assert (view.epoch, view.num_peers) == (1, 2)
    finally:
        tracker.shutdown()


def test_a_lone_claim_of_the_next_step_is_not_followed_before_the_batch_was_counted(dht):
    # the control: one peer a step ahead, where this peer's reads counted a quarter of the batch
    tracker, _ = make_tracker(compat.BoundedProgressTracker, dht, "quarter-batch", target_batch_size=64)
    try:
        tracker.report_local_progress(0, 8)
        assert read_beside(tracker, 0, 8).samples_accumulated == 16
        assert [read_beside(tracker, 1, 0).epoch for _ in range(2)] == [0, 0]
    finally:
        tracker.shutdown()
