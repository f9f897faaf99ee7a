"""What a peer accepts from others is bounded: floods sent by a raw libp2p peer to real peers in other processes."""

import asyncio
import json
import struct
import subprocess
import sys
import time
from contextlib import asynccontextmanager, contextmanager

import hivemind.utils.timed_storage
import psutil
import pytest
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter

from sahajbert.flags import MAX_RECORD_LIFETIME
from sahajbert.hivemind_ext.averaging.averager import MAX_REQUESTS_PER_PEER
from sahajbert.hivemind_ext.dht import storage as bounded_storage
from sahajbert.hivemind_ext.dht.protocol import (
    DHT_REQUEST_BURST,
    DHT_REQUESTS_PER_SECOND,
    MAX_DHT_CALLERS_TRACKED,
    MAX_DHT_KEYS_PER_REQUEST,
    _Allowance,
)
from sahajbert.hivemind_ext.dht.storage import MAX_RECORD_BYTES, MAX_STORED_RECORDS, RECOUNT_EVERY, BoundedLocalStorage
from sahajbert.hivemind_ext.p2p import MAX_STREAM_MESSAGE_BYTES
from sahajbert.link_probe import PROBE_CHUNK, PROBE_PROTOCOL
from sahajbert.localswarm import peer_env

from .swarm_helpers import ROOT

FLOOD_MIB = 256  # what the flooder sends in one stream message, far over the bound
WRITE_TIMEOUT = 10.0  # seconds one MiB may take to be accepted before the flooder counts the stream as closed
ARRIVAL_WAIT = 60.0  # seconds for what was sent into an open stream to reach the target's process


@contextmanager
def target(kind: str, values: int = 1000, dht_allowance: str | None = None, chunk_timeout: float | None = None):
    """A flood target (tests/flood_target.py, its state `values` parameters, our DHT request allowance "RATE,BURST"
    if given, its averager's next_chunk_timeout if given) in its own process; what it printed about itself."""
    env = peer_env() | ({"FLOOD_CHUNK_TIMEOUT": str(chunk_timeout)} if chunk_timeout is not None else {})
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "flood_target.py"), kind, str(values)]
        + ([dht_allowance] if dht_allowance else []),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
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


def target_peer(info: dict) -> PeerID:
    """The flood target's peer id, from the multiaddrs it printed."""
    return PeerID.from_base58(info["maddrs"][0].split("/p2p/")[1])


@asynccontextmanager
async def connected(info: dict):
    """A raw libp2p peer connected to the target; yields it and the target's peer id."""
    p2p = await P2P.create(initial_peers=info["maddrs"])
    try:
        yield p2p, target_peer(info)
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


async def receive(declared: int, sent: int) -> tuple[int | None, int]:
    """A p2p stream message that declares `declared` bytes and brings `sent`, read by P2P.receive_raw_data (ours,
    installed by sahajbert.hivemind_ext.install): (the length of what it returned, None if it closed the stream; the
    bytes left unread behind the header)."""
    reader = asyncio.StreamReader()
    reader.feed_data(declared.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + bytes(sent))
    reader.feed_eof()
    try:
        message = len(await P2P.receive_raw_data(reader))
    except asyncio.IncompleteReadError:
        message = None
    return message, len(await reader.read())


def test_a_stream_message_is_read_up_to_its_bound_and_refused_over_it_before_any_of_it_is_read():
    assert asyncio.run(receive(MAX_STREAM_MESSAGE_BYTES, MAX_STREAM_MESSAGE_BYTES)) == (MAX_STREAM_MESSAGE_BYTES, 0)
    over = MAX_STREAM_MESSAGE_BYTES + 1
    assert asyncio.run(receive(over, over)) == (None, over)


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


# ---- DHT records ----


