"""The adaptive averaging parts: the link probe over real p2p, the timing plan, hivemind's rounds counted."""

import logging
import math
import runpy
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import hivemind
import pytest

from sahajbert import cli
from sahajbert.adaptive import (
    AVERAGING_TIMEOUT_BOUNDS,
    DILOCO_READS_PER_STEP,
    FALLBACK_LINK,
    explicit_timing,
    payload_bytes,
    plan_timing,
    refresh_period_for,
)
from sahajbert.joining import start_priority
from sahajbert.link_probe import (
    PROBE_CHUNK,
    PROBE_PINGS,
    PROBE_TIMEOUT,
    PROBE_TRIES,
    LinkEstimate,
    LinkWatch,
    measure_link,
    serve_link_probe,
)
from sahajbert.localswarm import wait_for
from sahajbert.model import count_parameters, read_config
from sahajbert.round_log import RoundMonitor

from .swarm_helpers import script

TRAINER_FLAGS = runpy.run_path(str(script("run_trainer.py")))["FLAGS"]
BROADBAND = LinkEstimate(upload_mbit=20.0, download_mbit=100.0, round_trip_s=0.1)
NOTHING_EXPLICIT = {}


def test_timing_grows_with_the_model_and_shrinks_with_the_link():
    sahajbert = payload_bytes(count_parameters(read_config("sahajbert")), "fp16")
    tiny = payload_bytes(count_parameters(read_config("tiny")), "fp16")
    big_slow = plan_timing(*sahajbert, BROADBAND, NOTHING_EXPLICIT)
    small_fast = plan_timing(*tiny, LinkEstimate(1000.0, 1000.0, 0.001), NOTHING_EXPLICIT)
    # sahajBERT on a 20 Mbit/s uplink: one gradient and one parameter round of 2 x 36 MB each take ~58 s
    assert 150 <= big_slow.averaging_timeout <= 250, big_slow
    assert big_slow.next_chunk_timeout <= big_slow.averaging_timeout / 2
    # a peer that lags one step behind waits out a round the others skip before it reaches the final round
    assert big_slow.final_averaging_window >= big_slow.averaging_timeout + 20
    assert big_slow.bandwidth == 20.0, "the lower of upload and download is declared"
    # its state (parameters and two LAMB moments in fp16, 85 MB) downloads in ~34 s at 20 Mbit/s
    assert 100 <= big_slow.load_state_timeout <= 200 and 60 <= big_slow.join_wait <= 120, big_slow
    # the tiny model on loopback: every value at its floor, which a busy 2-core machine still meets
    assert small_fast.averaging_timeout == AVERAGING_TIMEOUT_BOUNDS[0]
    assert small_fast.matchmaking_time == 5.0 and small_fast.final_averaging_window == 50.0
    assert small_fast.load_state_timeout == pytest.approx(30.0, abs=0.1)
    # DiLoCo's rounds wait up to --diloco_wait for every trainer beyond their timeout: the final window covers that
    assert plan_timing(*tiny, None, NOTHING_EXPLICIT, round_wait=60).final_averaging_window == pytest.approx(
        plan_timing(*tiny, None, NOTHING_EXPLICIT).final_averaging_window + 60
    )
    # a longer round trip: longer matchmaking
    assert plan_timing(*tiny, LinkEstimate(1000.0, 1000.0, 0.5), NOTHING_EXPLICIT).matchmaking_time == 10.0


