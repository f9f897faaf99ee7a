"""Every command-line flag of every script, one dataclass per concern; defaults are the real sahajBERT values.

Parsed with `transformers.HfArgumentParser`, so each script also accepts a single `.json` file of these fields.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from sahajbert.corpus import DEFAULT_SOURCES, HUB_SOURCES

REPO_ROOT = Path(__file__).resolve().parent
SAMPLE_TOKENIZER = REPO_ROOT / "tokenizer" / "sample"
SAMPLE_FILES = [str(REPO_ROOT / "data" / "sample" / "bn_wiki.txt"), str(REPO_ROOT / "data" / "sample" / "bn_web.txt")]


@dataclass
class CorpusArguments:
    """Where the text comes from and how it becomes ALBERT examples (data/)."""

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
            "each one is a source and replaces --sources. Works offline."
        },
    )
    shuffle_buffer: int = field(default=10_000, metadata={"help": "Documents held in each source's shuffle buffer."})
    max_seq_length: int = field(default=512, metadata={"help": "Tokens per example, [CLS] and both [SEP] included."})
    short_seq_prob: float = field(
        default=0.1, metadata={"help": "Fraction of examples given a shorter random length (as in ALBERT)."}
    )
    mlm_probability: float = field(default=0.15, metadata={"help": "Fraction of tokens to predict in masked LM."})
    masking: str = field(
        default="whole_word", metadata={"help": "Masked-LM masking unit.", "choices": ["whole_word", "token"]}
    )
    pad_to_multiple_of: Optional[int] = field(
        default=8, metadata={"help": "Pad batches to a multiple of this many tokens (8 suits tensor cores)."}
    )
    tokenizer_path: str = field(
        default=str(SAMPLE_TOKENIZER),
        metadata={"help": "Tokenizer folder (tokenizer/train_tokenizer.py) or Hub name."},
    )

    def __post_init__(self):
        if self.max_seq_length < 8:
            raise ValueError(f"--max_seq_length must be at least 8, got {self.max_seq_length}")
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"--mlm_probability must be between 0 and 1, got {self.mlm_probability}")


@dataclass
class TokenizerTrainingArguments:
    """tokenizer/train_tokenizer.py: the Unigram tokenizer every peer shares."""

    vocab_size: int = field(default=32_000, metadata={"help": "Vocabulary size, the 5 special tokens included."})
    output_dir: str = field(default="tokenizer/sahajbert", metadata={"help": "Folder to write the tokenizer to."})
    max_texts: Optional[int] = field(
        default=None, metadata={"help": "Train on at most this many documents (default: the whole corpus)."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the corpus shuffle."})


@dataclass
class PreviewArguments:
    """data/preview.py: show what the model trains on."""

    num_examples: int = field(default=5, metadata={"help": "How many examples to show."})
    seed: int = field(default=0, metadata={"help": "Stream seed (each peer derives its own)."})
    json: bool = field(default=False, metadata={"help": "Print one JSON object per example instead of text."})
