"""A trainer whose view of the swarm disagrees with the other trainers' records says so (sahajbert.split_watch):
real DHT peers of one run, each publishing its signed metrics record as a trainer does."""

import logging

from sahajbert.localswarm import wait_for
from sahajbert.records import LocalMetrics, publish
from sahajbert.split_watch import SPLIT_READS, SplitWatch, View

from .swarm_helpers import signed_dhts

RUN_ID = "split"


def record(dht, step: int, peers_seen: int) -> LocalMetrics:
    return LocalMetrics(
        step=step,
        samples_per_second=10.0,
        samples_accumulated=64,
        loss=1.0,
        mini_steps=8,
        peer_id=dht.peer_id.to_base58(),
        peers_seen=peers_seen,
    )


def read(watch: SplitWatch, mine: View) -> str | None:
    """One whole read of the records by `watch` (started, come back, compared) while this peer is at `mine`: its
    warning, if any."""
    reads = watch.reads
    warnings = []

    def polled() -> bool:
        watch.saw(mine.peers)
        warnings.append(watch.poll(mine.step))
        return watch.reads > reads

    wait_for(polled, 30, "the watch's read", interval=0.05)
    return warnings[-1]


def test_a_view_that_disagrees_with_stepping_trainers_for_several_reads_is_said_once_and_a_standing_one_never(caplog):
    with signed_dhts(RUN_ID, 4) as peers:
        (watcher, watcher_key), same_part, *other_part = peers
        watch = SplitWatch(watcher, RUN_ID, watcher_key, read_seconds=0.0)

        def step_all(step: int, other_step: int, other_peers: int) -> None:
            stored = [publish(same_part[0], RUN_ID, same_part[1], record(same_part[0], step, 2))]
            stored += [publish(dht, RUN_ID, key, record(dht, other_step, other_peers)) for dht, key in other_part]
            assert all(future.result(timeout=30) for future in stored)

        # the watcher's own record is not compared with its view (it is published here as a trainer does)
        assert publish(watcher, RUN_ID, watcher_key, record(watcher, 0, 9)).result(timeout=30)
        # two trainers step 40 steps ahead, seeing 4 peers, while this peer and its neighbour see 2
        warnings = []
        with caplog.at_level(logging.WARNING, logger="sahajbert.trainer"):
            for step in range(10, 10 + SPLIT_READS + 3):
                step_all(step, step + 40, 4)
                warnings.append(read(watch, View(step, 2)))
        # the first read has no earlier one to tell stepping trainers from standing ones; then SPLIT_READS in a row
        assert warnings[:SPLIT_READS] == [None] * SPLIT_READS, warnings
        told = warnings[SPLIT_READS]
        assert told is not None and warnings[SPLIT_READS + 1 :] == [None, None], warnings
        assert f"sees 2 peer(s) at global step {10 + SPLIT_READS}" in told, told
        assert f"2 other trainer(s), stepping, see 4 peer(s) at step {50 + SPLIT_READS}" in told, told
        assert [r.getMessage() for r in caplog.records if "may have split" in r.getMessage()] == [told]

        # once the others' records agree again, the watch is quiet, and a new disagreement is said again
        agreed = 10 + SPLIT_READS + 3
        step_all(agreed, agreed, 2)
        assert read(watch, View(agreed, 2)) is None
        later = []
        for step in range(agreed + 1, agreed + 1 + SPLIT_READS):
            step_all(step, step - 10, 2)  # behind, stepping on their own
            later.append(read(watch, View(step, 2)))
        assert later[:-1] == [None] * (SPLIT_READS - 1) and later[-1] is not None, later

        # records that stand still (peers gone, or waiting) are no evidence: however far they are, nothing is said
        quiet = SplitWatch(watcher, RUN_ID, watcher_key, read_seconds=0.0)
        for step in range(100, 100 + SPLIT_READS + 2):
            assert publish(same_part[0], RUN_ID, same_part[1], record(same_part[0], step, 2)).result(timeout=30)
            assert read(quiet, View(step, 2)) is None


def test_views_agree_within_the_slack_of_a_read_and_a_joining_peer():
    mine = View(step=20, peers=8)
    assert not mine.disagrees_with(View(22, 8))
    assert not mine.disagrees_with(View(15, 8), step_before=17)  # this peer stepped 3 times while the read ran
    assert mine.disagrees_with(View(23, 8)) and mine.disagrees_with(View(14, 8), step_before=17)
    assert not mine.disagrees_with(View(20, 10)) and mine.disagrees_with(View(20, 11))
    assert not View(20, 32).disagrees_with(View(20, 25)) and View(20, 32).disagrees_with(View(20, 23))


def test_a_view_counts_the_most_peers_seen_lately_and_one_noisy_trainer_at_a_time_is_no_split():
    # a read of the progress records can come back short (5 of 8 right after a step, in a loaded run): the view keeps
    # the most peers seen over the last two reads' spans; a trainer whose record disagrees once in a while, each time
    # another one, is noise: only a trainer that disagrees SPLIT_READS reads in a row is a split
    watch = SplitWatch(dht=None, run_id=RUN_ID, public_key=b"me")
    for peers in (8, 5, 8, 6):
        watch.saw(peers)
    assert watch.peers_seen == 8
    keys = [bytes([k]) for k in range(4)]
    for step in range(10, 10 + 4 * SPLIT_READS):
        noisy = keys[step % len(keys)]
        others = {key: View(step, 5 if key == noisy else 8) for key in keys}
        assert watch.observe(View(step, 8), others) is None