def test_a_record_over_the_size_or_lifetime_bound_is_refused():
    storage, now = BoundedLocalStorage(), get_dht_time()
    key = DHTID.generate("key")
    assert not storage.store(key, bytes(MAX_RECORD_BYTES + 1), now + 60)
    assert not storage.store(key, b"x", now + MAX_RECORD_LIFETIME + 60)
    assert not storage.store_subkey(key, b"peer", bytes(MAX_RECORD_BYTES + 1), now + 60)
    assert storage.store(key, bytes(MAX_RECORD_BYTES), now + 60)
    # hivemind's storage (the control) keeps both
    plain = DHTLocalStorage()
    assert plain.store(key, bytes(MAX_RECORD_BYTES + 1), now + 60)
    assert plain.store(DHTID.generate("other"), b"x", now + 10 * MAX_RECORD_LIFETIME)


def test_a_full_storage_refuses_new_records_and_renews_those_it_holds():
    storage, now = BoundedLocalStorage(), get_dht_time()
    half = MAX_STORED_RECORDS // 2
    keys = [DHTID.generate(f"key{i}") for i in range(half)]
    assert all(storage.store(key, b"v", now + 60) for key in keys)
    shared = DHTID.generate("progress")
    assert all(storage.store_subkey(shared, i, b"v", now + 60) for i in range(MAX_STORED_RECORDS - half))
    assert storage.records() == MAX_STORED_RECORDS
    assert not storage.store(DHTID.generate("one more"), b"v", now + 60)
    assert not storage.store_subkey(shared, "one more", b"v", now + 60)
    assert storage.store(keys[0], b"renewed", now + 120) and storage.get(keys[0]).value == b"renewed"
    assert storage.store_subkey(shared, 0, b"renewed", now + 120)


def test_a_full_storage_has_room_again_once_records_expire(monkeypatch):
    # one fake clock, moved by the test: the DHT time that records expire by (hivemind's storage and our bounds read
    # it) and the storage's clock between two counts
    now = [get_dht_time()]
    for module in (hivemind.utils.timed_storage, bounded_storage):
        monkeypatch.setattr(module, "get_dht_time", lambda: now[0])
    storage = BoundedLocalStorage(clock=lambda: now[0])
    expiration = now[0] + RECOUNT_EVERY / 4
    assert all(storage.store(DHTID.generate(f"key{i}"), b"v", expiration) for i in range(MAX_STORED_RECORDS))
    assert not storage.store(DHTID.generate("one more"), b"v", now[0] + 60)  # full: counted now
    now[0] += RECOUNT_EVERY / 2
    # they have expired, but a full storage counts again only a RECOUNT_EVERY after its last count
    assert not storage.store(DHTID.generate("one more"), b"v", now[0] + 60)
    now[0] += RECOUNT_EVERY / 2
    assert storage.store(DHTID.generate("one more"), b"v", now[0] + 60)
    assert storage.records() == 1


def test_renewing_one_record_does_not_grow_the_expiration_heap():
    now = get_dht_time()
    ours, plain = BoundedLocalStorage(), DHTLocalStorage()
    key = DHTID.generate("renewed")
    for storage in (ours, plain):
        for i in range(5000):
            storage.store(key, b"v", now + 60 + i * 1e-3)
            storage.store_subkey(DHTID.generate("dict"), b"peer", b"v", now + 60 + i * 1e-3)
    assert len(plain.expiration_heap) >= 5000  # hivemind keeps an entry per store until it expires
    assert len(ours.expiration_heap) < 100
    assert len(ours.get(DHTID.generate("dict")).value.expiration_heap) < 100


async def flood_records(info: dict, records: int, value_bytes: int, batch: int = 1000) -> dict:
    """Ask the target to store `records` new records of `value_bytes` each, `batch` per request (as many as the p2p
    daemon passes in one), then one that would be kept 10x the lifetime bound; the target's DHT process memory."""
    node = await DHTNode.create(initial_peers=info["maddrs"], client_mode=True)
    try:
        peer = target_peer(info)
        before, accepted = rss_mib(info["dht_pid"]), 0
        value, expiration = bytes(value_bytes), get_dht_time() + 600
        for start in range(0, records, batch):
            keys = [DHTID.generate(f"flood{i}") for i in range(start, min(start + batch, records))]
            stored = await node.protocol.call_store(peer, keys, [value] * len(keys), expiration)
            accepted += sum(stored or [])
        far = get_dht_time() + 10 * MAX_RECORD_LIFETIME
        long_lived = await node.protocol.call_store(peer, [DHTID.generate("far")], [b"x"], far)
        return {"accepted": accepted, "growth_mib": rss_mib(info["dht_pid"]) - before, "long_lived": long_lived}
    finally:
        await node.shutdown()


