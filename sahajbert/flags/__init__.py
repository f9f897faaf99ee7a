"""Every command-line flag of every script, one dataclass per concern, in a module per part of the run.

Defaults are the real sahajBERT run's values, except where a field's help says otherwise (the demo's own flags, and
`--data_files sample` / `--tokenizer_path sample`, which name the bundled sample). Parsed by `sahajbert.cli`, one
help group per class (its TITLE); each script also accepts a settings `.json` file of these fields, which its flags
override. The library types its parameters with these classes; `arguments.py` at the repository root is the page
that lists them for users. Fine-tuning's and evaluation's groups are in `sahajbert.flags.finetune` (they import
transformers, which no peer script's `--help` may need).
"""

from sahajbert.flags.averaging import AveragingArguments, CollaborativeOptimizerArguments, SparseDiLoCoArguments
from sahajbert.flags.data import CorpusArguments, PreviewArguments, TokenizerTrainingArguments
from sahajbert.flags.peers import (
    RECIPE_EXPANSION,
    AuxPeerArguments,
    LocalSwarmArguments,
    PeerArguments,
    TrainerScriptArguments,
)
from sahajbert.flags.swarm import MAX_RECORD_LIFETIME, AuthorityArguments, SwarmArguments
from sahajbert.flags.training import LocalTrainingArguments, ModelArguments

__all__ = [
    "AuthorityArguments",
    "AuxPeerArguments",
    "AveragingArguments",
    "CollaborativeOptimizerArguments",
    "CorpusArguments",
    "LocalSwarmArguments",
    "LocalTrainingArguments",
    "MAX_RECORD_LIFETIME",
    "ModelArguments",
    "PeerArguments",
    "PreviewArguments",
    "RECIPE_EXPANSION",
    "SparseDiLoCoArguments",
    "SwarmArguments",
    "TokenizerTrainingArguments",
    "TrainerScriptArguments",
]