def test_a_join_request_waits_for_an_answer_that_queues_behind_another_round():
    sahajbert = payload_bytes(count_parameters(read_config("sahajbert")), "fp16")
    tiny = payload_bytes(count_parameters(read_config("tiny")), "fp16")
    slow = LinkEstimate(upload_mbit=4.8, download_mbit=15.4, round_trip_s=0.1)
    # sahajBERT on a 5 Mbit/s uplink: a send buffer of gradient chunks (4 MiB) ahead of the answer takes ~7 s
    big_slow = plan_timing(*sahajbert, slow, NOTHING_EXPLICIT)
    assert big_slow.request_timeout == pytest.approx(3.0 + 4 * 2**20 * 8 / 4.8e6)
    assert big_slow.matchmaking_time > big_slow.request_timeout, "hivemind needs requests shorter than the search"
    # the tiny model's whole payload is what can queue (under a second here): its matchmaking stays 5 s
    small_slow = plan_timing(*tiny, slow, NOTHING_EXPLICIT)
    assert small_slow.request_timeout == pytest.approx(3.0 + sum(tiny) * 8 / 4.8e6)
    assert small_slow.matchmaking_time == 5.0
    assert plan_timing(*tiny, LinkEstimate(1000.0, 1000.0, 0.001), NOTHING_EXPLICIT).request_timeout < 3.01
    # an explicit matchmaking time bounds the requests, down to hivemind's own 3 s
    assert plan_timing(*sahajbert, slow, {"matchmaking_time": 6.0}).request_timeout == 5.0
    assert plan_timing(*sahajbert, slow, {"matchmaking_time": 1.0}).request_timeout == 3.0


def test_without_a_measurement_the_split_stays_equal_and_the_timing_assumes_a_modest_link():
    timing = plan_timing(1e8, 1e8, None, NOTHING_EXPLICIT)
    assert timing.bandwidth is None
    assert timing == replace(plan_timing(1e8, 1e8, FALLBACK_LINK, NOTHING_EXPLICIT), bandwidth=None)


def test_explicit_flags_and_recipe_values_win_over_the_automatic_timing():
    peer_args = cli.parse_args(TRAINER_FLAGS, ["--averaging_timeout", "77", "--bandwidth", "3"])[0]
    averaging = peer_args.averaging_args
    assert averaging.matchmaking_time is None, "not given: automatic"
    timing = plan_timing(1e8, 1e8, BROADBAND, explicit_timing(peer_args))
    assert timing.averaging_timeout == 77 and timing.bandwidth == 3
    assert timing.next_chunk_timeout == 77 / 2, "automatic values still respect the explicit round timeout"
    recipe = cli.parse_args(TRAINER_FLAGS, ["--recipe", "sahajbert-xl"])[0]
    timing = plan_timing(1e8, 1e8, BROADBAND, explicit_timing(recipe))
    assert (timing.matchmaking_time, timing.averaging_timeout, timing.bandwidth) == (30.0, 120.0, 100.0)
    assert timing.max_refresh_period == 30.0


def test_the_refresh_period_follows_the_step_time():
    assert refresh_period_for(20.0, 10.0) == 4.0
    assert refresh_period_for(2.0, 10.0) == 1.0
    assert refresh_period_for(600.0, 10.0) == 10.0
    assert refresh_period_for(float("nan"), 10.0) == 10.0
    # DiLoCo: every 3rd step, within the bounds
    assert refresh_period_for(20.0, 10.0, reads_per_step=DILOCO_READS_PER_STEP) == 10.0
    assert refresh_period_for(2.0, 10.0, reads_per_step=DILOCO_READS_PER_STEP) == pytest.approx(6.0)
    assert refresh_period_for(0.2, 10.0, reads_per_step=DILOCO_READS_PER_STEP) == 1.0


def test_a_peer_that_started_earlier_has_the_higher_start_priority():
    assert 0 < start_priority(1_800_000_001.0) < start_priority(1_800_000_000.0) <= 0.5
    assert start_priority(1_800_000_000.0) - start_priority(1_800_000_000.001) > 0, "millisecond resolution"


