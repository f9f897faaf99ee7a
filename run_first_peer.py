#!/usr/bin/env python
"""Bootstrap a swarm: a DHT node that prints the --initial_peers line volunteers paste, until Ctrl+C."""

import logging
from pathlib import Path

from sahajbert.cli import Flags, UserError, parse_args, run, setup_logging
from sahajbert.flags import AuthorityArguments, SwarmArguments

logger = logging.getLogger("first_peer")
FLAGS = Flags(
    (SwarmArguments, AuthorityArguments),
    description="Start a run: a DHT node that prints the --initial_peers line volunteers paste, until Ctrl+C.",
    # client mode is refused below (the peer everyone dials must accept connections); the first peer holds the
    # invite authority, it needs no invite
    hidden=frozenset({"client_mode", "invite"}),
)


def main(argv=None) -> int:
    setup_logging()
    swarm_args, authority_args = parse_args(FLAGS, argv)
    if authority_args.add_invite is not None:
        from sahajbert.access import add_invite

        invite = add_invite(Path(authority_args.allowlist), authority_args.add_invite)
        logger.info(
            f"added '{invite.name}' to {authority_args.allowlist}; send them this flag, for their trainer line:"
        )
        print(f"--invite {invite.name}:{invite.secret}", flush=True)
        return 0
    if swarm_args.client_mode:
        raise UserError(
            "the first peer cannot run with --client_mode: every volunteer connects to it, so it must accept "
            "connections (run it on a machine with a reachable port; volunteers behind NAT use --client_mode)"
        )
    if swarm_args.reachability == "private":
        raise UserError("the first peer cannot run with --reachability private: every volunteer connects to it")
    from sahajbert.access import SwarmAccess, ensure_identity, read_allowlist
    from sahajbert.hivemind_ext.dht.process import drain_dht_calls
    from sahajbert.records import make_validators
    from sahajbert.signals import StopRequest, ignoring_signals
    from sahajbert.swarm import build_dht, initial_peers_line

    validators, public_key = make_validators(swarm_args.run_id)  # it stores and serves metrics: it validates too
    access = None
    if authority_args.allowlist is not None:
        invited = len(read_allowlist(Path(authority_args.allowlist)))  # a missing or broken file stops here
        # the authority signs with the first peer's identity: keep it with --identity_path across restarts
        swarm_args = ensure_identity(swarm_args)
        access = SwarmAccess.authority(swarm_args, authority_args.allowlist, authority_args.token_lifetime)
    dht = build_dht(swarm_args, validators, authorizer=access.authorizer if access is not None else None)
    try:
        line = initial_peers_line(dht)
        if access is not None:
            access.start(dht, public_key)
            logger.info(
                f"run '{swarm_args.run_id}' is invite-only ({invited} volunteers in {authority_args.allowlist}; "
                f"tokens last {authority_args.token_lifetime:.0f} s). Each joins with their own --invite:"
            )
            line += " --invite NAME:SECRET"
        else:
            logger.info(f"run '{swarm_args.run_id}' is open. Volunteers join with:")
        print(f"python run_trainer.py --run_id {swarm_args.run_id} {line}", flush=True)
        with StopRequest("stopping") as stop:
            while not stop.event.wait(timeout=1.0):  # the DHT serves peers in its own process; we only wait
                pass
    finally:
        with ignoring_signals():  # leaving takes a moment; a second Ctrl+C must not leave the p2p daemon behind
            drain_dht_calls(dht)
            dht.shutdown()
    logger.info("first peer stopped")
    return 0


if __name__ == "__main__":
    run(main)
