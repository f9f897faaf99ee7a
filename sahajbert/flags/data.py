"""The data's flags: the corpus and its examples, the tokenizer's training, the data preview."""

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from sahajbert.corpus import DEFAULT_SOURCES, HUB_SOURCES, SAMPLE_NAME
from sahajbert.samples import REAL_TOKENIZER


@dataclass
class CorpusArguments:
    """Where the text comes from and how it becomes ALBERT examples (data/)."""

    TITLE: ClassVar[str] = "data"
    sources: list[str] = field(
        default_factory=lambda: list(DEFAULT_SOURCES),
        metadata={"help": f"Hub sources to stream: presets {', '.join(HUB_SOURCES)} or 'owner/name[:config]'."},
    )
    source_probabilities: Optional[list[float]] = field(
        default=None,
        metadata={"help": "Sampling probability of each source, in order (default: 0.23 0.77 for two, else uniform)."},
    )
    data_files: Optional[list[str]] = field(
        default=None,
        metadata={
            "help": "Local .txt (blank-line separated documents), .jsonl/.json or .parquet files (or globs); "
            f"each one is a source and replaces --sources. Works offline. '{SAMPLE_NAME}': the bundled Bengali sample."
        },
    )
    shuffle_buffer: int = field(default=10_000, metadata={"help": "Documents held in each source's shuffle buffer."})
    max_seq_length: int = field(default=512, metadata={"help": "Tokens per example, [CLS] and both [SEP] included."})
    short_seq_prob: float = field(
        default=0.1, metadata={"help": "Fraction of examples given a shorter random length (as in ALBERT)."}
    )
    mlm_probability: float = field(default=0.15, metadata={"help": "Fraction of tokens to predict in masked LM."})
    masking: str = field(
        default="whole_word",
        metadata={
            "help": "Masked-LM masking unit: whole Bengali words, or tokens (as both references did in effect).",
            "choices": ["whole_word", "token"],
        },
    )
    sentence_boundaries: str = field(
        default="lines",
        metadata={
            "help": "Where sentences end: lines (\u0964, \u0965, ?, ! and line breaks) or punctuation (\u0964, ?, ! "
            "only, as both references split: a danda rewrite, then NLTK punkt).",
            "choices": ["lines", "punctuation"],
        },
    )
    chunking: str = field(
        default="albert",
        metadata={
            "help": "How sentences become an example: albert (up to a target length, --short_seq_prob of them "
            "shorter) or references (sentences added until --max_seq_length tokens, then truncated).",
            "choices": ["albert", "references"],
        },
    )
    pad_to_multiple_of: Optional[int] = field(
        default=8, metadata={"help": "Pad batches to a multiple of this many tokens (8 suits tensor cores)."}
    )
    tokenizer_path: str = field(
        default=REAL_TOKENIZER,
        metadata={
            "help": "Tokenizer folder (tokenizer/train_tokenizer.py) or Hub name; the default is the released "
            f"sahajBERT tokenizer. '{SAMPLE_NAME}': the bundled 2,000-piece sample tokenizer (for trying things out)."
        },
    )

    def __post_init__(self):
        if self.max_seq_length < 8:
            raise ValueError(f"--max_seq_length must be at least 8, got {self.max_seq_length}")
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"--mlm_probability must be between 0 and 1, got {self.mlm_probability}")


@dataclass
class TokenizerTrainingArguments:
    """tokenizer/train_tokenizer.py: the Unigram tokenizer every peer shares."""

    TITLE: ClassVar[str] = "tokenizer"

    vocab_size: int = field(default=32_000, metadata={"help": "Vocabulary size, the 5 special tokens included."})
    output_dir: str = field(default="tokenizer/sahajbert", metadata={"help": "Folder to write the tokenizer to."})
    max_texts: Optional[int] = field(
        default=None, metadata={"help": "Train on at most this many documents (default: the whole corpus)."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the corpus shuffle."})


@dataclass
class PreviewArguments:
    """data/preview.py: show what the model trains on."""

    TITLE: ClassVar[str] = "preview"

    num_examples: int = field(default=5, metadata={"help": "How many examples to show."})
    seed: int = field(default=0, metadata={"help": "Stream seed (each peer derives its own)."})
    json: bool = field(default=False, metadata={"help": "Print one JSON object per example instead of text."})
