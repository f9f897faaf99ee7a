"""The flags of fine-tuning and evaluation (finetune/): transformers' TrainingArguments with this project's defaults,
the task data, and the evaluation of several models. Apart from the other groups because transformers'
arguments import torch: the pretraining scripts' `--help` does not need it."""

import shlex
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import transformers

from sahajbert.cli import Flags
from sahajbert.recipes import PROTOCOLS


@dataclass
class FinetuneArguments:
    """finetune/train_ner.py and finetune/train_ncc.py: model and data of a downstream task."""

    TITLE: ClassVar[str] = "fine-tuning data"

    model_name_or_path: str = field(
        metadata={"help": "A pretraining checkpoint folder (e.g. outputs/demo/trainer0/checkpoint-10) or a Hub name."}
    )
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset (default: unimelb-nlp/wikiann for NER, ai4bharat/indic_glue)."}
    )
    dataset_config: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset config (default: bn for NER, sna.bn for classification)."}
    )
    train_file: Optional[str] = field(
        default=None, metadata={"help": "Local training file: CoNLL or JSONL for NER, CSV or JSONL for news."}
    )
    validation_file: Optional[str] = field(default=None, metadata={"help": "Local validation file (same formats)."})
    test_file: Optional[str] = field(default=None, metadata={"help": "Local test file (same formats)."})
    max_seq_length: int = field(default=128, metadata={"help": "Tokens per example after truncation."})
    max_train_samples: Optional[int] = field(
        default=None, metadata={"help": "Use only this many training examples (quick runs)."}
    )
    early_stopping_patience: int = field(
        default=3, metadata={"help": "Stop after this many evaluations (epochs) without improvement."}
    )
    early_stopping_threshold: float = field(
        default=0.0, metadata={"help": "Smallest improvement of the validation metric that counts."}
    )
    best_model_metric: str = field(
        default="task",
        metadata={
            "help": "What picks the best epoch and early-stops: task (F1 for NER, accuracy for news) or loss (the "
            "validation loss, as both references did).",
            "choices": ["task", "loss"],
        },
    )
    hidden_dropout_prob: Optional[float] = field(
        default=None, metadata={"help": "Dropout in the model while fine-tuning (default: the checkpoint's)."}
    )
    protocol: Optional[str] = field(
        default=None,
        metadata={
            "help": "Fine-tune as a reference evaluated: its learning rate, batch, epochs, early stopping, best epoch "
            "by validation loss, maximum length and dropout; flags you give win. See the protocol table in "
            "docs/models-and-evaluation.md.",
            "choices": ["sahajbert", "sahajbert-xl"],
        },
    )

    def __post_init__(self):
        local = [self.train_file, self.validation_file, self.test_file]
        if any(local) and not all(local):
            raise ValueError("give all three of --train_file, --validation_file and --test_file, or none")


@dataclass
class FinetuneTrainingArguments(transformers.TrainingArguments):
    """The usual transformers training flags, with defaults for evaluation every epoch and keeping the best model.

    Every flag of transformers' TrainingArguments is accepted; help lists ours and the common ones (SHOWN_INHERITED).
    """

    TITLE: ClassVar[str] = "fine-tuning"
    HIDE_INHERITED: ClassVar[bool] = True
    SHOWN_INHERITED: ClassVar[frozenset[str]] = frozenset(
        {
            "seed",
            "weight_decay",
            "warmup_steps",
            "lr_scheduler_type",
            "gradient_accumulation_steps",
            "max_grad_norm",
            "fp16",
            "bf16",
            "use_cpu",
            "dataloader_num_workers",
            "disable_tqdm",
        }
    )

    output_dir: str = field(default="outputs/finetune", metadata={"help": "Where the model and results.json go."})
    num_train_epochs: float = field(default=10.0, metadata={"help": "Most epochs (early stopping may end sooner)."})
    learning_rate: float = field(default=5e-5, metadata={"help": "Peak AdamW learning rate."})
    per_device_train_batch_size: int = field(default=16, metadata={"help": "Training batch size per device."})
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "Evaluation batch size per device."})
    eval_strategy: str = field(default="epoch", metadata={"help": "When to evaluate (every epoch)."})
    save_strategy: str = field(default="epoch", metadata={"help": "When to save (every epoch, best kept)."})
    logging_strategy: str = field(default="epoch", metadata={"help": "When to log training loss."})
    load_best_model_at_end: bool = field(default=True, metadata={"help": "Test the best epoch, not the last."})
    save_total_limit: int = field(default=1, metadata={"help": "Checkpoints kept besides the best one."})
    report_to: str = field(default="none", metadata={"help": "Logging integrations (e.g. wandb)."})


@dataclass
class EvaluationArguments:
    """finetune/evaluate.py: both tasks, several seeds, one or more models, one table."""

    TITLE: ClassVar[str] = "evaluation"

    models: list[str] = field(metadata={"help": "Model folders or Hub names to compare, side by side."})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Fine-tuning seeds per model."})
    tasks: list[str] = field(default_factory=lambda: ["ner", "ncc"], metadata={"help": "Tasks: ner, ncc."})
    output_dir: str = field(default="outputs/evaluation", metadata={"help": "Runs, results.md and results.json."})
    ner_args: str = field(default="", metadata={"help": "Extra flags for every NER run, e.g. '--train_file ...'."})
    ncc_args: str = field(default="", metadata={"help": "Extra flags for every classification run."})
    protocol: Optional[str] = field(
        default=None,
        metadata={
            "help": "Every run fine-tunes as this reference did (--protocol of train_ner.py / train_ncc.py).",
            "choices": ["sahajbert", "sahajbert-xl"],
        },
    )

    def __post_init__(self):
        for name in ("ner_args", "ncc_args"):
            text = getattr(self, name)
            try:
                shlex.split(text)
            except ValueError as e:  # shlex's own message: "No closing quotation", "No escaped character"
                raise ValueError(f"--{name} is not a valid command line ({str(e).lower()}): {text}") from e


def finetune_flags(task: str) -> Flags:
    """The flags of finetune/train_<task>.py, also what finetune/evaluate.py checks every run's flags with."""
    description = {
        "ner": "Fine-tune on Bengali NER (WikiANN bn, or local CoNLL/JSONL files) and score with seqeval.",
        "ncc": "Fine-tune on Bengali news classification (IndicGLUE sna.bn, or local CSV/JSONL files).",
    }[task]
    return Flags(
        (FinetuneArguments, FinetuneTrainingArguments),
        description=description,
        defaults={"output_dir": f"outputs/{task}"},
        expansions={"protocol": PROTOCOLS[task]},
    )
