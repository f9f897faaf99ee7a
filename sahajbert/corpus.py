"""Text sources: Bengali Wikipedia and web text from the Hub, or local files, mixed and shuffled per peer."""

import glob
import itertools
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sahajbert.cli import UserError
from sahajbert.samples import SAMPLE_FILES, SAMPLE_NAME

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubSource:
    """A Hub dataset that loads with `datasets` streaming, without a loading script."""

    path: str
    name: str | None
    text_column: str
    gated: bool
    data_files: str | None = None
    note: str = ""


# Read from the Hub's pages and code (the Hub is unreachable from CI): see docs/data.md, "Corpus sources".
HUB_SOURCES = {
    "wikipedia": HubSource("wikimedia/wikipedia", "20231101.bn", "text", gated=False, note="~143k Bengali articles"),
    "fineweb2": HubSource(
        "HuggingFaceFW/fineweb-2", "ben_Beng", "text", gated=False, note="ungated Bengali web text (default)"
    ),
    "oscar": HubSource(
        "json",
        None,
        "content",
        gated=True,
        data_files="hf://datasets/oscar-corpus/community-oscar/data/*/ben_Beng/*.jsonl.zst",
        note="gated: accept the terms on the Hub, then export HF_TOKEN",
    ),
}
DEFAULT_SOURCES = ("wikipedia", "fineweb2")
DEFAULT_PROBABILITIES = (0.23, 0.77)  # DeDLOC's sahajBERT mix: Wikipedia 23%, web text 77%

LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
TEXT_COLUMNS = ("text", "content")  # what local files may call their text field
COMPRESSED = (".gz", ".zst", ".bz2", ".xz")
# a source's script share is judged on its first documents: enough to tell, cheap to count
SCRIPT_SAMPLE_DOCUMENTS = 200
MIN_BENGALI_SHARE = 0.5  # below this share of Bengali-script letters, the tokenizer and sentence splitter do not fit


@dataclass(frozen=True)
class Source:
    """One resolved stream: a Hub dataset or a local file (or glob of files) read by the same `datasets` code."""

    label: str
    builder: str
    config: str | None
    data_files: tuple[str, ...] | None
    text_column: str | None  # None: pick the first of TEXT_COLUMNS that a record has


