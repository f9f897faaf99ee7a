#!/usr/bin/env python
"""Every flag of every script, one group per concern: `python arguments.py` prints them all with their help.

The groups are dataclasses defined once in `sahajbert/flags/` (a module per part of the run; fine-tuning's and
evaluation's in `sahajbert/flags/finetune.py`): the library types its parameters with them, and this page re-exports
them. Each script's `--help` shows the flags it takes, one group per concern; each also accepts a settings `.json`
file of these fields before its flags, which override it.

| group | what it sets | scripts |
|---|---|---|
| SwarmArguments | run id, initial peers, addresses, identity, NAT, invite | first peer, trainer, aux peer |
| AveragingArguments | matchmaking, timeouts, group, bandwidth, compression, final round | trainer, aux peer |
| CollaborativeOptimizerArguments | target batch, delayed updates, state averaging, DiLoCo | trainer, aux peer |
| SparseDiLoCoArguments | DiLoCo's sparse pseudo-gradients (error feedback) and fragments | trainer, aux peer |
| ModelArguments | the model preset or config | trainer, aux peer |
| LocalTrainingArguments | batch, LAMB and schedule, precision, device, checkpoints | trainer, aux peer |
| CorpusArguments | sources or files, sequence length, masking, tokenizer | trainer, aux, tokenizer, preview |
| PeerArguments | all seven groups above together: what a trainer and the aux peer are built from | trainer, aux peer |
| AuthorityArguments | an invite-only run's allowlist and token lifetime | first peer |
| TrainerScriptArguments | --auto_config, --check | trainer |
| AuxPeerArguments | monitor, checkpoints, wandb, Hub upload, assist, rescue, dashboard | aux peer |
| LocalSwarmArguments | the demo swarm | run_local_swarm.py |
| TokenizerTrainingArguments | vocabulary size, output folder | tokenizer/train_tokenizer.py |
| PreviewArguments | how many examples, seed, JSON | data/preview.py |
| FinetuneArguments, FinetuneTrainingArguments | task data and the transformers training flags | finetune/train_*.py |
| EvaluationArguments | models, seeds, tasks, per-task flags | finetune/evaluate.py |
"""

from sahajbert.flags import (
    AuthorityArguments,
    AuxPeerArguments,
    AveragingArguments,
    CollaborativeOptimizerArguments,
    CorpusArguments,
    LocalSwarmArguments,
    LocalTrainingArguments,
    ModelArguments,
    PeerArguments,
    PreviewArguments,
    SparseDiLoCoArguments,
    SwarmArguments,
    TokenizerTrainingArguments,
    TrainerScriptArguments,
)
from sahajbert.flags.finetune import EvaluationArguments, FinetuneArguments, FinetuneTrainingArguments

__all__ = [
    "AuthorityArguments",
    "AuxPeerArguments",
    "AveragingArguments",
    "CollaborativeOptimizerArguments",
    "CorpusArguments",
    "EvaluationArguments",
    "FinetuneArguments",
    "FinetuneTrainingArguments",
    "LocalSwarmArguments",
    "LocalTrainingArguments",
    "ModelArguments",
    "PeerArguments",
    "PreviewArguments",
    "SparseDiLoCoArguments",
    "SwarmArguments",
    "TokenizerTrainingArguments",
    "TrainerScriptArguments",
]
# the groups of our own flags, in the order of the table above (transformers documents its own training flags)
OWN_GROUPS = [*PeerArguments.GROUPS, AuthorityArguments, TrainerScriptArguments, AuxPeerArguments, LocalSwarmArguments]
OWN_GROUPS += [TokenizerTrainingArguments, PreviewArguments, FinetuneArguments, EvaluationArguments]


def main(argv=None) -> int:
    import argparse

    from sahajbert.cli import Flags, help_text

    parser = argparse.ArgumentParser(
        description="Print every flag of every script, group by group, with its help.", allow_abbrev=False
    )
    parser.add_argument("groups", nargs="*", help="only these groups, e.g. SwarmArguments (default: all)")
    names = parser.parse_args(argv).groups
    unknown = set(names) - {group.__name__ for group in OWN_GROUPS}
    if unknown:
        parser.error(f"unknown group(s) {sorted(unknown)}: use {', '.join(group.__name__ for group in OWN_GROUPS)}")
    for group in OWN_GROUPS:
        if names and group.__name__ not in names:
            continue
        print(f"## {group.__name__}: {group.__doc__.strip().splitlines()[0]}\n")
        text = help_text(Flags((group,)), group.__name__)
        # the group's flags: after its "title:" line and its description (printed above)
        block = text.split(f"\n{getattr(group, 'TITLE', group.__name__)}:\n", 1)[1]
        print(block.split("\n", 1)[1].strip("\n") + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
