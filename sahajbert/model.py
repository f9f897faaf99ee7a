"""Model presets (AlbertConfig JSON files) and the one place where the pretraining model is built."""

import logging
from pathlib import Path

import torch
from transformers import AlbertConfig, AlbertForPreTraining

from sahajbert.cli import UserError

logger = logging.getLogger(__name__)
PRESETS_DIR = Path(__file__).resolve().parent / "presets"
PRESETS = sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def load_config(model: str, tokenizer) -> AlbertConfig:
    """A preset name or a config path -> AlbertConfig whose vocabulary and special ids match `tokenizer`."""
    if model in PRESETS:
        config = AlbertConfig.from_json_file(PRESETS_DIR / f"{model}.json")
    elif Path(model).exists():
        try:
            config = (
                AlbertConfig.from_pretrained(model) if Path(model).is_dir() else AlbertConfig.from_json_file(model)
            )
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read a model config from '{model}': {str(e).splitlines()[0]}") from e
    else:
        raise UserError(f"unknown model '{model}': use a preset ({', '.join(PRESETS)}) or a path to a config")
    if config.vocab_size != len(tokenizer):
        logger.info(
            f"model vocabulary set to the tokenizer's {len(tokenizer)} pieces (config had {config.vocab_size})"
        )
    config.vocab_size = len(tokenizer)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = (
        tokenizer.pad_token_id,
        tokenizer.cls_token_id,
        tokenizer.sep_token_id,
    )
    return config


def build_model(model: str, tokenizer, seed: int, checkpoint: str | Path | None = None) -> AlbertForPreTraining:
    """Build the pretraining model: from `checkpoint` if given, else freshly initialized with the run's `seed`.

    Every peer of a run initializes with the same seed, so peers that start together start identical.
    """
    if checkpoint is not None:
        return AlbertForPreTraining.from_pretrained(checkpoint)
    config = load_config(model, tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AlbertForPreTraining(config)