class SkipCounter:
    """Counts bad records by reason; warns on the 1st, 10th, 100th, ... of each so logs stay short."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def skip(self, reason: str) -> None:
        count = self.counts.get(reason, 0) + 1
        self.counts[reason] = count
        if str(count).rstrip("0") == "1":
            logger.warning(f"skipped {count} record(s) so far: {reason}")


def bengali_share(texts: Sequence[str]) -> float | None:
    """The share of letters in `texts` that are in the Bengali script (U+0980-U+09FF); None if there are none."""
    letters = bengali = 0
    for text in texts:
        for char in text:
            if char.isalpha():
                letters += 1
                bengali += "\u0980" <= char <= "\u09ff"
    return bengali / letters if letters else None


def warn_if_not_bengali(label: str, texts: Sequence[str]) -> None:
    share = bengali_share(texts)
    if share is not None and share < MIN_BENGALI_SHARE:
        logger.warning(
            f"'{label}' is mostly not Bengali: {100 * share:.0f}% of the letters in its first {len(texts)} "
            "document(s) are in the Bengali script. The tokenizer and the sentence splitter (sentences end at "
            "।, ?, ! or a line break) are made for Bengali text"
        )


def _local_builder(path: str) -> str:
    if os.path.isdir(path):
        raise UserError(f"data file '{path}' is a directory: give the files in it, e.g. --data_files '{path}/*.txt'")
    suffixes = [s for s in Path(path).suffixes if s not in COMPRESSED]
    builder = LOCAL_BUILDERS.get(suffixes[-1] if suffixes else "")
    if builder is None:
        raise UserError(f"unsupported file type '{path}': use .txt, .jsonl, .json or .parquet (optionally .gz/.zst)")
    return builder


def _check_local_file(path: str, builder: str) -> None:
    if not os.path.isfile(path):
        raise UserError(f"data file not found: '{path}'")
    if os.path.getsize(path) == 0:
        raise UserError(f"data file is empty: '{path}'")
    if builder in ("text", "json") and not path.endswith(COMPRESSED):
        with open(path, "rb") as f:
            head = f.read(1 << 20)
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.start < len(head) - 4:  # a multi-byte character cut at the 1 MiB boundary is fine
                raise UserError(f"data file is not UTF-8 text: '{path}' (byte {e.start})") from e


def resolve_sources(names: Sequence[str], data_files: Sequence[str] | None) -> list[Source]:
    """Turn --sources / --data_files into Sources; local files win, each file (or glob) is one source.

    `--data_files sample` names the bundled sample corpus. Hub sources fail at once when the Hub is switched off.
    """
    if data_files:
        sources = []
        if SAMPLE_NAME in data_files:
            data_files = [f for name in data_files for f in (SAMPLE_FILES if name == SAMPLE_NAME else [name])]
        if set(SAMPLE_FILES) & set(data_files):
            logger.warning(
                "training on the bundled sample corpus (136 KB of Bengali text), which suits trying things out: a "
                "real run streams the Hub corpus (leave out --data_files) or reads your own files"
            )
        for pattern in data_files:
            paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
            if not paths:
                raise UserError(f"no data files match '{pattern}'")
            builders = {_local_builder(p) for p in paths}
            if len(builders) > 1:
                raise UserError(f"'{pattern}' mixes file types; give each type as its own --data_files entry")
            for path in paths:
                _check_local_file(path, builders.copy().pop())
            sources.append(Source(pattern, builders.pop(), None, tuple(paths), None))
        return sources
    sources = []
    for name in names:
        if name in HUB_SOURCES:
            hub = HUB_SOURCES[name]
            files = (hub.data_files,) if hub.data_files else None
            if hub.gated and not (os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")):
                logger.warning(f"source '{name}' ({hub.path}) is gated: {hub.note}")
            sources.append(Source(name, hub.path, hub.name, files, hub.text_column))
        elif "/" in name:  # any other Hub repo with data files: "owner/name" or "owner/name:config"
            repo, _, config = name.partition(":")
            sources.append(Source(name, repo, config or None, None, None))
        else:
            known = ", ".join(HUB_SOURCES)
            raise UserError(
                f"unknown source '{name}': use one of {known}, a Hub repo 'owner/name[:config]', or --data_files"
            )
    from sahajbert.tokenization import hub_offline

    if sources and hub_offline():
        raise UserError(
            f"the sources {' '.join(names)} are on the Hub, and the Hub is switched off here (HF_HUB_OFFLINE): "
            f"use local files, e.g. --data_files {SAMPLE_NAME} (the bundled sample) or --data_files my_corpus/*.txt"
        )
    return sources


def resolve_probabilities(sources: Sequence[Source], probabilities: Sequence[float] | None) -> list[float]:
    """Explicit probabilities must match the sources; without them: the sahajBERT mix for two sources, else uniform."""
    if probabilities is None:
        probabilities = DEFAULT_PROBABILITIES if len(sources) == len(DEFAULT_PROBABILITIES) else [1.0] * len(sources)
    if len(probabilities) != len(sources):
        raise UserError(f"got {len(probabilities)} --source_probabilities for {len(sources)} sources")
    if any(p < 0 for p in probabilities) or sum(probabilities) <= 0:
        raise UserError(f"--source_probabilities must be non-negative and not all zero, got {list(probabilities)}")
    total = sum(probabilities)
    return [p / total for p in probabilities]


def _open_stream(source: Source):
    from datasets import load_dataset  # imported here: `datasets` is slow to import and --help must stay fast

    library_logger = logging.getLogger("datasets")
    for handler in list(library_logger.handlers):  # datasets adds a handler of its own: its lines would show twice
        library_logger.removeHandler(handler)
    # the json builder logs a parse failure before raising it; _records reports it with the file and line
    logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)

    kwargs = {"streaming": True, "split": "train"}
    if source.builder == "text":
        kwargs["sample_by"] = "paragraph"  # documents are separated by blank lines
    if source.data_files:
        kwargs["data_files"] = list(source.data_files)
    try:
        return load_dataset(source.builder, source.config, **kwargs)
    except FileNotFoundError as e:
        raise UserError(f"cannot open source '{source.label}': {str(e).splitlines()[0]}") from e
    except Exception as e:  # datasets raises many types for a wrong name, a gated repo or no network
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot open source '{source.label}' ({source.builder}): {first_line}") from e


def _records(source: Source, stream) -> Iterator[dict]:
    """The records of a stream; a file that cannot be parsed is a UserError naming the file and its first bad line."""
    records = iter(stream)
    while True:
        try:
            record = next(records)
        except StopIteration:
            return
        except UserError:
            raise
        except Exception as e:  # pyarrow, json and the compressors raise many types for a malformed file
            raise UserError(_read_error(source, e)) from e
        yield record


def _read_error(source: Source, error: Exception) -> str:
    """What is wrong with a source that failed to parse: for JSON lines, the file and line of the first bad one."""
    if source.builder == "json" and source.data_files:
        for path in source.data_files:
            if path.endswith(COMPRESSED) or not os.path.isfile(path):
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                if not path.endswith(".jsonl"):
                    try:
                        json.load(f)
                        continue
                    except ValueError as e:
                        return f"data file '{path}' is not valid JSON: {e}"
                for number, line in enumerate(f, 1):
                    try:
                        if line.strip():
                            json.loads(line)
                    except ValueError as e:
                        return f"data file '{path}' line {number} is not valid JSON ({e}): fix or remove that line"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"cannot read source '{source.label}': {first_line}"


def _texts(source: Source, stream, skips: SkipCounter, check_script: bool = True) -> Iterator[str]:
    columns = (source.text_column,) if source.text_column else TEXT_COLUMNS
    first: list[str] = []  # the first documents, to tell whether the text is Bengali
    for record in _records(source, stream):
        text = next((record[c] for c in columns if c in record), None)
        if not isinstance(text, str):
            skips.skip(f"{source.label}: record without a text field {list(columns)}")
        elif not text.strip():
            skips.skip(f"{source.label}: empty document")
        else:
            if check_script and len(first) < SCRIPT_SAMPLE_DOCUMENTS:
                first.append(text)
                if len(first) == SCRIPT_SAMPLE_DOCUMENTS:
                    warn_if_not_bengali(source.label, first)
            yield text
    if 0 < len(first) < SCRIPT_SAMPLE_DOCUMENTS:
        warn_if_not_bengali(source.label, first)


def stream_documents(
    sources: Sequence[Source],
    probabilities: Sequence[float],
    seed: int,
    shuffle_buffer: int = 10_000,
    skips: SkipCounter | None = None,
    repeat: bool = True,
    with_source: bool = False,
) -> Iterator[str] | Iterator[tuple[int, str]]:
    """Endless stream of documents: each source buffer-shuffled with this peer's seed, sources mixed by probability.

    `with_source`: yield (index of the source, text), so that a caller can tell which source a document came from.

    Mixing is done here rather than with `interleave_datasets` so that a bad record is skipped (and counted) per
    source instead of ending the stream, and so that each source restarts with a new shuffle when it runs out.
    """
    import numpy as np

    skips = skips if skips is not None else SkipCounter()
    rng = np.random.default_rng(seed)
    streams = [_open_stream(source) for source in sources]

    def epochs(index: int) -> Iterator[str]:
        for epoch in itertools.count() if repeat else range(1):
            shuffled = streams[index].shuffle(seed=seed + 1_000_003 * index, buffer_size=shuffle_buffer)
            shuffled.set_epoch(epoch)
            produced = False
            for text in _texts(sources[index], shuffled, skips, check_script=epoch == 0):
                produced = True
                yield (index, text) if with_source else text
            if not produced:
                raise UserError(f"source '{sources[index].label}' holds no usable documents")

    iterators = [epochs(i) for i in range(len(sources))]
    alive = [i for i in range(len(sources)) if probabilities[i] > 0]
    weights = np.asarray(probabilities, dtype=np.float64)
    while alive:
        p = weights[alive] / weights[alive].sum()
        choice = alive[int(rng.choice(len(alive), p=p))]
        try:
            yield next(iterators[choice])
        except StopIteration:
            alive.remove(choice)
