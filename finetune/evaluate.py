#!/usr/bin/env python
"""Both downstream tasks, several seeds, one or more models: the paper's table (mean ± std), side by side."""

import json
import logging
import shlex
from pathlib import Path

from sahajbert.cli import Flags, UserError, parse_args, run, setup_logging
from sahajbert.flags.finetune import EvaluationArguments, finetune_flags

logger = logging.getLogger("evaluate")
FLAGS = Flags(
    (EvaluationArguments,),
    description="Both downstream tasks, several seeds, one or more models: the paper's table (mean ± std).",
)


def main(argv=None) -> int:
    setup_logging()
    (args,) = parse_args(FLAGS, argv)
    from sahajbert.finetuning import TASKS, markdown_table, run_task, summarize

    unknown = sorted(set(args.tasks) - set(TASKS))
    if unknown:
        raise UserError(f"unknown task(s) {unknown}: use {', '.join(TASKS)}")
    output_dir = Path(args.output_dir)
    # every run's flags are parsed before the first run trains: a typo in --ncc_args must not wait for the NER runs
    plan = []
    for model_index, model in enumerate(args.models):
        for task in args.tasks:
            extra = shlex.split(args.ner_args if task == "ner" else args.ncc_args)
            for seed in args.seeds:
                run_dir = output_dir / f"model{model_index}" / task / f"seed{seed}"
                flags = ["--model_name_or_path", model, "--seed", str(seed), "--output_dir", str(run_dir)]
                flags += (["--protocol", args.protocol] if args.protocol else []) + extra
                try:
                    plan.append((model, task, seed, parse_args(finetune_flags(task), flags)))
                except UserError as e:
                    raise UserError(f"--{task}_args: {e}") from e
    runs = []
    for model, task, seed, (finetune_args, training_args) in plan:
        logger.info(f"{model} / {task} / seed {seed}")
        runs.append(run_task(task, finetune_args, training_args))
    table = summarize(runs)
    markdown = markdown_table(table, args.tasks)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.md").write_text(f"fine-tuning protocol: {args.protocol or 'defaults'}\n\n{markdown}\n")
    (output_dir / "results.json").write_text(json.dumps({"table": table, "runs": runs}, indent=2, ensure_ascii=False))
    protocol = f"the {args.protocol} protocol" if args.protocol else "this project's defaults"
    print(f"\ntest scores over seeds {args.seeds} (mean ± std, %), fine-tuned with {protocol}\n\n{markdown}\n")
    print(f"saved {output_dir / 'results.md'} and {output_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    run(main)
