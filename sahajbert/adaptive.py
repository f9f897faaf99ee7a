"""DeDLOC's adaptive averaging: the averaging timing of a peer, derived from its measured link and the model.

A trainer measures its link at start (sahajbert.link_probe), declares the bandwidth to both averagers (hivemind
load-balances the all-reduce by it), and `plan_timing` turns payload bytes, bandwidth and round trip into matchmaking
time, round and chunk timeouts and the final round's window; `tune` is the one place a peer decides it. A flag given
on the command line, in a settings file or by `--recipe` always wins.
"""

import logging
import math
from dataclasses import dataclass, fields

import hivemind

from sahajbert.flags import PeerArguments
from sahajbert.link_probe import PROBE_RETRY, LinkEstimate, LinkWatch, measure_link, peer_ids

logger = logging.getLogger(__name__)


# ---- the timing plan ----

# an assumed link where nothing could be measured: a modest home uplink, with a long round trip
FALLBACK_LINK = LinkEstimate(upload_mbit=10.0, download_mbit=10.0, round_trip_s=0.2)


@dataclass(frozen=True)
class Timing:
    """hivemind's averaging timing for this peer, in seconds; the values the AveragingArguments fields get."""

    matchmaking_time: float
    averaging_timeout: float
    next_chunk_timeout: float
    final_averaging_window: float
    # the first read interval of the swarm's progress; after each global step the trainer follows its step time
    max_refresh_period: float
    bandwidth: float | None  # Mbit/s declared to both averagers (None: hivemind splits the work equally)
    # a new run's first global step waits this long at most for trainers that announced themselves but do not
    # train yet (they download the first trainer's parameters first)
    join_wait: float
    load_state_timeout: float  # one download of the swarm's state (parameters and LAMB's two moments)
    # matchmaking's wait for a potential leader's answer: a peer that gives up on it leaves a group that the leader
    # may still assemble with it, and then waits out its round for a member that is not there
    request_timeout: float


# the bounds every automatic value stays within (seconds): below them a slow CPU or a busy machine breaks rounds
# that the link alone would allow; above them a dead peer holds the others too long
MATCHMAKING_BOUNDS = (5.0, 30.0)
AVERAGING_TIMEOUT_BOUNDS = (30.0, 1800.0)
CHUNK_TIMEOUT_BOUNDS = (10.0, 600.0)
FINAL_WINDOW_BOUNDS = (30.0, 900.0)
JOIN_WAIT_BOUNDS = (30.0, 900.0)
LOAD_STATE_BOUNDS = (30.0, 3600.0)
REFRESH_BOUNDS = (1.0, 10.0)
# a round is given this many times its estimated duration: peers slower than this one share the round
ROUND_SAFETY = 3.0
# hivemind's own wait for a leader's answer (s), enough for a few round trips on an idle link
HIVEMIND_REQUEST_TIMEOUT = 3.0
# bytes that a join request's answer can queue behind when another round fills the link (a Linux TCP send buffer at
# its default ceiling, tcp_wmem): with delayed updates a step's parameter round looks for its group while the
# gradient round still sends: at 5 Mbit/s a 4 MiB queue is 7 s (benchmarks/README.md, the sahajbert preset)
IN_FLIGHT_BYTES = 4 * 2**20
REQUEST_TIMEOUT_BOUNDS = (HIVEMIND_REQUEST_TIMEOUT, 30.0)


def clamp(value: float, bounds: tuple[float, float]) -> float:
    return min(max(value, bounds[0]), bounds[1])


def round_seconds(payload_bytes: float, link: LinkEstimate) -> float:
    """An all-reduce of `payload_bytes` per peer: a peer sends and receives up to 2x its payload (butterfly,
    many peers), at its own bandwidth, plus a few round trips of protocol."""
    return 2 * payload_bytes * 8 / (link.bandwidth_mbit * 1e6) + 4 * link.round_trip_s


