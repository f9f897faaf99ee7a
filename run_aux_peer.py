#!/usr/bin/env python
"""The organizer's aux peer: `python run_aux_peer.py --run_id sahajbert --initial_peers ... --output_dir outputs/aux`.

Monitors the swarm (log, wandb, dashboard), saves its state as checkpoints, uploads them to the Hub, can assist
all-reduce without training, and can serve a saved state to rescue a run whose peers all left.
"""

from sahajbert.arguments import AuxPeerArguments, PeerArguments
from sahajbert.cli import parse_args, run, setup_logging


def main(argv=None) -> int:
    setup_logging()
    peer_args, aux_args = parse_args((PeerArguments, AuxPeerArguments), argv)
    from sahajbert.auxiliary import run_aux_peer

    run_aux_peer(peer_args, aux_args)
    return 0


if __name__ == "__main__":
    run(main)
