"""Joining the swarm: multiaddr validation, the hivemind DHT, and the --initial_peers line others paste."""

import dataclasses
import errno
import ipaddress
import logging
import os
import re
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import hivemind
from hivemind.utils.multiaddr import Multiaddr

from sahajbert import access, hivemind_ext, records, robust
from sahajbert.cli import UserError
from sahajbert.flags import MAX_RECORD_LIFETIME, SwarmArguments
from sahajbert.hivemind_ext import identity, p2p
from sahajbert.hivemind_ext.dht.process import GuardedDHT, drain_dht_calls
from sahajbert.link_probe import serve_link_probe
from sahajbert.signals import ignoring_signals

logger = logging.getLogger(__name__)
EXAMPLE_MADDR = "/ip4/1.2.3.4/tcp/31337/p2p/QmXa1yGyEqqZrNqBGNd3YjUVWyKwYQ8Uw3tWNBhJuLbX9f"
# what to do when no initial peer answers (also the fix `run_trainer.py --check` prints)
UNREACHABLE_FIX = (
    "Check that the first peer runs and that the address is exactly what run_first_peer.py printed (IP, port and "
    "the /p2p/ peer id: a peer with another id does not answer); a firewall may block the port"
)


def validate_initial_peers(peers: list[str], flag: str = "--initial_peers") -> list[str]:
    """Each initial peer (or relay) must be a full libp2p multiaddr that names the peer id (/p2p/...)."""
    for peer in peers:
        try:
            maddr = Multiaddr(peer)
            has_peer_id = "p2p" in [protocol.name for protocol in maddr.protocols()]
        except Exception:  # multiaddr raises several types for malformed input
            has_peer_id = False
        if not has_peer_id:
            raise UserError(f"{flag} must be a libp2p multiaddr like {EXAMPLE_MADDR}, got '{peer}'")
    return list(peers)


def check_identity_path(path: str | None) -> None:
    """--identity_path must be a file that holds a peer identity, or a new file in an existing folder."""
    if path is None:
        return
    file = Path(path)
    if file.is_dir():
        raise UserError(f"--identity_path '{path}' is a directory: give a file path (a new identity is created there)")
    if file.exists() and not identity.is_identity_file(str(file)):
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


class _GoneCaller(logging.Filter):
    """A request to the DHT process carries its reply channel (hivemind's MPFuture), which the DHT process fetches
    from the sending process: when that process (an averager at shutdown) has exited first, the DHT logs the failed
    fetch as an error with a traceback. The request's sender is gone, so nothing is lost."""

    GONE = (FileNotFoundError, ConnectionResetError, ConnectionRefusedError, EOFError)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.funcName == "_run" and record.exc_info and issubclass(record.exc_info[0], self.GONE))


_GONE_CALLER = _GoneCaller()


class _RoutineErrors(logging.Filter):
    """hivemind's errors that a user cannot act on become one INFO line, without a traceback, shown with --verbose
    only: an averaging round that found no group or failed (hivemind's averager logs each with its traceback; the
    trainer logs its own line per failed round, with what it does next), a state download hivemind retries (the
    trainer says what it decided), and an averager asked to shut down twice at a stop."""

    MESSAGES = ("Averaging step failed", "Failed to load state from peers", "Averager shutdown has no effect")
    LOGGERS = ("hivemind.averaging.averager", "hivemind.optim.optimizer")

    def __init__(self):
        super().__init__()
        self.verbose = False

    def filter(self, record: logging.LogRecord) -> bool:
        # averager.py's `_step` and `_aggregate_with_group` log a failed round as logger.exception(e)
        failed_round = record.funcName in ("_step", "_aggregate_with_group") and record.exc_info is not None
        if not (failed_round or str(record.msg).startswith(self.MESSAGES)):
            return True
        error = record.exc_info[1] if record.exc_info else None
        try:
            lines = record.getMessage().splitlines()
        except Exception:  # a message its arguments do not fit: the error names it
            lines = []
        first_line = lines[0] if lines else repr(error)
        record.msg = first_line if error is None or str(error) in first_line else f"{first_line} ({error!r})"
        record.args, record.exc_info, record.exc_text = (), None, None
        record.levelno, record.levelname = logging.INFO, "INFO"
        return self.verbose


_ROUTINE_ERRORS = _RoutineErrors()