FLOOD_RECORDS, FLOOD_VALUE_BYTES = 3 * MAX_STORED_RECORDS, 3000  # 86 MiB of values, 3x the bound's count


@pytest.mark.slow
def test_a_flood_of_dht_records_cannot_fill_a_peers_memory(our_peer):
    with target("plain") as plain_info:
        plain = asyncio.run(flood_records(plain_info, FLOOD_RECORDS, FLOOD_VALUE_BYTES))
    ours = asyncio.run(flood_records(our_peer, FLOOD_RECORDS, FLOOD_VALUE_BYTES, batch=MAX_DHT_KEYS_PER_REQUEST))
    results = {"plain": plain, "ours": ours}
    # hivemind's DHT (the control) keeps every record, and one for 10 hours
    values_mib = FLOOD_RECORDS * FLOOD_VALUE_BYTES / 2**20
    assert plain["accepted"] == FLOOD_RECORDS and plain["growth_mib"] > values_mib / 2, results
    assert plain["long_lived"] == [True], results
    # ours keeps up to its bound's count (the target's own few records take some of it), and no record that long
    bound_mib = MAX_STORED_RECORDS * FLOOD_VALUE_BYTES / 2**20
    assert MAX_STORED_RECORDS - 100 <= ours["accepted"] <= MAX_STORED_RECORDS, results
    assert ours["growth_mib"] < bound_mib + 32, results
    assert ours["long_lived"] == [False], results


# the state a flood target serves: 128 MiB, far more than the p2p daemons and sockets buffer, so that a download the
# flooder does not read stays open (and counted) while it opens the others
STATE_VALUES = 2**25
DOWNLOADS = 6


async def first_message(stub, timeout: float = 60.0):
    """Open a state download and read its first message: (the stream, whether any data came)."""
    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
    try:
        await asyncio.wait_for(anext(stream), timeout)
        return stream, True
    except StopAsyncIteration:  # the target shares nothing with this caller
        return stream, False


async def flood_state_downloads(info: dict) -> dict:
    """Open DOWNLOADS state downloads at once and keep them open; how many were served; then, all closed, whether
    one more is served (a bound must not keep counting downloads that ended)."""
    async with connected(info) as (p2p, peer):
        stub = TrainingStateAverager.get_stub(p2p, peer, namespace="flood")
        opened = await asyncio.gather(*(first_message(stub) for _ in range(DOWNLOADS)))
        served = sum(got for _, got in opened)
        for stream, _ in opened:
            await stream.aclose()
        deadline, again = time.monotonic() + 60, False
        while not again and time.monotonic() < deadline:
            stream, again = await first_message(stub)
            await stream.aclose()
            if not again:
                await asyncio.sleep(1.0)
        return {"served_at_once": served, "served_after": again}


@pytest.mark.slow
def test_one_peer_downloads_one_state_at_a_time():
    # hivemind's averager (the control) uploads its whole state to every request at once; ours serves one download
    # per peer at a time and refuses the others as a peer that shares nothing would, so the caller tries another
    results = {}
    for kind in ("plain", "ours"):
        with target(kind, STATE_VALUES) as info:
            results[kind] = asyncio.run(flood_state_downloads(info))
    assert results["plain"]["served_at_once"] == DOWNLOADS, results
    assert results["ours"]["served_at_once"] == MAX_REQUESTS_PER_PEER["state"] == 1, results
    assert results["ours"]["served_after"], results


