"""Model presets and the one place where every model is built or loaded: ALBERT, and LeanALBERT (sahajBERT-XL).

A config (a preset, a file, a checkpoint or a Hub name) is LeanALBERT by its fields (`hidden_act_gated`,
`position_embedding_type: "rotary"`), as the released sahajBERT-XL says it is, whatever its `architectures` say.
"""

import json
import logging
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import (
    AlbertConfig,
    AlbertForMaskedLM,
    AlbertForPreTraining,
    AlbertForSequenceClassification,
    AlbertForTokenClassification,
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    PreTrainedModel,
)

from sahajbert.cli import UserError
from sahajbert.lean_albert import (
    LeanAlbertConfig,
    LeanAlbertForMaskedLM,
    LeanAlbertForPreTraining,
    LeanAlbertForSequenceClassification,
    LeanAlbertForTokenClassification,
    is_lean_albert,
)

logger = logging.getLogger(__name__)
PRESETS_DIR = Path(__file__).resolve().parent / "presets"
PRESETS = sorted(p.stem for p in PRESETS_DIR.glob("*.json"))
# what a model is for -> its class, for each architecture
MODEL_CLASSES = {
    "pretraining": (AlbertForPreTraining, LeanAlbertForPreTraining),
    "masked_lm": (AlbertForMaskedLM, LeanAlbertForMaskedLM),
    "token_classification": (AlbertForTokenClassification, LeanAlbertForTokenClassification),
    "sequence_classification": (AlbertForSequenceClassification, LeanAlbertForSequenceClassification),
}
AUTO_CLASSES = {
    "pretraining": AutoModelForPreTraining,
    "masked_lm": AutoModelForMaskedLM,
    "token_classification": AutoModelForTokenClassification,
    "sequence_classification": AutoModelForSequenceClassification,
}


def config_from_dict(values: dict) -> AlbertConfig:
    """AlbertConfig, or LeanAlbertConfig when the fields say LeanALBERT."""
    values = {k: v for k, v in values.items() if k not in ("model_type", "transformers_version", "auto_map")}
    return LeanAlbertConfig(**values) if is_lean_albert(values) else AlbertConfig(**values)


def model_class(config: AlbertConfig, task: str = "pretraining") -> type[PreTrainedModel]:
    albert, lean = MODEL_CLASSES[task]
    return lean if isinstance(config, LeanAlbertConfig) else albert


def supports_gradient_checkpointing(config: AlbertConfig) -> bool:
    """Whether the model recomputes activations on --gradient_checkpointing (LeanALBERT does; transformers' ALBERT,
    the sahajbert preset, does not)."""
    return model_class(config).supports_gradient_checkpointing


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read a model config from '{path}': {str(e).splitlines()[0]}") from e


def config_values(model: str) -> dict:
    """The config fields of a preset name, a config .json, a checkpoint folder or a Hub name."""
    if model in PRESETS:
        return _read_json(PRESETS_DIR / f"{model}.json")
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"'{model}' is not a model checkpoint: it has no config.json")
        return _read_json(path / "config.json")
    if path.is_file():
        return _read_json(path)
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise UserError(f"unknown model '{model}': use a preset ({', '.join(PRESETS)}) or a path to a config")
    from transformers import AutoConfig

    try:  # a Hub name
        return AutoConfig.from_pretrained(model).to_dict()
    except Exception as e:  # offline, no such repo
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load the model '{model}': no such folder here, nor from the Hub: {first_line}") from e


def read_config(model: str) -> AlbertConfig:
    """The ALBERT or LeanALBERT config of a preset name, a config .json, a checkpoint folder or a Hub name."""
    values = config_values(model)
    if values.get("model_type", "albert") != "albert":
        raise UserError(f"'{model}' is a {values['model_type']} model: pretraining here is ALBERT or LeanALBERT")
    return config_from_dict(values)


def load_config(model: str, tokenizer) -> AlbertConfig:
    """A preset name or a config path -> its config, with the vocabulary and special ids of `tokenizer`."""
    config = read_config(model)
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


def load_model(path: str | Path, task: str = "pretraining", **config_overrides) -> PreTrainedModel:
    """The model in a checkpoint we wrote or a released-format folder (ALBERT or LeanALBERT), or a Hub name, with
    the head for `task` (pretraining, masked_lm, token_classification, sequence_classification).

    `config_overrides` (num_labels, id2label, ...) change the config before the weights load; a head the
    checkpoint lacks starts freshly initialized, as `from_pretrained` does. Other architectures (a BERT or XLM-R to
    compare with, in fine-tuning) load through transformers' Auto classes.
    """
    values = config_values(str(path))
    if values.get("model_type", "albert") != "albert":
        return load_pretrained(AUTO_CLASSES[task], path, **config_overrides)
    config = config_from_dict({**values, **config_overrides})
    return load_pretrained(model_class(config, task), path, config=config)


def load_pretrained(model_class, path: str | Path, **kwargs):
    """`model_class.from_pretrained(path)`; a missing, truncated or foreign checkpoint is one UserError naming it."""
    folder = Path(path)
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise UserError(f"'{path}' is not a model checkpoint: it has no config.json")
    try:
        # transformers logs a many-line load report (at WARNING) whenever a head is new: one line here says the same
        with quiet_logger("transformers.modeling_utils"):
            model, info = model_class.from_pretrained(str(path), output_loading_info=True, **kwargs)
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
    new, unused = info.get("missing_keys", []), info.get("unexpected_keys", [])
    if new or unused:
        heads = sorted({key.split(".")[0] for key in new})
        logger.info(
            f"loaded {path}: {len(new)} new tensors ({', '.join(heads)}) start freshly initialized"
            + (f", {len(unused)} of the checkpoint's tensors (a head of another task) are not used" if unused else "")
        )
    return model


@contextmanager
def quiet_logger(name: str, level: int = logging.ERROR):
    """Raise the logger `name`'s level for the duration of the block."""
    library_logger = logging.getLogger(name)
    previous = library_logger.level
    library_logger.setLevel(level)
    try:
        yield
    finally:
        library_logger.setLevel(previous)


def build_model(model: str, tokenizer, seed: int, checkpoint: str | Path | None = None) -> PreTrainedModel:
    """Build the pretraining model: from `checkpoint` if given, else freshly initialized with the run's `seed`.

    Every peer of a run initializes with the same seed, so peers that start together start identical.
    """
    if checkpoint is not None:
        return load_model(checkpoint)
    config = load_config(model, tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return model_class(config)(config)


def count_parameters(config: AlbertConfig, task: str = "pretraining") -> int:
    """Parameters of the model `config` describes, counted without allocating them."""
    with torch.device("meta"):
        return sum(p.numel() for p in model_class(config, task)(config).parameters())
