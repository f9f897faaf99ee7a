"""What the trainer's parts (joining, ending, its reports) act through (`PeerContext`)."""

from dataclasses import dataclass

import hivemind

from sahajbert.flags import PeerArguments
from sahajbert.hivemind_ext.optim.optimizer import GuardedOptimizer


@dataclass(frozen=True)
class PeerContext:
    """A trainer's collaborative optimizer, its DHT node, the public key its records are signed with (the subkey
    of every record it stores), and its flags: built once by the trainer, shared by each of its parts."""

    optimizer: GuardedOptimizer
    dht: hivemind.DHT
    public_key: bytes
    peer_args: PeerArguments