PART_STREAMS = MAX_REQUESTS_PER_PEER["part"] + 2  # all-reduce streams one flooder opens at once
# seconds the target holds a part for a group it has not begun: every flood stream must arrive while the first are
# held (with 5 s, on a busy machine, the first was answered before the last arrived, and only one was refused)
HELD_PART_SECONDS = 20.0
# a stream's first answer when the target closed it at once, unread: a refusal, as the caller sees it
CLOSED = "CLOSED"


async def flood_part_streams(info: dict) -> dict:
    """From one peer, open PART_STREAMS all-reduce streams at once, each with a part for a group the target never
    formed, then one more from another peer; the code of each stream's first answer, in the order they came."""

    async def first_answer(p2p, peer, streams: list) -> str:
        stub = TrainingStateAverager.get_stub(p2p, peer, namespace="flood")
        stream = await stub.rpc_aggregate_part(as_aiter(averaging_pb2.AveragingData(group_id=b"no such group")))
        streams.append(stream)
        try:
            answer = await asyncio.wait_for(anext(stream), 120)
        except (ConnectionError, StopAsyncIteration):
            # the target refused and closed the stream at once, unread: hivemind's caller then reads a broken pipe or
            # the stream's end, not the refusal (a held stream reads the part and stays open, so it never ends so)
            return CLOSED
        return averaging_pb2.MessageCode.Name(answer.code)

    async with connected(info) as (p2p, peer), connected(info) as (other, _):
        streams = []
        flood = [asyncio.create_task(first_answer(p2p, peer, streams)) for _ in range(PART_STREAMS)]
        # once the streams over the bound are answered (at once), and while the others are still held open, another
        # peer's stream: the bound is per peer
        done = set()
        while len(done) < PART_STREAMS - MAX_REQUESTS_PER_PEER["part"]:
            waiting = [task for task in flood if task not in done]
            finished, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED, timeout=120)
            assert finished, "no answer in 120 s"
            done |= finished
        another = await first_answer(other, peer, streams)
        if another == CLOSED:
            # once more: on a loaded machine the other peer's first stream to the target can break in its setup,
            # also to the control (hivemind's averager, which answers every stream); a target that refuses the other
            # peer's streams refuses this one too
            another = await first_answer(other, peer, streams)
        answers = await asyncio.gather(*flood)
        for stream in streams:
            await stream.aclose()
        return {"flooder": sorted(answers), "another": another}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_one_peer_has_a_bounded_number_of_all_reduce_streams_served_at_once():
    # a part for a group the target never formed: hivemind's averager (the control) answers each at once (no such
    # group); ours first waits for the group to begin (its next_chunk_timeout, here HELD_PART_SECONDS), holding the
    # stream open, for at most MAX_REQUESTS_PER_PEER["part"] streams of one peer, and refuses the others at once
    results = {}
    for kind in ("plain", "ours"):
        with target(kind, chunk_timeout=HELD_PART_SECONDS) as info:
            results[kind] = asyncio.run(flood_part_streams(info))
    assert results["plain"] == {"flooder": ["BAD_GROUP_ID"] * PART_STREAMS, "another": "BAD_GROUP_ID"}, results
    served = MAX_REQUESTS_PER_PEER["part"]
    refused = [code for code in results["ours"]["flooder"] if code != "BAD_GROUP_ID"]
    assert results["ours"]["flooder"].count("BAD_GROUP_ID") == served, results
    assert len(refused) == PART_STREAMS - served and set(refused) <= {"PROTOCOL_VIOLATION", CLOSED}, results
    assert results["ours"]["another"] == "BAD_GROUP_ID", results


def test_a_callers_dht_allowance_is_a_burst_then_a_rate():
    now = [0.0]
    allowance = _Allowance(clock=lambda: now[0])
    assert all(allowance.take("flooder") for _ in range(DHT_REQUEST_BURST))
    assert not allowance.take("flooder")
    assert allowance.take("honest"), "each caller has its own allowance"
    now[0] += 1.0  # one second refills the rate's worth
    granted = sum(allowance.take("flooder") for _ in range(2 * int(DHT_REQUESTS_PER_SECOND)))
    assert granted == DHT_REQUESTS_PER_SECOND


