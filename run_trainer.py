#!/usr/bin/env python
"""A volunteer's trainer peer: `python run_trainer.py --run_id sahajbert --initial_peers <from run_first_peer.py>`."""

from arguments import (
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
)


def main(argv=None) -> int:
    setup_logging()
    args = parse_args(ARGUMENTS, argv)
    from sahajbert.training import train  # heavy imports after parsing, so --help and bad flags answer at once

    result = train(*args)
    print(
        f"trainer stopped at global step {result.final_step}"
        + (f"; checkpoint {result.checkpoint}" if result.checkpoint else "")
    )
    return 0


if __name__ == "__main__":
    run(main)
