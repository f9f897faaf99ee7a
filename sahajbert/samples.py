"""Paths of what the repository ships for offline use: the Bengali sample corpus and the tokenizer trained on it."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE_TOKENIZER = REPO_ROOT / "tokenizer" / "sample"
SAMPLE_FILES = [str(REPO_ROOT / "data" / "sample" / "bn_wiki.txt"), str(REPO_ROOT / "data" / "sample" / "bn_web.txt")]
