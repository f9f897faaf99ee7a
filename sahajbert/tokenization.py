"""The sahajBERT tokenizer: Bengali normalization, pre-tokenization, Unigram training, and loading."""

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from sahajbert.cli import UserError
from sahajbert.samples import REAL_TOKENIZER, SAMPLE_NAME, SAMPLE_TOKENIZER

logger = logging.getLogger(__name__)

# Ids 0..4 in this order: collators, the model config and the checkpoints rely on them.
SPECIAL_TOKENS = ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]
MAX_LENGTH = 512
# Unigram stops short of --vocab_size when the text has too few distinct pieces; below this share it is no tokenizer
# of that size at all (an English-only file asked for 1,000 pieces gives 48)
MIN_VOCAB_FRACTION = 0.5
WORD_START = "\u2581"  # "▁", SentencePiece's marker for a piece that begins a word
BENGALI_LETTERS = "\u0980-\u09ff"


def build_normalizer() -> normalizers.Normalizer:
    """sahajBERT's normalization: unify dandas and visarga, NFKC, collapse spaces, lowercase Latin."""
    return normalizers.Sequence(
        [
            normalizers.Nmt(),
            normalizers.NFKC(),
            normalizers.Replace(Regex(" {2,}"), " "),
            # Danda look-alikes -> the danda U+0964: the Bengali-block "danda" U+09E4 (unassigned, but seen in
            # scraped text), the ASCII pipe and U+09F7 (a currency sign) that many writers type for a danda.
            # One regex pass instead of three: each normalizer step re-walks the string with its alignments.
            normalizers.Replace(Regex("[\u09e4|\u09f7]"), "\u0964"),
            normalizers.Replace("\u09e5", "\u0965"),  # the same for the double danda
            # a colon right after a Bengali letter is a visarga typed on a Latin keyboard
            normalizers.Replace(Regex(f"(?<=[{BENGALI_LETTERS}]):"), "\u0983"),
            normalizers.Lowercase(),
        ]
    )


def build_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Split on spaces (SentencePiece style), then every digit alone, then punctuation."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement=WORD_START, prepend_scheme="always"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(),
        ]
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int, length: int | None = None, show_progress: bool = True):
    """Train a Unigram tokenizer on `texts` and return it wrapped for transformers (no hand edits needed)."""
    if vocab_size <= len(SPECIAL_TOKENS):
        raise UserError(f"--vocab_size must be larger than the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = build_normalizer()
    tokenizer.pre_tokenizer = build_pre_tokenizer()
    tokenizer.decoder = decoders.Metaspace(replacement=WORD_START, prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, unk_token="<unk>", show_progress=show_progress
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    if tokenizer.get_vocab_size() <= len(SPECIAL_TOKENS):
        raise UserError("the tokenizer learned no pieces: the training corpus is empty")
    if tokenizer.get_vocab_size() < MIN_VOCAB_FRACTION * vocab_size:
        raise UserError(
            f"the corpus gave only {tokenizer.get_vocab_size()} pieces, far below --vocab_size {vocab_size}: train on "
            "more (Bengali) text, or ask for a smaller vocabulary; nothing was saved"
        )
    return wrap_tokenizer(tokenizer)


def wrap_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """Add the pair template and special-token roles so `AutoTokenizer.from_pretrained` works as is."""
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    # lstrip: "আমি [MASK] খাই" must not leave a lone "▁" piece before the mask (as in ALBERT's own tokenizer)
    mask = AddedToken("[MASK]", lstrip=True, rstrip=False, special=True, normalized=False)
    tokenizer.add_special_tokens([mask])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        unk_token="<unk>",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token=mask,
        model_max_length=MAX_LENGTH,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, output_dir: str | Path) -> None:
    """Save in transformers format, naming the generic fast class so any transformers version can load it."""
    tokenizer.save_pretrained(output_dir)
    config_path = Path(output_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def hub_offline() -> bool:
    """True when the Hub is switched off for this process (what huggingface_hub and datasets read)."""
    return any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE") for name in HUB_OFFLINE_VARIABLES)


HUB_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
# seconds to wait for the Hub's answer before a load that would retry for about a minute is called off
HUB_PROBE_TIMEOUT = 5.0


def hub_unreachable(timeout: float = HUB_PROBE_TIMEOUT) -> str | None:
    """Why the Hub (huggingface_hub's endpoint, through the environment's proxies) gives no answer; None if it answers
    (with any HTTP status)."""
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as e:
        return str(getattr(e, "reason", e))
    return None


def looks_like_a_path(name: str) -> bool:
    """A Hub name is "owner/name"; anything else with a slash, or starting with . or ~, means a local folder."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer folder (or Hub name, or `sample`); a missing or broken one is a UserError naming the path."""
    if str(path) == SAMPLE_NAME:
        path = SAMPLE_TOKENIZER
    folder = Path(path).expanduser()
    if folder.resolve() == SAMPLE_TOKENIZER.resolve():
        logger.warning(
            "using the bundled 2,000-piece sample tokenizer, which suits trying things out: a real run uses "
            f"--tokenizer_path {REAL_TOKENIZER} (the default) or a folder made by tokenizer/train_tokenizer.py"
        )
    if folder.is_file():
        raise UserError(f"--tokenizer_path '{path}' is a file: give the folder that holds tokenizer.json")
    if folder.exists() and not (folder / "tokenizer.json").is_file():
        raise UserError(f"no tokenizer in '{path}': expected {folder / 'tokenizer.json'}")
    if not folder.exists() and looks_like_a_path(str(path)):
        raise UserError(f"tokenizer folder not found: '{path}' (make one with tokenizer/train_tokenizer.py)")
    if not folder.exists() and hub_offline():
        raise UserError(
            f"--tokenizer_path '{path}': no such folder here, and the Hub is switched off (HF_HUB_OFFLINE): give a "
            f"tokenizer folder, e.g. --tokenizer_path {SAMPLE_NAME} (the bundled sample tokenizer)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder if folder.exists() else path))
    except (OSError, ValueError) as e:
        raise UserError(
            f"cannot load a tokenizer from '{path}': {str(e).splitlines()[0]} (offline? use a local folder, "
            f"e.g. --tokenizer_path {SAMPLE_NAME})"
        ) from e
    if not tokenizer.is_fast:
        raise UserError(
            f"the tokenizer in '{path}' is not a fast tokenizer; train one with tokenizer/train_tokenizer.py"
        )
    missing = [
        role
        for role in ("pad_token_id", "cls_token_id", "sep_token_id", "mask_token_id")
        if getattr(tokenizer, role) is None
    ]
    if missing:
        raise UserError(f"the tokenizer in '{path}' lacks special tokens: {', '.join(missing)}")
    return tokenizer


def word_start_table(tokenizer: PreTrainedTokenizerBase) -> list[bool]:
    """For each vocabulary id: does this piece begin a new word? Used by whole-word masking."""
    table = [False] * len(tokenizer)
    for piece, index in tokenizer.get_vocab().items():
        table[index] = piece.startswith(WORD_START)
    for index in tokenizer.all_special_ids:
        table[index] = True  # a special token is a word of its own (and is never masked)
    return table
