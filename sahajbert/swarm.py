"""Joining the swarm: multiaddr validation, the hivemind DHT, and the --initial_peers line others paste."""

import logging

import hivemind
from hivemind.utils.multiaddr import Multiaddr

from sahajbert import metrics
from sahajbert.arguments import SwarmArguments
from sahajbert.cli import UserError

logger = logging.getLogger(__name__)
EXAMPLE_MADDR = "/ip4/1.2.3.4/tcp/31337/p2p/QmXa1yGyEqqZrNqBGNd3YjUVWyKwYQ8Uw3tWNBhJuLbX9f"


def validate_initial_peers(peers: list[str]) -> list[str]:
    """Each initial peer must be a full libp2p multiaddr that names the peer id (/p2p/...)."""
    for peer in peers:
        try:
            maddr = Multiaddr(peer)
            has_peer_id = "p2p" in [protocol.name for protocol in maddr.protocols()]
        except Exception:  # multiaddr raises several types for malformed input
            has_peer_id = False
        if not has_peer_id:
            raise UserError(f"--initial_peers must be a libp2p multiaddr like {EXAMPLE_MADDR}, got '{peer}'")
    return list(peers)


def build_dht(
    swarm_args: SwarmArguments, record_validators=(), initial_peers: list[str] | None = None
) -> hivemind.DHT:
    """Start this peer's DHT node; an unreachable swarm is a UserError after --join_timeout seconds."""
    peers = validate_initial_peers(swarm_args.initial_peers if initial_peers is None else initial_peers)
    try:
        return hivemind.DHT(
            initial_peers=peers,
            start=True,
            startup_timeout=swarm_args.join_timeout,
            client_mode=swarm_args.client_mode,
            host_maddrs=swarm_args.host_maddrs,
            announce_maddrs=swarm_args.announce_maddrs or None,
            use_ipfs=swarm_args.use_ipfs,
            identity_path=swarm_args.identity_path,
            record_validators=list(record_validators),
        )
    except TimeoutError as e:
        raise UserError(f"no initial peer answered within {swarm_args.join_timeout:.0f} s: {' '.join(peers)}") from e
    except Exception as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "bootstrap failed" in message:
            message = f"none of the initial peers answered ({' '.join(peers)}); check the address and that it runs"
        raise UserError(f"could not join the swarm: {message}") from e


def initial_peers_line(dht: hivemind.DHT) -> str:
    """The exact flag other peers pass to join: every visible address of this peer, loopback last."""
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    maddrs.sort(key=lambda m: ("/127.0.0.1/" in m or "/::1/" in m, m))
    return "--initial_peers " + " ".join(maddrs)


class SwarmPeer:
    """What a trainer and the aux peer share: a DHT node and a hivemind optimizer, and leaving the swarm cleanly.

    Use as a context manager: `close()` shuts down the optimizer's averagers, then the DHT and its p2p daemon.
    """

    optimizer: hivemind.Optimizer | None = None

    def _join(self, swarm_args: SwarmArguments) -> None:
        """Start this peer's DHT node with the run's record validators (its metrics are signed with its key)."""
        validators, self.public_key = metrics.make_validators(swarm_args.run_id)
        self.dht = build_dht(swarm_args, validators)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.optimizer is not None:
            self.optimizer.shutdown()
        self.dht.shutdown()