def plan_timing(
    gradient_bytes: float,
    state_bytes: float,
    link: LinkEstimate | None,
    explicit: dict[str, float | None],
    round_wait: float = 0.0,
) -> Timing:
    """The automatic timing for one all-reduce of gradients and one of parameters per global step (they overlap
    on the link with delayed updates, so both count); `explicit` values (not None) are kept as they are.
    `round_wait`: seconds a round may wait for its group beyond its timeout (`round_wait_of`)."""
    measured = link is not None
    link = link or FALLBACK_LINK
    both = round_seconds(gradient_bytes + state_bytes, link)

    def chosen(name: str, automatic: float | None) -> float | None:
        return explicit[name] if explicit.get(name) is not None else automatic

    # seconds for a newcomer's download (parameters and LAMB's two moments) at this link's rate
    download = 3 * state_bytes * 8 / (link.bandwidth_mbit * 1e6)
    averaging_timeout = chosen(
        "averaging_timeout", clamp(ROUND_SAFETY * both + 10 * link.round_trip_s + 15, AVERAGING_TIMEOUT_BOUNDS)
    )
    queued = min(IN_FLIGHT_BYTES, gradient_bytes + state_bytes) * 8 / (link.bandwidth_mbit * 1e6)
    request_timeout = clamp(HIVEMIND_REQUEST_TIMEOUT + queued, REQUEST_TIMEOUT_BOUNDS)
    # hivemind needs its request timeout below the matchmaking time (a leader's search outlives its requests): the
    # automatic matchmaking time stays 1 s above it, and an explicit one bounds it (hivemind's 3 s at the least)
    matchmaking_time = chosen(
        "matchmaking_time", max(clamp(20 * link.round_trip_s, MATCHMAKING_BOUNDS), request_timeout + 1)
    )
    request_timeout = min(request_timeout, max(HIVEMIND_REQUEST_TIMEOUT, matchmaking_time - 1))
    return Timing(
        matchmaking_time=matchmaking_time,
        averaging_timeout=averaging_timeout,
        # a part's next chunk may queue behind the whole round on a slow link; never longer than half the round
        next_chunk_timeout=chosen(
            "next_chunk_timeout", min(clamp(both + 10, CHUNK_TIMEOUT_BOUNDS), averaging_timeout / 2)
        ),
        # peers reach the last step up to one round's timeout apart: a peer whose step labels lag one behind runs a
        # round for the step before the last that the others skip (theirs is the final round), and waits that round
        # out before it can reach the final round; 20 s more for its last pass and a state download
        final_averaging_window=chosen(
            "final_averaging_window", clamp(averaging_timeout + round_wait + 20, FINAL_WINDOW_BOUNDS)
        ),
        max_refresh_period=chosen("max_refresh_period", 2.0),
        bandwidth=chosen("bandwidth", round(link.bandwidth_mbit, 1) if measured else None),
        # a newcomer downloads parameters and LAMB's two moments (3x the parameter bytes), as fast as this link
        join_wait=clamp(2 * download + 20, JOIN_WAIT_BOUNDS),
        load_state_timeout=chosen("load_state_timeout", clamp(3 * download + 30, LOAD_STATE_BOUNDS)),
        request_timeout=request_timeout,
    )


# DiLoCo: each trainer reads the swarm's progress ahead of every outer round of its own; the periodic read only
# notices a round it missed, and each read returns every peer's signed record (~0.9 KB each): one every 3rd step
DILOCO_READS_PER_STEP = 1 / 3


def refresh_period_for(step_seconds: float, ceiling: float, reads_per_step: float = 5) -> float:
    """Read the swarm's progress at least `reads_per_step` times per global step, between 1 s and `ceiling`.

    5 in synchronous training, where the samples the reads count start the global step; DILOCO_READS_PER_STEP in
    DiLoCo."""
    if not math.isfinite(step_seconds) or step_seconds <= 0:
        return ceiling
    return clamp(step_seconds / reads_per_step, (REFRESH_BOUNDS[0], max(REFRESH_BOUNDS[0], ceiling)))


