"""What a peer accepts from others is bounded: floods sent by a raw libp2p peer to real peers in other processes."""

import asyncio
import json
import struct
import subprocess
import sys
import time
from contextlib import asynccontextmanager, contextmanager

import psutil
import pytest
from hivemind.p2p import P2P, PeerID

from sahajbert.adaptive import PROBE_CHUNK, PROBE_PROTOCOL
from sahajbert.hivemind_compat import MAX_STREAM_MESSAGE_BYTES
from sahajbert.localswarm import peer_env

from .swarm_helpers import ROOT

FLOOD_MIB = 256  # what the flooder sends in one stream message, far over the bound
WRITE_TIMEOUT = 10.0  # seconds one MiB may take to be accepted before the flooder counts the stream as closed
ARRIVAL_WAIT = 60.0  # seconds for what was sent into an open stream to reach the target's process


@contextmanager
def target(kind: str):
    """A flood target (tests/flood_target.py) in its own process; what it printed about itself."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "flood_target.py"), kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=peer_env(),
    )
    try:
        line = process.stdout.readline()
        assert line, f"the {kind} target did not start"
        yield json.loads(line)
    finally:
        process.stdin.close()
        process.wait(60)


@pytest.fixture(scope="module")
def our_peer():
    with target("ours") as info:
        yield info


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


@asynccontextmanager
async def connected(info: dict):
    """A raw libp2p peer connected to the target; yields it and the target's peer id."""
    p2p = await P2P.create(initial_peers=info["maddrs"])
    try:
        yield p2p, PeerID.from_base58(info["maddrs"][0].split("/p2p/")[1])
    finally:
        await p2p.shutdown()


async def flood_one_message(info: dict) -> dict:
    """Open a stream to the target's all-reduce handler, declare a 1 GiB message, send FLOOD_MIB of it, and read
    the averager process's memory while the stream is still open."""
    async with connected(info) as (p2p, peer):
        before = rss_mib(info["averager_pid"])
        _, _reader, writer = await p2p.call_binary_stream_handler(peer, info["handler"])
        writer.write(P2P.MESSAGE_MARKER + (2**30).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        sent, chunk = 0, bytes(2**20)
        try:
            for _ in range(FLOOD_MIB):
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
                sent += 1
        except (ConnectionError, TimeoutError):
            pass
        # what was sent may still be on its way through the two p2p daemons: a stream the target kept open gets up
        # to ARRIVAL_WAIT seconds for half of it to show in the target's memory, one it closed 2 s
        deadline = time.monotonic() + (ARRIVAL_WAIT if sent == FLOOD_MIB else 2.0)
        during = rss_mib(info["averager_pid"])
        while during - before <= FLOOD_MIB / 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            during = rss_mib(info["averager_pid"])
        writer.close()
        return {"sent_mib": sent, "before_mib": before, "during_mib": during}


@pytest.mark.slow
def test_one_stream_message_cannot_fill_a_peers_memory(our_peer):
    # hivemind's plain averager (the control) holds what a 1 GiB message's first 256 MiB brought; ours closes the
    # stream at the header (MAX_STREAM_MESSAGE_BYTES) and its memory stays where it was
    with target("plain") as plain_info:
        results = {"plain": asyncio.run(flood_one_message(plain_info))}
    results["ours"] = asyncio.run(flood_one_message(our_peer))
    plain, ours = results["plain"], results["ours"]
    assert plain["sent_mib"] == FLOOD_MIB and plain["during_mib"] - plain["before_mib"] > FLOOD_MIB / 2, results
    assert ours["during_mib"] - ours["before_mib"] < 32, results
    assert MAX_STREAM_MESSAGE_BYTES < 2**30


async def probe_with_an_oversized_chunk(info: dict) -> str:
    """Start an upload probe whose first chunk is larger than a prober sends, then wait up to 10 s: "closed" (the
    server ended the stream, unanswered), "answered" or "open"."""
    async with connected(info) as (p2p, peer):
        _, reader, writer = await p2p.call_binary_stream_handler(peer, PROBE_PROTOCOL)
        size = 16 * PROBE_CHUNK
        try:
            writer.write(b"U" + struct.pack("<I", size) + bytes(size))
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 10.0)
            return "answered" if answer else "closed"
        except ConnectionError:
            return "closed"
        except TimeoutError:
            return "open"
        finally:
            writer.close()


@pytest.mark.slow
def test_the_link_probe_cuts_off_a_stream_that_is_no_probe(our_peer):
    assert asyncio.run(probe_with_an_oversized_chunk(our_peer)) == "closed"
