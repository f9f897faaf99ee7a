"""Shared fixtures: the bundled sample corpus and a tokenizer trained in-process on it."""

import os
from pathlib import Path

import pytest

from sahajbert.samples import SAMPLE_FILES

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing in the tests may need the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def sample_files() -> list[str]:
    return list(SAMPLE_FILES)


@pytest.fixture(scope="session")
def sample_texts() -> list[str]:
    texts = []
    for path in SAMPLE_FILES:
        texts += [t for t in Path(path).read_text(encoding="utf-8").split("\n\n") if t.strip()]
    return texts


@pytest.fixture(scope="session")
def trained_tokenizer_dir(tmp_path_factory, sample_texts) -> Path:
    """A tokenizer trained here, in-process, on the sample (not the shipped one: training itself is under test)."""
    from sahajbert.tokenization import save_tokenizer, train_tokenizer

    output = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_tokenizer(sample_texts, vocab_size=1500, show_progress=False), output)
    return output


@pytest.fixture(scope="session")
def tokenizer(trained_tokenizer_dir):
    from sahajbert.tokenization import load_tokenizer

    return load_tokenizer(trained_tokenizer_dir)