def payload_bytes(parameters: int, compression: str) -> tuple[float, float]:
    """(gradient bytes, parameter bytes) one peer contributes to an all-reduce (hivemind's codecs)."""
    gradient = {"none": 4, "fp16": 2, "8bit": 1, "adaptive": 1}[compression] * parameters
    state = (4 if compression == "none" else 2) * parameters
    return float(gradient), float(state)


def explicit_timing(peer_args: PeerArguments) -> dict[str, float | None]:
    """The timing values given by a flag, a settings file or --recipe (None: automatic), by Timing field name."""
    names = [f.name for f in fields(Timing) if f.name not in ("join_wait", "request_timeout")]
    values = {**vars(peer_args.averaging_args), "max_refresh_period": peer_args.optimizer_args.max_refresh_period}
    return {name: values[name] for name in names}


def round_wait_of(peer_args: PeerArguments) -> float:
    """Seconds a round may wait for its group beyond the round timeout: DiLoCo's wait for every trainer to finish its
    inner steps (--diloco_wait), which its outer rounds add to their timeout; 0 in synchronous training."""
    optimizer_args = peer_args.optimizer_args
    return float(optimizer_args.diloco_wait) if optimizer_args.diloco_inner_steps else 0.0


def state_download_bytes(parameters: int, compression: str) -> float:
    """What a newcomer downloads: the parameters and LAMB's two moments, at the state's compression."""
    return 3 * payload_bytes(parameters, compression)[1]


def tune(
    peer_args: PeerArguments, dht: hivemind.DHT, parameters: int
) -> tuple[Timing, LinkEstimate | None, LinkWatch | None]:
    """The one place a peer's averaging timing is decided: measure the link (unless --bandwidth and every timing
    flag are given, or --no_measure_link), then plan around the explicit values. Logged in one line."""
    averaging_args = peer_args.averaging_args
    explicit = explicit_timing(peer_args)
    link = None
    initial_peers = peer_args.swarm_args.initial_peers
    probing = averaging_args.measure_link and bool(initial_peers)
    if probing and any(value is None for value in explicit.values()):
        link, peer = measure_link(dht, initial_peers)
        if link is None:
            logger.warning(
                f"no initial peer answered the link probe ({peer}): timing assumes 10 Mbit/s and 200 ms, and the "
                f"probe is tried again in {PROBE_RETRY:.0f} s"
            )
    gradient_bytes, state_bytes = payload_bytes(parameters, averaging_args.compression)
    timing = plan_timing(gradient_bytes, state_bytes, link, explicit, round_wait_of(peer_args))
    measured = (
        f"link {link.upload_mbit:.1f} Mbit/s up, {link.download_mbit:.1f} down, {link.round_trip_s * 1000:.0f} ms"
        if link is not None
        else "link not measured"
    )
    bandwidth = f"{timing.bandwidth:g} Mbit/s" if timing.bandwidth is not None else "equal shares"
    logger.info(
        f"{measured}; averaging {(gradient_bytes + state_bytes) / 1e6:.1f} MB per step: matchmaking "
        f"{timing.matchmaking_time:.0f} s (requests {timing.request_timeout:.0f} s), round timeout "
        f"{timing.averaging_timeout:.0f} s, chunk timeout {timing.next_chunk_timeout:.0f} s, final window "
        f"{timing.final_averaging_window:.0f} s, state download "
        f"timeout {timing.load_state_timeout:.0f} s, bandwidth {bandwidth}"
    )
    watch = None
    if probing and explicit["bandwidth"] is None:
        # the peer that answered first, then the others
        peers = list(dict.fromkeys(([peer] if link is not None else []) + peer_ids(initial_peers)))
        watch = LinkWatch(dht, peers, averaging_args.link_check_every, failed=link is None)
    return timing, link, watch