def quiet_hivemind(verbose: bool) -> None:
    """hivemind's INFO lines and start-up advice go to the terminal only with --verbose; warnings and errors always."""
    logging.getLogger("hivemind").setLevel(logging.INFO if verbose else logging.WARNING)
    matchmaking = logging.getLogger("hivemind.averaging.matchmaking")
    matchmaking.removeFilter(_STARTUP_ADVICE)
    if not verbose:
        matchmaking.addFilter(_STARTUP_ADVICE)
    dht_process = logging.getLogger("hivemind.dht.dht")
    dht_process.removeFilter(_GONE_CALLER)
    dht_process.addFilter(_GONE_CALLER)
    _ROUTINE_ERRORS.verbose = verbose
    # hivemind moves the LR schedule to a downloaded state's step before this peer's first optimizer step: torch
    # warns of a skipped first value, but the schedule is where the swarm's step puts it
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")
    for name in _RoutineErrors.LOGGERS:  # installed before the averagers' processes fork, which inherit it
        logging.getLogger(name).removeFilter(_ROUTINE_ERRORS)
        logging.getLogger(name).addFilter(_ROUTINE_ERRORS)


def install_hivemind_ext() -> None:
    """Install the hivemind fence in this process with the project's policies (the robust rules, the longest a DHT
    record is kept), before its DHT starts; a hivemind release other than the one the fence follows is a UserError."""
    try:
        hivemind_ext.install(rules=robust, max_record_lifetime=MAX_RECORD_LIFETIME)
    except hivemind_ext.UnsupportedHivemind as e:
        raise UserError(str(e)) from None


def build_dht(
    swarm_args: SwarmArguments, record_validators=(), initial_peers: list[str] | None = None, authorizer=None
) -> hivemind.DHT:
    """Start this peer's DHT node; an unreachable swarm is a UserError after --join_timeout seconds.

    `authorizer`: an invite-only run's sahajbert.access.InviteAuthorizer (see `admission`)."""
    peers = validate_initial_peers(swarm_args.initial_peers if initial_peers is None else initial_peers)
    check_identity_path(swarm_args.identity_path)
    if swarm_args.identity_path is not None and not os.path.exists(swarm_args.identity_path):
        access.new_identity(swarm_args.identity_path)  # made here, not by hivemind, so that it is private (0600)
    check_ports_free(swarm_args.host_maddrs)
    quiet_hivemind(swarm_args.verbose)
    relays = relays_of(swarm_args, peers)
    relaying = p2p.relay_options(swarm_args.auto_relay, relays, swarm_args.reachability, swarm_args.client_mode)
    install_hivemind_ext()
    p2p.set_daemon_flags(**relaying["daemon"])
    try:
        dht = GuardedDHT(
            initial_peers=peers,
            start=True,
            startup_timeout=swarm_args.join_timeout,
            client_mode=swarm_args.client_mode,
            host_maddrs=swarm_args.host_maddrs,
            announce_maddrs=swarm_args.announce_maddrs or None,
            use_ipfs=swarm_args.use_ipfs,
            identity_path=swarm_args.identity_path,
            record_validators=list(record_validators),
            authorizer=authorizer,
            **relaying["dht"],
        )
    except TimeoutError as e:
        raise UserError(f"no initial peer answered within {swarm_args.join_timeout:.0f} s: {' '.join(peers)}") from e
    except Exception as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "bootstrap" in message:  # the p2p daemon: "failed to connect to bootstrap peers", "bootstrap failed"
            if authorizer is None and access.runs_authority(peers):
                raise access.InviteRequired() from e  # the peers answered, but refuse requests without a token
            raise UserError(f"none of the initial peers answered: {' '.join(peers)}. {UNREACHABLE_FIX}") from e
        raise UserError(f"could not join the swarm: {message}") from e
    serve_link_probe(dht)  # newcomers measure their link against this peer (a client-mode peer serves nothing)
    return dht


# seconds a peer with only private addresses waits to become reachable through a relay: AutoNAT's verdict (about
# 15 s here: other peers try to dial back) and the relay's reservation (under a second)
RELAY_WAIT = 45.0


@dataclass(frozen=True)
class Reachability:
    """How other peers reach this one: "public" (an address of its own), "relayed" (through a relay, behind NAT),
    "unreachable" (behind NAT, no relay took it), "client" (--client_mode) or "local" (private addresses and no
    public relay to test against: a LAN or this machine)."""

    kind: str
    address: str = ""


