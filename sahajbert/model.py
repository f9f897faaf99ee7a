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
        logger.warning(
            f"the model's vocabulary follows the tokenizer: {len(tokenizer)} pieces, where '{model}' has "
            f"{config.vocab_size} (the sahajBERT presets are made for its 32,000-piece tokenizer)"
        )
    config.vocab_size = len(tokenizer)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = (
        tokenizer.pad_token_id,
        tokenizer.cls_token_id,
        tokenizer.sep_token_id,
    )
    return config


def load_pretrained(model_class, path: str | Path, **kwargs):
    """`model_class.from_pretrained(path)`; a missing, truncated or foreign checkpoint is one UserError naming it."""
    folder = Path(path)
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise UserError(f"'{path}' is not a model checkpoint: it has no config.json")
    try:
        return model_class.from_pretrained(str(path), **kwargs)
    except Exception as e:  # OSError, ValueError, safetensors' SafetensorError, torch's unpickling errors, ...
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not folder.exists():
            raise UserError(
                f"cannot load the model '{path}': no such folder here, nor from the Hub: {first_line}"
            ) from e
        raise UserError(
            f"cannot load the model in '{path}' ({type(e).__name__}: {first_line}): the checkpoint is incomplete or "
            "damaged; use another one (a peer's output_dir keeps the last few)"
        ) from e


def build_model(model: str, tokenizer, seed: int, checkpoint: str | Path | None = None) -> AlbertForPreTraining:
    """Build the pretraining model: from `checkpoint` if given, else freshly initialized with the run's `seed`.

    Every peer of a run initializes with the same seed, so peers that start together start identical.
    """
    if checkpoint is not None:
        return load_pretrained(AlbertForPreTraining, checkpoint)
    config = load_config(model, tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AlbertForPreTraining(config)
