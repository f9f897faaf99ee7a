"""Every global replacement of hivemind code the fence makes, in one list (`PATCHES`), applied by `install()`.

Each replaces one name that hivemind 1.1.12 looks up at run time, so that the processes this one starts or forks
afterwards (the DHT process, the averagers) use ours. Nothing here runs at import: `apply()` does, once.
"""

from collections.abc import Callable
from dataclasses import dataclass

from hivemind.averaging import allreduce as _averaging_allreduce
from hivemind.averaging import averager as _averaging_averager
from hivemind.compression import serialization as _serialization
from hivemind.dht import node as _dht_node
from hivemind.dht import protocol as _dht_protocol
from hivemind.p2p import P2P

from sahajbert.hivemind_ext.averaging.matchmaking import GuardedMatchmaking
from sahajbert.hivemind_ext.compression import (
    Quantile8Bit,
    Uniform8Bit,
    deserialize_tensor_part,
    serialize_tensor_part,
)
from sahajbert.hivemind_ext.dht.protocol import BoundedDHTProtocol
from sahajbert.hivemind_ext.dht.storage import BoundedLocalStorage
from sahajbert.hivemind_ext.p2p import _bounded_receive_raw_data, make_process_args


@dataclass(frozen=True)
class Patch:
    owner: object  # the hivemind module or class whose attribute is replaced, or the dict whose key is
    name: str
    make: Callable[[], object]  # the replacement, made when applied
    replaces: str  # the hivemind 1.1.12 code it replaces (file: function or class), and why

    def apply(self) -> None:
        value = self.make()
        if isinstance(self.owner, dict):
            self.owner[self.name] = value
        else:
            setattr(self.owner, self.name, value)


PATCHES = (
    Patch(
        _serialization._BASE_COMPRESSION_TYPES,
        "UNIFORM_8BIT",
        Uniform8Bit,
        "hivemind/compression/quantization.py: Uniform8BitQuantization, the decoder hivemind looks up by wire type "
        "(serialization._BASE_COMPRESSION_TYPES); its extract fails under numpy >= 2.4",
    ),
    Patch(
        _serialization._BASE_COMPRESSION_TYPES,
        "QUANTILE_8BIT",
        Quantile8Bit,
        "hivemind/compression/quantization.py: Quantile8BitQuantization, likewise",
    ),
    Patch(
        _averaging_allreduce,
        "deserialize_torch_tensor",
        lambda: deserialize_tensor_part,
        "hivemind/averaging/allreduce.py: deserialize_torch_tensor as AllReduceRunner reads parts and averages: it "
        "knows hivemind's wire types only, not SparseParts'",
    ),
    Patch(
        _averaging_allreduce,
        "serialize_torch_tensor",
        lambda: serialize_tensor_part,
        "hivemind/averaging/allreduce.py: serialize_torch_tensor as AllReduceRunner sends an average back in the "
        "part's wire type: likewise",
    ),
    Patch(
        P2P,
        "receive_raw_data",
        lambda: staticmethod(_bounded_receive_raw_data),
        "hivemind/p2p/p2p_daemon.py: P2P.receive_raw_data, which holds whatever length a stream message declares",
    ),
    Patch(
        P2P,
        "_make_process_args",
        lambda: staticmethod(make_process_args),
        "hivemind/p2p/p2p_daemon.py: P2P._make_process_args, which passes no relay limits or trusted relays to p2pd",
    ),
    Patch(
        _dht_protocol,
        "DHTLocalStorage",
        lambda: BoundedLocalStorage,
        "hivemind/dht/protocol.py: DHTLocalStorage as DHTProtocol makes its storage and cache: records unbounded",
    ),
    Patch(
        _dht_node,
        "DHTProtocol",
        lambda: BoundedDHTProtocol,
        "hivemind/dht/node.py: DHTProtocol as DHTNode.create makes it: requests unbounded in keys and rate",
    ),
    Patch(
        _averaging_averager,
        "Matchmaking",
        lambda: GuardedMatchmaking,
        "hivemind/averaging/averager.py: Matchmaking as DecentralizedAverager makes it in its process: it follows "
        "any leader, also one its averager left out",
    ),
)

_applied = False


def apply() -> None:
    """Apply every patch, once per process (a second call does nothing)."""
    global _applied
    if _applied:
        return
    for patch in PATCHES:
        patch.apply()
    _applied = True
