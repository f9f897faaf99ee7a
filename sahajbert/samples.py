"""What the package ships for offline use: a Bengali sample corpus and the 2,000-piece tokenizer trained on it.

Both are package data (`sahajbert/sample_data/`), so they are found wherever the package is installed. The demo,
the tiny preset's tests and the benchmarks train on them; real runs stream the Hub corpus and use the real tokenizer.
"""

from importlib.resources import files
from pathlib import Path

# what --data_files and --tokenizer_path accept as a name for the bundled sample (no machine path in any default)
SAMPLE_NAME = "sample"
SAMPLE_DATA = Path(str(files("sahajbert") / "sample_data"))
SAMPLE_TOKENIZER = SAMPLE_DATA / "tokenizer"
# the released sahajBERT's tokenizer on the Hub (the 2021 run's vocabulary of 32,000), the default of a real run
REAL_TOKENIZER = "neuropark/sahajBERT"
SAMPLE_FILES = [str(SAMPLE_DATA / "corpus" / "bn_wiki.txt"), str(SAMPLE_DATA / "corpus" / "bn_web.txt")]
