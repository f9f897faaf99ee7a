#!/usr/bin/env python
"""Fine-tune on Bengali NER (WikiANN bn, or local CoNLL/JSONL files) and score with seqeval."""

from sahajbert.cli import parse_args, run, setup_logging
from sahajbert.flags.finetune import finetune_flags


def main(argv=None) -> int:
    setup_logging()
    finetune_args, training_args = parse_args(finetune_flags("ner"), argv)
    from sahajbert.finetuning import run_task

    run_task("ner", finetune_args, training_args)
    return 0


if __name__ == "__main__":
    run(main)
