"""The swarm's flags: how a peer joins it (run id, addresses, identity, NAT) and an invite-only run's authority."""

from dataclasses import dataclass, field
from typing import ClassVar, Optional

# seconds: the longest a peer keeps a DHT record others store (hivemind_ext BoundedLocalStorage)
MAX_RECORD_LIFETIME = 3600.0


@dataclass
class SwarmArguments:
    """How this peer finds the others (hivemind DHT over libp2p)."""

    TITLE: ClassVar[str] = "swarm"

    run_id: str = field(default="sahajbert", metadata={"help": "Name of the training run; all its peers share it."})
    initial_peers: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Multiaddrs of peers already in the run, as printed by run_first_peer.py, e.g. "
            "/ip4/1.2.3.4/tcp/31337/p2p/Qm... (empty: start a new swarm)."
        },
    )
    host_maddrs: list[str] = field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
        metadata={"help": "Multiaddrs to listen on; tcp/0 picks a free port. Use a fixed port to be reachable."},
    )
    announce_maddrs: list[str] = field(
        default_factory=list, metadata={"help": "Public multiaddrs to tell others (behind NAT or a proxy)."}
    )
    identity_path: Optional[str] = field(
        default=None,
        metadata={"help": "Private key file that keeps this peer's id across restarts (created if missing)."},
    )
    client_mode: bool = field(
        default=False,
        metadata={
            "help": "Accept no incoming connections at all; the peer still trains, but cannot average with other "
            "client-mode peers or serve the state to newcomers (behind NAT, --auto_relay usually does better)."
        },
    )
    auto_relay: bool = field(
        default=True,
        metadata={
            "help": "When libp2p finds this peer unreachable (behind NAT), book a slot on a relay (--relays) and "
            "take incoming connections through it: it then averages and serves the state like any peer."
        },
    )
    relays: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Multiaddrs of the peers that relay for NAT'd volunteers (default: the initial peers; every "
            "reachable peer of this run relays, up to 4 GiB each way and 1 hour per relayed connection)."
        },
    )
    reachability: str = field(
        default="auto",
        metadata={
            "help": "auto: libp2p's AutoNAT asks other peers to dial back (about 15 s); public or private: skip "
            "that test when you know (a relaying peer should leave it to AutoNAT: see docs/volunteers.md).",
            "choices": ["auto", "public", "private"],
        },
    )
    invite: Optional[str] = field(
        default=None,
        metadata={
            "help": "NAME:SECRET for an invite-only run, as the organizer sent it: the first peer then grants this "
            "peer a short-lived access token, renewed in the background (see docs/organizers.md, invite-only runs)."
        },
    )
    use_ipfs: bool = field(default=False, metadata={"help": "Also find peers through the public IPFS DHT."})
    join_timeout: float = field(
        default=60.0, metadata={"help": "Seconds to wait for the initial peers to answer before giving up."}
    )
    verbose: bool = field(
        default=False,
        metadata={"help": "Also show hivemind's own INFO lines (matchmaking, progress refreshes, start-up notes)."},
    )


@dataclass
class AuthorityArguments:
    """An invite-only run: the first peer admits only the volunteers of its allowlist."""

    TITLE: ClassVar[str] = "invite-only"

    allowlist: Optional[str] = field(
        default=None,
        metadata={
            "help": "File of 'NAME SECRET' lines: only these volunteers may join (each passes --invite NAME:SECRET). "
            "Read again whenever it changes; a name removed from it is out within one --token_lifetime."
        },
    )
    token_lifetime: float = field(
        default=600.0,
        metadata={"help": "Seconds an access token is valid; peers renew theirs at half of it."},
    )
    add_invite: Optional[str] = field(
        default=None,
        metadata={"help": "Add NAME with a random secret to --allowlist, print the --invite to send them, and exit."},
    )

    def __post_init__(self):
        # peers renew at half the lifetime, and a renewal must reach the first peer and come back before it ends
        if self.token_lifetime < 10:
            raise ValueError(f"--token_lifetime must be at least 10 seconds, got {self.token_lifetime}")
        # the token is a DHT record, and peers keep none longer than this
        if self.token_lifetime > MAX_RECORD_LIFETIME:
            raise ValueError(
                f"--token_lifetime must be at most {MAX_RECORD_LIFETIME:.0f} seconds, got {self.token_lifetime}"
            )
        if self.add_invite is not None and self.allowlist is None:
            raise ValueError("--add_invite needs --allowlist FILE (the file the name is added to)")