def public_ip(maddr: str) -> bool:
    """Whether a multiaddr names a public IP address (what a peer on the internet can dial)."""
    for address in re.findall(r"/ip[46]/([^/]+)/", maddr):
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            continue
        if not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_unspecified):
            return True
    return False


def relays_of(swarm_args: SwarmArguments, initial_peers: list[str] | None = None) -> list[str]:
    """The peers that relay for this one: --relays, else the initial peers (`initial_peers` when given)."""
    peers = swarm_args.initial_peers if initial_peers is None else initial_peers
    return validate_initial_peers(swarm_args.relays, "--relays") or list(peers)


def reachability(dht: hivemind.DHT, swarm_args: SwarmArguments, wait: float = RELAY_WAIT) -> Reachability:
    """Find out how others reach this peer; with only private addresses and a public relay, wait up to `wait`
    seconds for libp2p to book a relay slot (a circuit address appears among the visible addresses)."""
    if swarm_args.client_mode:
        return Reachability("client")
    # a swarm on the internet: then only private addresses here mean a NAT between this peer and the others
    internet = any(public_ip(relay) for relay in relays_of(swarm_args))
    deadline = time.monotonic() + wait
    while True:
        addresses = [str(m) for m in dht.get_visible_maddrs(latest=True)]
        circuits = [a for a in addresses if "/p2p-circuit" in a]
        if circuits:
            return Reachability("relayed", circuits[0])
        public = [a for a in addresses if public_ip(a)]
        if public:
            return Reachability("public", public[0])
        if not internet:
            return Reachability("local")
        if not swarm_args.auto_relay or time.monotonic() >= deadline:
            return Reachability("unreachable")
        time.sleep(1.0)


def admission(swarm_args: SwarmArguments) -> tuple[SwarmArguments, "access.SwarmAccess | None"]:
    """With --invite: this peer's identity (a temporary one without --identity_path) and its access token, asked
    of the initial peers; a refused invite is a UserError. Without: the arguments as they are, and None."""
    if not swarm_args.invite:
        return swarm_args, None
    quiet_hivemind(swarm_args.verbose)
    swarm_args = access.ensure_identity(swarm_args)
    return swarm_args, access.SwarmAccess.join(swarm_args)


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
    access: "access.SwarmAccess | None" = None

    def _join(self, swarm_args: SwarmArguments) -> None:
        """Start this peer's DHT node with the run's record validators (its metrics are signed with its key)."""
        validators, self.public_key = records.make_validators(swarm_args.run_id)
        swarm_args, self.access = admission(swarm_args)
        authorizer = self.access.authorizer if self.access is not None else None
        self.dht = build_dht(swarm_args, validators, authorizer=authorizer)
        logger.info(f"joined the swarm as peer {self.dht.peer_id}")
        self.reachability = reachability(self.dht, swarm_args)
        if self.reachability.kind == "relayed":
            logger.info(f"behind NAT: other peers reach this one through the relay {self.reachability.address}")
        elif self.reachability.kind == "unreachable":
            # others would try to connect and fail, failing every round they match it into: serve nobody instead
            logger.warning(
                "behind NAT and not reachable through a relay: joining again in client mode (it trains and sends its "
                "part of each round, but cannot serve the state or host a round)"
            )
            self.dht.shutdown()
            swarm_args = dataclasses.replace(swarm_args, client_mode=True)
            self.dht = build_dht(swarm_args, validators, authorizer=authorizer)
            self.reachability = Reachability("client")
        if self.access is not None:
            self.access.start(self.dht, self.public_key)

    @property
    def gate(self):
        """Who may call this peer's averagers: an invite-only run's members (None: anyone)."""
        return self.access.authorizer.gate if self.access is not None else None

    @property
    def access_lost(self) -> bool:
        return self.access is not None and self.access.failure is not None

    def check_access(self) -> None:
        """Leave with one line once this peer's invite could not be renewed."""
        if self.access is not None:
            self.access.check()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.leave()

    def leave(self) -> None:
        """close() with SIGINT/SIGTERM ignored from its first line (a role's stream, its dashboard) to its last: a
        second signal that stopped it at once there would skip leaving the swarm, and hivemind's progress tracker,
        never shut down, would then keep the process from exiting."""
        with ignoring_signals():
            self.close()

    def close(self) -> None:
        if self.access is not None:
            self.access.stop()
        if self.optimizer is not None:
            self.optimizer.shutdown()
        drain_dht_calls(self.dht)
        self.dht.shutdown()
