"""The DHT requests a peer answers, bounded in keys per request and in rate per caller (`BoundedDHTProtocol`)."""

import time
from collections.abc import Callable

from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import dht_pb2

from sahajbert.hivemind_ext.refusals import RefusalLog

# The DHT requests this peer answers for one caller. hivemind's DHTProtocol answers every request at once, whatever
# its number of keys and however often it comes: a find for K keys builds K results with up to bucket_size (20)
# neighbours each (one 4 MiB request of 32-byte keys: about 120,000 keys and a response of hundreds of MB, built
# before the p2p daemon refuses to send it), and each request with a sender's node info starts a ping task. An
# honest peer's get or store names a few keys (a progress record, a matchmaking key, a state declaration), but
# hivemind's matchmaking polls its group key while it looks for a group: an honest trainer sends one node at most
# ~110 finds a second (two trainers and an aux peer refreshing every second), most often 2-60. The rate bound is 5x
# that peak. Beyond it a request is refused as a failed call (the caller's DHT then counts this peer as unresponsive
# to it).
MAX_DHT_KEYS_PER_REQUEST = 256
DHT_REQUESTS_PER_SECOND = 500.0  # per calling peer, the rate its allowance refills at
DHT_REQUEST_BURST = 2500  # per calling peer: its allowance when full (5 s at the rate)
# callers whose allowance is remembered; beyond, those whose allowance has refilled are forgotten, and while all are
# active a new caller is refused (a swarm has tens of peers: so many callers at once are one flood of identities)
MAX_DHT_CALLERS_TRACKED = 10_000
_refused_dht_keys, _refused_dht_rate = RefusalLog(), RefusalLog()


class DHTRequestRefused(Exception):
    """A DHT request over a bound: the p2p layer answers the caller with this error (nothing is logged per request)."""


class _Allowance:
    """A token bucket per calling peer: DHT_REQUEST_BURST requests at once, DHT_REQUESTS_PER_SECOND after that."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.tokens: dict[PeerID, tuple[float, float]] = {}  # peer -> (tokens, when counted: the clock's seconds)

    def take(self, peer: PeerID) -> bool:
        now = self.clock()
        tokens, counted = self.tokens.get(peer, (DHT_REQUEST_BURST, now))
        tokens = min(DHT_REQUEST_BURST, tokens + (now - counted) * DHT_REQUESTS_PER_SECOND)
        if len(self.tokens) >= MAX_DHT_CALLERS_TRACKED and peer not in self.tokens:
            self._forget_idle(now)
            if len(self.tokens) >= MAX_DHT_CALLERS_TRACKED:  # that many callers active at once: a flood of identities
                return False
        if tokens < 1:
            self.tokens[peer] = (tokens, now)
            return False
        self.tokens[peer] = (tokens - 1, now)
        return True

    def _forget_idle(self, now: float) -> None:
        """Drop the callers whose allowance has refilled: remembering them or not gives the same answer."""
        refill = DHT_REQUEST_BURST / DHT_REQUESTS_PER_SECOND
        self.tokens = {peer: value for peer, value in self.tokens.items() if now - value[1] < refill}


class BoundedDHTProtocol(DHTProtocol):
    """hivemind's DHTProtocol within MAX_DHT_KEYS_PER_REQUEST and each caller's request allowance (`_Allowance`).
    Installed for every DHT node this process or its children start (`hivemind.dht.node.DHTProtocol`); it serves
    under hivemind's handler names, so it answers and calls plain hivemind peers as before."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._allowance = _Allowance()
        # requests this node answered, and their bytes (request and response, as protobuf messages): what the swarm
        # asks of one peer grows with the swarm (`requests_served`)
        self.served_requests, self.served_bytes = 0, 0

    def _count(self, request, response):
        self.served_requests += 1
        self.served_bytes += request.ByteSize() + response.ByteSize()
        return response

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return DHTProtocol._get_handle_name(namespace, method_name)

    def _admit(self, context: P2PContext, keys: int) -> None:
        if keys > MAX_DHT_KEYS_PER_REQUEST:
            _refused_dht_keys.refused(
                f"refused a DHT request for {keys} keys from peer {context.remote_id} (the bound is "
                f"{MAX_DHT_KEYS_PER_REQUEST})"
            )
            raise DHTRequestRefused(f"more than {MAX_DHT_KEYS_PER_REQUEST} keys")
        if not self._allowance.take(context.remote_id):
            _refused_dht_rate.refused(
                f"refused a DHT request from peer {context.remote_id}: over {DHT_REQUESTS_PER_SECOND:.0f} requests "
                f"per second (after a burst of {DHT_REQUEST_BURST})"
            )
            raise DHTRequestRefused("too many requests")

    async def rpc_ping(self, request: dht_pb2.PingRequest, context: P2PContext) -> dht_pb2.PingResponse:
        # hivemind's rpc_find and rpc_store ping on their caller's behalf, in a task of their own: that ping was
        # admitted with its request (raising in it would only log an unretrieved task exception)
        if not context.handle_name.endswith(".rpc_ping"):
            return await super().rpc_ping(request, context)
        self._admit(context, keys=0)
        return self._count(request, await super().rpc_ping(request, context))

    async def rpc_store(self, request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
        self._admit(context, keys=len(request.keys))
        return self._count(request, await super().rpc_store(request, context))

    async def rpc_find(self, request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
        self._admit(context, keys=len(request.keys))
        return self._count(request, await super().rpc_find(request, context))


async def _served(_dht, node) -> tuple[int, int]:
    return node.protocol.served_requests, node.protocol.served_bytes


def requests_served(dht) -> tuple[int, int]:
    """DHT requests this peer's node has answered so far, and their bytes (`BoundedDHTProtocol`); read from the DHT
    process (`DHTNode.protocol`, hivemind 1.1.12)."""
    return dht.run_coroutine(_served)