def test_the_dht_allowance_remembers_a_bounded_number_of_callers():
    now = [0.0]
    allowance = _Allowance(clock=lambda: now[0])
    assert all(allowance.take(i) for i in range(MAX_DHT_CALLERS_TRACKED))
    # every caller still active: a new one is refused rather than remembered
    assert not allowance.take("newcomer") and len(allowance.tokens) == MAX_DHT_CALLERS_TRACKED
    now[0] += DHT_REQUEST_BURST / DHT_REQUESTS_PER_SECOND  # their allowances have refilled: they are forgotten
    assert allowance.take("newcomer") and len(allowance.tokens) == 1


FLOOD_CONCURRENCY = 32  # DHT requests the flooder keeps in flight
FLOOD_SECONDS = 60.0  # the most a flood runs before it gives up waiting for a refusal
BIG_FIND_KEYS = 20 * MAX_DHT_KEYS_PER_REQUEST


async def flood_dht_requests(info: dict, limit: int) -> dict:
    """From one client node: a find for BIG_FIND_KEYS keys, then pings, FLOOD_CONCURRENCY at a time, until one is
    refused or `limit` were answered (or FLOOD_SECONDS pass); then whether another caller is answered at once, and
    whether the flooder is answered again 2 s later."""
    flooder = await DHTNode.create(initial_peers=info["maddrs"], client_mode=True)
    other = await DHTNode.create(initial_peers=info["maddrs"], client_mode=True)
    try:
        peer = target_peer(info)
        keys = [DHTID.generate(f"key{i}") for i in range(BIG_FIND_KEYS)]
        big_find = await flooder.protocol.call_find(peer, keys)
        answered, refused, started = 0, 0, time.monotonic()
        while not refused and answered < limit and time.monotonic() - started < FLOOD_SECONDS:
            found = await asyncio.gather(*(flooder.protocol.call_ping(peer) for _ in range(FLOOD_CONCURRENCY)))
            answered += sum(result is not None for result in found)
            refused += sum(result is None for result in found)
        elapsed = time.monotonic() - started
        other_answered = await other.protocol.call_ping(peer) is not None
        await asyncio.sleep(2.0)
        again = await flooder.protocol.call_ping(peer) is not None
        return {
            "big_find_answered": big_find is not None,
            "answered": answered,
            "refused": refused,
            "seconds": elapsed,
            "other_answered": other_answered,
            "answered_again": again,
        }
    finally:
        await flooder.shutdown()
        await other.shutdown()


# the allowance of the target flooded below: far under the flooder's pace on any machine, a busy one included (the
# defaults are 5x hivemind's measured peak, which a loopback flood beside other work may not outrun)
TEST_RATE, TEST_BURST = 5, 50


@pytest.mark.slow
def test_a_flood_of_dht_requests_is_answered_at_a_bounded_rate():
    with target("ours", dht_allowance=f"{TEST_RATE},{TEST_BURST}") as info:
        assert (info["dht_rate"], info["dht_burst"]) == (TEST_RATE, TEST_BURST)
        ours = asyncio.run(flood_dht_requests(info, limit=100 * TEST_BURST))
    with target("plain") as plain_info:
        plain = asyncio.run(flood_dht_requests(plain_info, limit=ours["answered"] + ours["refused"]))
    results = {"plain": plain, "ours": ours}
    # hivemind's DHT (the control) answers a find for any number of keys, and every request of the flood
    assert plain["big_find_answered"] and plain["refused"] == 0, results
    assert plain["answered"] >= ours["answered"] + ours["refused"], results
    # ours refuses the find over the keys bound, then answers the flood's burst and its rate, no more
    assert not ours["big_find_answered"], results
    assert ours["refused"] > 0, results
    # (the flooder's own bootstrap, a few requests before the flood, drew on its allowance too)
    bound = TEST_BURST + TEST_RATE * ours["seconds"]
    assert TEST_BURST - 20 <= ours["answered"] <= bound, results
    # another caller keeps its own allowance, and the flooder's refills
    assert ours["other_answered"] and ours["answered_again"], results
