"""hivemind's p2p layer: the bound on a stream message, the p2pd flags for relays, and our protocols' handlers.

Each p2p daemon this process (or the DHT process it forks) starts gets `_DAEMON_FLAGS` (set by `set_daemon_flags`)
through `make_process_args`, which `patches` installs as hivemind's `P2P._make_process_args`.
"""

import asyncio

from hivemind.p2p import P2P

from sahajbert.hivemind_ext.refusals import RefusalLog

# bytes: the most one message of a p2p stream may declare. hivemind's own are at most an all-reduce part (2^19 bytes,
# DEFAULT_PART_SIZE_BYTES) or a state chunk (2^16 bytes), plus a header; its reader (P2P.receive_raw_data) waits
# for whatever length a peer's 8-byte header declares and holds every byte of it, so one stream could fill a peer's
# memory. Unary requests go through the p2p daemon, which bounds them (4 MiB, DEFAULT_MAX_MSG_SIZE).
MAX_STREAM_MESSAGE_BYTES = 8 * 2**20


_refused_messages = RefusalLog()


async def _bounded_receive_raw_data(reader: asyncio.StreamReader) -> bytes:
    """hivemind's P2P.receive_raw_data (hivemind 1.1.12, hivemind/p2p/p2p_daemon.py), refusing a message declared
    larger than MAX_STREAM_MESSAGE_BYTES before any of it is read: the stream is then closed as if its sender had
    left (hivemind's reader ends quietly on that). Installed as `P2P.receive_raw_data` by `install()`."""
    header = await reader.readexactly(P2P.HEADER_LEN)
    length = int.from_bytes(header, P2P.BYTEORDER)
    if length > MAX_STREAM_MESSAGE_BYTES:
        _refused_messages.refused(
            f"closed a p2p stream whose message declared {length} bytes (the bound is {MAX_STREAM_MESSAGE_BYTES})"
        )
        raise asyncio.IncompleteReadError(partial=b"", expected=length)
    return await reader.readexactly(length)


# a relayed connection is reset after this much data (bytes, each way) or time (s): the most libp2p accepts
RELAY_DATA_LIMIT = 1 << 32
RELAY_TIME_LIMIT = 3600

# p2pd flags that hivemind.P2P.create does not pass on: added to every p2p daemon this process starts, through
# `P2P._make_process_args` (its one place that turns keyword arguments into the daemon's command line)
_DAEMON_FLAGS: dict[str, object] = {}
_hivemind_make_process_args = P2P._make_process_args  # hivemind's own, which `make_process_args` calls


def make_process_args(*args, **kwargs):
    """hivemind's P2P._make_process_args (hivemind 1.1.12, hivemind/p2p/p2p_daemon.py), called with the flags of
    `set_daemon_flags` added to its keyword arguments; with none set, the same command line as hivemind's."""
    flags = dict(_DAEMON_FLAGS)
    if "trustedRelays" not in kwargs:
        # a daemon started without the relays (P2P.is_identity_taken's probe, with --identity_path): p2pd
        # refuses autoRelay with neither relay discovery nor trusted relays
        flags.pop("relayDiscovery", None)
    return _hivemind_make_process_args(*args, **{**kwargs, **flags})


def set_daemon_flags(**flags) -> None:
    """Extra p2pd flags for the daemons this process (and the DHT process it forks) starts from now on (through
    `make_process_args`, installed by `install()`)."""
    _DAEMON_FLAGS.clear()
    _DAEMON_FLAGS.update(flags)


def relay_options(auto_relay: bool, relays: list[str], reachability: str, client_mode: bool) -> dict:
    """hivemind.DHT keyword arguments, and the p2pd flags hivemind lacks, for NAT traversal over libp2p relays.

    - A NAT'd peer books a slot on the given relays as soon as AutoNAT finds it private. p2pd's default relay
      discovery waits 3 minutes for 4 candidates; `-relayDiscovery=0` with `-trustedRelays` uses these at once.
    - Every peer that accepts connections relays (p2pd's `-relayService`, on by default) with limits sized for
      averaging: libp2p's default is 128 KiB and 2 minutes per relayed connection, which resets an all-reduce a
      fraction of the way in (a state download then ends early: "shape ... is invalid for input of size ...").
      p2pd (learning-at-home's, main.go) starts two relay services on one protocol: one with libp2p's defaults at
      start-up, and one with these limits once AutoNAT finds the peer public; the later one takes the protocol
      over. So a relay must not force its reachability public (`--reachability public` makes the two start
      together, and either may win), and libp2p's bounds hold: asked for more than its 1 h reservation or
      4 GiB (24 h or 1 TiB, say), the second service fails to start.
    """
    options: dict = {}
    flags: dict[str, object] = {"relayDataLimit": RELAY_DATA_LIMIT, "relayTimeLimit": f"{RELAY_TIME_LIMIT}s"}
    if reachability != "auto":
        options["force_reachability"] = reachability
    if auto_relay and relays and not client_mode:
        options.update(use_auto_relay=True, trusted_relays=list(relays))
        flags["relayDiscovery"] = False
    return {"dht": options, "daemon": flags}


# tasks of ours running in the DHT process, held until done (see kept_alive)
_KEPT: set = set()


async def kept_alive(coroutine):
    """Await `coroutine` as a task this module holds. hivemind's DHT process runs each `run_coroutine` call in a task
    that nothing references, and asyncio's client streams hold their reader weakly: a call waiting on a p2p stream
    can be garbage-collected mid-wait (GeneratorExit in the DHT process; the caller's future never resolves)."""
    task = asyncio.ensure_future(coroutine)
    _KEPT.add(task)
    task.add_done_callback(_KEPT.discard)
    return await task


def p2p_of(node) -> P2P:
    """The p2p daemon client of a DHT node (`DHTNode.p2p`), in the DHT process (a `dht.run_coroutine` call)."""
    return node.p2p


async def add_stream_handler(node, protocol: str, handler) -> None:
    """Serve `protocol` (one of ours: the invite authority, the link probe) on a DHT node's p2p daemon, in the DHT
    process: `handler(stream_info, reader, writer)` answers each stream a peer opens (`P2P.add_binary_stream_handler`,
    hivemind 1.1.12)."""
    await p2p_of(node).add_binary_stream_handler(protocol, handler)
