"""DeDLOC's adaptive averaging: measure this peer's link, then derive the averaging timing from it and the model.

Every peer that accepts connections serves a link probe over hivemind's p2p (`serve_link_probe`, started with its
DHT). A trainer measures its round trip, upload and download against one of its initial peers at start
(`measure_link`), declares the bandwidth to both averagers (hivemind load-balances the all-reduce by it), and
`plan_timing` turns payload bytes, bandwidth and round trip into matchmaking time, round and chunk timeouts and
the final round's window. A flag given on the command line, in a settings file or by `--recipe` always wins.
"""

import asyncio
import logging
import math
import statistics
import struct
import time
from dataclasses import dataclass, fields
from functools import partial

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from sahajbert.arguments import PeerArguments
from sahajbert.hivemind_ext.dht.process import dht_authorizer
from sahajbert.hivemind_ext.optim.accessors import (
    GRADIENT_ROUND_DONE,
    GRADIENT_ROUND_FAILED,
    ROUND_LOGGERS,
    STATE_ROUND_FAILED,
)
from sahajbert.hivemind_ext.p2p import add_stream_handler, kept_alive, p2p_of

logger = logging.getLogger(__name__)

PROBE_PROTOCOL = "sahajbert.link_probe"
PROBE_SECONDS = 2.5  # per direction: TCP leaves slow start within ~10 round trips (1 s at 100 ms)
PROBE_MAX_BYTES = 48 * 2**20  # no probe sends more than this, whatever the link
PROBE_CHUNK = 2**16
PROBE_PINGS = 5
# the rate is taken over the transfer's later part: its first third is mostly TCP slow start and buffer filling
RATE_FROM = 1 / 3
PROBE_TIMEOUT = 60.0  # seconds for the whole measurement, every initial peer tried included
PROBE_TRIES = 2  # per initial peer, at start
# seconds between two tries at start: beside two busy processes both tries of a trainer failed within 60 ms (the
# first peer closed the stream unanswered), and the retry that follows waits for a quiet moment between rounds
PROBE_TRY_PAUSE = 2.0
PROBE_RETRY = 20.0  # seconds after a failed measurement before the next try (then every --link_check_every)


@dataclass(frozen=True)
class LinkEstimate:
    """This peer's link as measured against a well-connected peer (its initial peer)."""

    upload_mbit: float
    download_mbit: float
    round_trip_s: float

    @property
    def bandwidth_mbit(self) -> float:
        """What one all-reduce share costs: a reducing peer receives and sends back the same bytes."""
        return min(self.upload_mbit, self.download_mbit)


# ---- the probe, run inside the DHT process (hivemind's DHT.run_coroutine gives it the p2p daemon) ----