def test_hivemind_round_failures_are_counted_with_their_cause(caplog):
    monitor = RoundMonitor(verbose=False).attach()
    try:
        with caplog.at_level(logging.INFO, logger="sahajbert.round_log"):
            optimizer_logger = logging.getLogger("hivemind.optim.optimizer")
            monitor.gradient_round_started(0.0)
            optimizer_logger.info("Averaged gradients with 3 peers")
            optimizer_logger.info("Averaging gradients failed with TimeoutError()")
            logging.getLogger("hivemind.optim.state_averager").info("Averaging failed with <class 'TimeoutError'>")
    finally:
        monitor.detach()
    assert monitor.gradient_rounds == 1 and len(monitor.round_seconds) == 1
    assert monitor.failed_rounds == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "sahajbert.round_log"]
    assert any("gradient averaging round failed (TimeoutError())" in line for line in lines), lines
    assert any("parameter averaging round failed" in line and "2 failed so far" in line for line in lines), lines


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_failed_link_probe_is_one_line_not_a_traceback():
    # the probe runs in the DHT's process, which logs an exception raised there with its traceback, in the process
    # itself: a fresh process runs a probe that fails (its peer serves none), and its whole stderr is read
    script = textwrap.dedent(
        """
        import hivemind
        from sahajbert.link_probe import measure_link
        server = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = [str(m) for m in server.get_visible_maddrs()]
        client = hivemind.DHT(start=True, initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        link, why = measure_link(client, maddrs, seconds=0.5)
        print("measured:", link, "why:", why)
        client.shutdown()
        server.shutdown()
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "measured: None why: " in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr


# no link moves a terabit a second: a rate over it is in the wrong unit (bytes, bits) or divided by ~0 seconds
MOST_MBIT = 1e6


def assert_measured(link: LinkEstimate, seconds: float) -> None:
    """`link` is what a measurement that took at most `seconds` (wall clock, on this machine) can have seen: however
    busy the machine, the rates and the round trip are positive and finite, and within what the probe moved then."""
    values = (link.upload_mbit, link.download_mbit, link.round_trip_s)
    assert all(math.isfinite(value) and value > 0 for value in values), link
    assert link.upload_mbit < MOST_MBIT and link.download_mbit < MOST_MBIT, link
    # the upload is timed over at least one PROBE_CHUNK that arrived after another, within the measurement
    assert link.upload_mbit >= PROBE_CHUNK * 8 / 1e6 / seconds, (link, seconds)
    # the round trip is the median of the PROBE_PINGS pings after the first, made one after another within it
    assert link.round_trip_s <= seconds / (PROBE_PINGS // 2 + 1), (link, seconds)


@pytest.mark.slow
@pytest.mark.timeout(5 * PROBE_TIMEOUT + 60)  # five measurements, each bounded by PROBE_TIMEOUT, at worst
def test_the_link_probe_measures_loopback_over_real_p2p():
    server = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    serve_link_probe(server)
    client = hivemind.DHT(
        start=True, initial_peers=[str(m) for m in server.get_visible_maddrs()], host_maddrs=["/ip4/127.0.0.1/tcp/0"]
    )
    try:
        began = time.monotonic()
        link, answered = measure_link(client, [str(m) for m in server.get_visible_maddrs()], seconds=1.0)
        took = time.monotonic() - began
        assert link is not None and answered == server.peer_id, (link, answered)
        assert_measured(link, took)
        # measured again in the background when due
        watch = LinkWatch(client, [answered], every=0.0)
        assert watch.due()
        for _ in range(PROBE_TRIES):  # as a trainer does: a measurement that stalled (a loaded machine) fails in
            began = time.monotonic()  # PROBE_TIMEOUT, and the watch tries again
            watch.start()
            assert not watch.due(), "one measurement at a time"
            wait_for(lambda: watch.future.done(), PROBE_TIMEOUT + 30, "the second measurement", interval=0.05)
            again = watch.finished()
            if again is not None:
                break
            assert watch.failed and watch.future is None
        assert again is not None, "the background measurement failed every time"
        assert_measured(again, time.monotonic() - began)
        # a peer without the probe (the client serves none: it was never asked to) is skipped: None, and why
        link, why = measure_link(server, [str(m) for m in client.get_visible_maddrs()], seconds=0.5)
        assert link is None and isinstance(why, str) and why, why
        # a failed measurement marks the watch as failed (it retries sooner) and moves on to the next peer
        watch = LinkWatch(server, [client.peer_id, server.peer_id], every=0.0)
        watch.start()
        wait_for(lambda: watch.future.done(), 60, "the failing measurement")
        assert watch.finished() is None and watch.failed
        assert watch.peers == [server.peer_id, client.peer_id]
    finally:
        client.shutdown()
        server.shutdown()
