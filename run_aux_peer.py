#!/usr/bin/env python
"""The organizer's aux peer: `python run_aux_peer.py --run_id sahajbert --initial_peers ... --output_dir outputs/aux`.

Monitors the swarm (log, wandb, dashboard), saves its state as checkpoints, uploads them to the Hub, can assist
all-reduce without training, and can serve a saved state to rescue a run whose peers all left.
"""

from arguments import (
    AuxPeerArguments,
    AveragingArguments,
    CollaborativeOptimizerArguments,
    CorpusArguments,
    ModelArguments,
    SwarmArguments,
    TrainingArguments,
)
from sahajbert.cli import parse_args, run, setup_logging

ARGUMENTS = (
    SwarmArguments,
    AveragingArguments,
    CollaborativeOptimizerArguments,
    ModelArguments,
    TrainingArguments,
    CorpusArguments,
    AuxPeerArguments,
)


def main(argv=None) -> int:
    setup_logging()
    args = parse_args(ARGUMENTS, argv)
    from sahajbert.auxiliary import run_aux_peer

    run_aux_peer(*args)
    return 0


if __name__ == "__main__":
    run(main)
