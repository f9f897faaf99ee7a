#!/usr/bin/env python
"""Bootstrap a swarm: a DHT node that prints the --initial_peers line volunteers paste, until Ctrl+C."""

import logging

from sahajbert.arguments import SwarmArguments
from sahajbert.cli import Flags, UserError, parse_args, run, setup_logging

logger = logging.getLogger("first_peer")
FLAGS = Flags(
    (SwarmArguments,),
    description="Start a run: a DHT node that prints the --initial_peers line volunteers paste, until Ctrl+C.",
    hidden=frozenset({"client_mode"}),  # refused below: the peer everyone dials must accept connections
)


def main(argv=None) -> int:
    setup_logging()
    (swarm_args,) = parse_args(FLAGS, argv)
    if swarm_args.client_mode:
        raise UserError(
            "the first peer cannot run with --client_mode: every volunteer connects to it, so it must accept "
            "connections (run it on a machine with a reachable port; volunteers behind NAT use --client_mode)"
        )
    if swarm_args.reachability == "private":
        raise UserError("the first peer cannot run with --reachability private: every volunteer connects to it")
    from sahajbert.metrics import make_validators
    from sahajbert.signals import StopRequest, ignoring_signals
    from sahajbert.swarm import build_dht, initial_peers_line

    validators, _ = make_validators(swarm_args.run_id)  # the first peer stores and serves metrics: it validates too
    dht = build_dht(swarm_args, validators)
    try:
        line = initial_peers_line(dht)
        logger.info(f"run '{swarm_args.run_id}' is open. Volunteers join with:")
        print(f"python run_trainer.py --run_id {swarm_args.run_id} {line}", flush=True)
        with StopRequest("stopping") as stop:
            while not stop.event.wait(timeout=1.0):  # the DHT serves peers in its own process; we only wait
                pass
    finally:
        with ignoring_signals():  # leaving takes a moment; a second Ctrl+C must not leave the p2p daemon behind
            dht.shutdown()
    logger.info("first peer stopped")
    return 0


if __name__ == "__main__":
    run(main)
