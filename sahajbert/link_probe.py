"""The link probe: a peer measures its round trip, upload and download against a well-connected peer over
hivemind's p2p, at start and then every --link_check_every seconds (DeDLOC's adaptive averaging starts here: the
timing plan, sahajbert.adaptive, is derived from what it measures).

Every peer that accepts connections serves the probe (`serve_link_probe`, started with its DHT); a trainer measures
against one of its initial peers (`measure_link`) and keeps measuring while it trains (`LinkWatch`).
"""

import asyncio
import logging
import statistics
import struct
import time
from dataclasses import dataclass
from functools import partial

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from sahajbert.hivemind_ext.dht.process import dht_authorizer
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
        # bounded: a stream whose other end stalls (a busy peer; a close the daemon never passes on) fails the
        # measurement, which the caller tries again, instead of leaving its future unresolved for good
        return await asyncio.wait_for(kept_alive(_measure_now(p2p_of(node), peer_id, seconds)), PROBE_TIMEOUT)
    except asyncio.TimeoutError:
        return ProbeFailed(f"no answer within {PROBE_TIMEOUT:.0f} s")
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