async def _serve(_stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One request per stream: b"P" echo; b"D" + float64 seconds: stream bytes that long; b"U": receive framed
    chunks until an empty one, then answer the receiving rate as two float64 (bytes, seconds) over its later part."""
    try:
        kind = await reader.readexactly(1)
        if kind == b"P":
            writer.write(b"P")
        elif kind == b"D":
            (seconds,) = struct.unpack("<d", await reader.readexactly(8))
            payload, sent, deadline = bytes(PROBE_CHUNK), 0, time.monotonic() + min(seconds, 10.0)
            while time.monotonic() < deadline and sent < PROBE_MAX_BYTES:
                writer.write(payload)
                await writer.drain()
                sent += len(payload)
        elif kind == b"U":
            # a prober sends chunks of PROBE_CHUNK, at most PROBE_MAX_BYTES, within its PROBE_TIMEOUT: a stream that
            # sends larger chunks, more bytes, or for longer is cut off unanswered
            arrivals, received, deadline = [], 0, time.monotonic() + PROBE_TIMEOUT
            while True:
                (size,) = struct.unpack("<I", await reader.readexactly(4))
                if size == 0:
                    break
                received += size
                if size > PROBE_CHUNK or received > PROBE_MAX_BYTES or time.monotonic() > deadline:
                    return
                await reader.readexactly(size)
                arrivals.append((time.monotonic(), size))
            writer.write(struct.pack("<dd", *_later_rate(arrivals)))
        await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _later_rate(arrivals: list[tuple[float, int]]) -> tuple[float, float]:
    """(bytes, seconds) that arrived over the later part of a transfer of (arrival time, size) chunks."""
    if len(arrivals) < 3:
        return 0.0, 0.0
    start, end = arrivals[0][0], arrivals[-1][0]
    cut = start + (end - start) * RATE_FROM
    later = [(t, n) for t, n in arrivals if t >= cut]
    first_time = later[0][0]
    return float(sum(n for _, n in later[1:])), end - first_time


async def _register(_dht, node) -> None:
    # an invite-only run's DHT (sahajbert.access.InviteAuthorizer) serves the probe to its members only
    authorizer = dht_authorizer(node)
    serve = authorizer.members_only(node, _serve) if hasattr(authorizer, "members_only") else _serve
    await add_stream_handler(node, PROBE_PROTOCOL, serve)


def serve_link_probe(dht: hivemind.DHT) -> None:
    """Answer other peers' link probes (a peer that accepts connections; the first peer and every trainer)."""
    if not dht.client_mode:
        dht.run_coroutine(_register)


def _describe(error: Exception) -> str:
    """An exception as one line: "ExceptionType: message", or its type alone."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class ProbeFailed(Exception):
    """A link measurement that failed, as "ExceptionType: message"."""


async def _measure(_dht, node, peer_id: PeerID, seconds: float) -> LinkEstimate | ProbeFailed:
    """Round trip, upload and download against `peer_id`; a failure is returned, not raised: hivemind's DHT logs
    an exception raised in its process as an error with its traceback, two tracebacks on a trainer's terminal for a
    probe that it tries again anyway."""
    try:
        return await kept_alive(_measure_now(p2p_of(node), peer_id, seconds))
    except Exception as e:
        return ProbeFailed(_describe(e))


async def _measure_now(p2p, peer_id: PeerID, seconds: float) -> LinkEstimate:
    pings = []
    for _ in range(PROBE_PINGS + 1):
        _, reader, writer = await p2p.call_binary_stream_handler(peer_id, PROBE_PROTOCOL)
        started = time.monotonic()
        writer.write(b"P")
        await writer.drain()
        await reader.readexactly(1)
        pings.append(time.monotonic() - started)
        writer.close()
    round_trip = statistics.median(pings[1:])  # the first also opens the connection

    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, PROBE_PROTOCOL)
    writer.write(b"D" + struct.pack("<d", seconds))
    await writer.drain()
    arrivals = []
    while True:
        chunk = await reader.read(PROBE_CHUNK)
        if not chunk:
            break
        arrivals.append((time.monotonic(), len(chunk)))
    writer.close()
    down_bytes, down_seconds = _later_rate(arrivals)

    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, PROBE_PROTOCOL)
    writer.write(b"U")
    payload, sent, deadline = bytes(PROBE_CHUNK), 0, time.monotonic() + seconds
    while time.monotonic() < deadline and sent < PROBE_MAX_BYTES:
        writer.write(struct.pack("<I", len(payload)) + payload)
        await writer.drain()
        sent += len(payload)
    writer.write(struct.pack("<I", 0))
    await writer.drain()
    up_bytes, up_seconds = struct.unpack("<dd", await reader.readexactly(16))
    writer.close()
    if down_seconds <= 0 or up_seconds <= 0:
        raise RuntimeError("the probe transfer was too short to time")
    return LinkEstimate(up_bytes / up_seconds * 8 / 1e6, down_bytes / down_seconds * 8 / 1e6, round_trip)


def measure_link(
    dht: hivemind.DHT, initial_peers: list[str], seconds: float = PROBE_SECONDS
) -> tuple[LinkEstimate, PeerID] | tuple[None, str]:
    """Measure this peer's link against the first initial peer that answers the probe: (estimate, that peer), or
    (None, why the last try failed). Each initial peer is tried twice: a probe that lands while the machine or the
    first peer is busy (a peer starting up) can stall past its end and be too short to time."""
    deadline = time.monotonic() + PROBE_TIMEOUT
    why = "no initial peer has a /p2p/ id"
    for index, peer_id in enumerate(list(dict.fromkeys(peer_ids(initial_peers))) * PROBE_TRIES):
        if index:  # the try before failed
            time.sleep(max(0.0, min(PROBE_TRY_PAUSE, deadline - time.monotonic())))
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            why = f"no answer within {PROBE_TIMEOUT:.0f} s"
            break
        try:
            return measured(start_measurement(dht, peer_id, seconds), timeout=remaining), peer_id
        except Exception as e:  # an old peer without the probe, a peer that left, a timeout: try the next one
            why = str(e) if isinstance(e, ProbeFailed) else _describe(e)
            logger.debug(f"link probe against {peer_id} failed: {e!r}")
    return None, why


def start_measurement(dht: hivemind.DHT, peer_id: PeerID, seconds: float = PROBE_SECONDS):
    """One measurement against `peer_id`, running in the DHT process: a future of its LinkEstimate (see `measured`)."""
    return dht.run_coroutine(partial(_measure, peer_id=peer_id, seconds=seconds), return_future=True)


def measured(future, timeout: float | None = None) -> LinkEstimate:
    """A started measurement's estimate; raises ProbeFailed if it failed (TimeoutError if not done in time)."""
    result = future.result(timeout=timeout)
    if isinstance(result, ProbeFailed):
        raise result
    return result


class LinkWatch:
    """Keeps the bandwidth estimate current: every `every` seconds the link is measured again in the background
    (against the peer that answered at start), at a moment the caller chooses as quiet (between averaging rounds).
    After a failed measurement (also the one at start) it tries again sooner, against the next initial peer.

    Not from the rounds' own throughput: a round runs at the pace of its slowest peer, so it would understate
    exactly the fast peers that load balancing must find."""

    def __init__(self, dht: hivemind.DHT, peers: list[PeerID], every: float, failed: bool = False):
        self.dht, self.peers, self.every = dht, peers, every
        self.failed = failed
        self.last = time.monotonic()
        self.future = None

    def due(self) -> bool:
        wait = min(self.every, PROBE_RETRY) if self.failed else self.every
        return bool(self.peers) and self.future is None and time.monotonic() - self.last >= wait

    def start(self) -> None:
        self.future = start_measurement(self.dht, self.peers[0])
        self.last = time.monotonic()

    def finished(self) -> LinkEstimate | None:
        """The new estimate once a measurement has finished (once), else None."""
        if self.future is None or not self.future.done():
            return None
        future, self.future = self.future, None
        try:
            link = measured(future)
        except Exception as e:
            logger.debug(f"link re-measurement against {self.peers[0]} failed: {e!r}")
            self.failed = True
            self.peers = self.peers[1:] + self.peers[:1]
            return None
        self.failed = False
        return link


def peer_ids(maddrs: list[str]) -> list[PeerID]:
    """The /p2p/ peer ids that multiaddrs name, in order."""
    ids = []
    for maddr in maddrs:
        value = Multiaddr(maddr).value_for_protocol("p2p")
        if value:
            ids.append(PeerID.from_base58(value))
    return ids


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
# gradient round still sends, and on a 5 Mbit/s uplink 3 s was too short (benchmarks/README.md, sahajbert preset)
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


# ---- hivemind's own account of its rounds ----


class RoundMonitor(logging.Filter):
    """Counts the averaging rounds hivemind reports and times the gradient rounds; one line per failure, with its
    cause. Attached to hivemind's optimizer and state-averager loggers, it also keeps their INFO lines off the
    terminal unless --verbose (hivemind reports round results at INFO only with its own verbose on)."""

    def __init__(self, verbose: bool):
        super().__init__()
        self.verbose = verbose
        self.failed_rounds = 0
        self.gradient_rounds = 0
        self.round_seconds: list[float] = []  # wall seconds from the step that triggered a gradient round to its end
        self._round_started: float | None = None

    def attach(self) -> "RoundMonitor":
        for name in ROUND_LOGGERS:
            hivemind_logger = logging.getLogger(name)
            hivemind_logger.setLevel(logging.INFO)
            hivemind_logger.addFilter(self)
        return self

    def detach(self) -> None:
        for name in ROUND_LOGGERS:
            logging.getLogger(name).removeFilter(self)

    def gradient_round_started(self, unix_time: float) -> None:
        self._round_started = unix_time

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if match := GRADIENT_ROUND_FAILED.match(message):
            self._failed("gradient", match.group(1), "this peer steps with its own gradients")
        elif match := STATE_ROUND_FAILED.match(message):
            self._failed("parameter", match.group(1), "parameters stay as they are until the next round")
        elif GRADIENT_ROUND_DONE.match(message):
            self.gradient_rounds += 1
            if self._round_started is not None:
                self.round_seconds.append(record.created - self._round_started)
                self._round_started = None
        return self.verbose or record.levelno >= logging.WARNING

    def _failed(self, kind: str, cause: str, consequence: str) -> None:
        self.failed_rounds += 1
        if kind == "gradient":
            self._round_started = None
        logger.info(f"a {kind} averaging round failed ({cause}): {consequence} ({self.failed_rounds} failed so far)")


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
