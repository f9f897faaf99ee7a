#!/usr/bin/env python
"""Fine-tune on Bengali news classification (IndicGLUE sna.bn, or local CSV/JSONL files): accuracy, macro-F1."""

from sahajbert.cli import parse_args, run, setup_logging
from sahajbert.flags.finetune import finetune_flags


def main(argv=None) -> int:
    setup_logging()
    finetune_args, training_args = parse_args(finetune_flags("ncc"), argv)
    from sahajbert.finetuning import run_task

    run_task("ncc", finetune_args, training_args)
    return 0


if __name__ == "__main__":
    run(main)
