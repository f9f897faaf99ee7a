"""Joining the swarm: multiaddr validation, the hivemind DHT, and the --initial_peers line others paste."""

import errno
import logging
import re
import socket
from pathlib import Path

import hivemind
from hivemind.utils.multiaddr import Multiaddr

from sahajbert import hivemind_compat as compat
from sahajbert import metrics
from sahajbert.adaptive import serve_link_probe
from sahajbert.arguments import SwarmArguments
from sahajbert.cli import UserError
from sahajbert.signals import ignoring_signals

logger = logging.getLogger(__name__)
EXAMPLE_MADDR = "/ip4/1.2.3.4/tcp/31337/p2p/QmXa1yGyEqqZrNqBGNd3YjUVWyKwYQ8Uw3tWNBhJuLbX9f"
# what to do when no initial peer answers (also the fix `run_trainer.py --check` prints)
UNREACHABLE_FIX = (
    "Check that the first peer runs and that the address is exactly what run_first_peer.py printed (IP, port and "
    "the /p2p/ peer id: a peer with another id does not answer); a firewall may block the port"
)


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


def check_identity_path(path: str | None) -> None:
    """--identity_path must be a file that holds a peer identity, or a new file in an existing folder."""
    if path is None:
        return
    file = Path(path)
    if file.is_dir():
        raise UserError(f"--identity_path '{path}' is a directory: give a file path (a new identity is created there)")
    if file.exists() and not compat.is_identity_file(str(file)):
        raise UserError(
            f"--identity_path '{path}' does not hold a peer identity (the private key file a peer writes there): "
            "give the right file, or a new path to create a new identity"
        )
    if not file.exists() and not file.parent.is_dir():
        raise UserError(f"--identity_path '{path}': the folder '{file.parent}' does not exist")


def check_ports_free(host_maddrs: list[str]) -> None:
    """A fixed TCP port in --host_maddrs must be free: p2p daemons share a port (SO_REUSEPORT) without a word."""
    for maddr in host_maddrs:
        match = re.match(r"^/ip([46])/([^/]+)/tcp/(\d+)", maddr)
        if not match or int(match.group(3)) == 0:
            continue
        family = socket.AF_INET if match.group(1) == "4" else socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections in TIME_WAIT do not count
            try:
                probe.bind((match.group(2), int(match.group(3))))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise UserError(
                        f"port {match.group(3)} is already in use on {match.group(2)} (another peer?): stop that "
                        "process, or choose another port in --host_maddrs"
                    ) from e
                raise UserError(f"cannot listen on {maddr}: {e.strerror}") from e


class _StartupAdvice(logging.Filter):
    """hivemind's matchmaking advises at every start, once per averager, about a timeout it sets itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("It is recommended to use request_timeout smaller than")


_STARTUP_ADVICE = _StartupAdvice()


def quiet_hivemind(verbose: bool) -> None:
    """hivemind's INFO lines and start-up advice go to the terminal only with --verbose; warnings and errors always."""
    logging.getLogger("hivemind").setLevel(logging.INFO if verbose else logging.WARNING)
    matchmaking = logging.getLogger("hivemind.averaging.matchmaking")
    matchmaking.removeFilter(_STARTUP_ADVICE)
    if not verbose:
        matchmaking.addFilter(_STARTUP_ADVICE)


def build_dht(
    swarm_args: SwarmArguments, record_validators=(), initial_peers: list[str] | None = None
) -> hivemind.DHT:
    """Start this peer's DHT node; an unreachable swarm is a UserError after --join_timeout seconds."""
    peers = validate_initial_peers(swarm_args.initial_peers if initial_peers is None else initial_peers)
    check_identity_path(swarm_args.identity_path)
    check_ports_free(swarm_args.host_maddrs)
    quiet_hivemind(swarm_args.verbose)
    try:
        dht = hivemind.DHT(
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
        if "bootstrap" in message:  # the p2p daemon: "failed to connect to bootstrap peers", "bootstrap failed"
            raise UserError(f"none of the initial peers answered: {' '.join(peers)}. {UNREACHABLE_FIX}") from e
        raise UserError(f"could not join the swarm: {message}") from e
    serve_link_probe(dht)  # newcomers measure their link against this peer (a client-mode peer serves nothing)
    return dht


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
        with ignoring_signals():
            if self.optimizer is not None:
                self.optimizer.shutdown()
            self.dht.shutdown()
