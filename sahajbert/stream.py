"""The endless, per-peer stream of ALBERT training batches, prepared in a background thread."""

import hashlib
import logging
import queue
import threading
from collections.abc import Iterable, Iterator

import numpy as np

from sahajbert.cli import UserError
from sahajbert.collators import PretrainingCollator
from sahajbert.corpus import SkipCounter, resolve_probabilities, resolve_sources, stream_documents
from sahajbert.examples import SENTENCE_ENDS, PairBuilder
from sahajbert.flags import CorpusArguments
from sahajbert.signals import StopRequest

logger = logging.getLogger(__name__)
# what examples.SENTENCE_ENDS split on, in words
BOUNDARIES = {"lines": "\u0964, \u0965, ?, ! or a line break", "punctuation": "\u0964, ? or !"}
# a source whose first documents give no example at all is unusable: say so instead of reading it for ever
MAX_FRUITLESS_DOCUMENTS = 1_000


def iterate_examples(
    corpus_args: CorpusArguments, tokenizer, seed: int, with_text: bool = False, skips: SkipCounter | None = None
):
    """Yield SOP examples from the sources in `corpus_args`, shuffled and mixed with `seed`."""
    skips = skips if skips is not None else SkipCounter()
    sources = resolve_sources(corpus_args.sources, corpus_args.data_files)
    probabilities = resolve_probabilities(sources, corpus_args.source_probabilities)
    builder = PairBuilder(
        tokenizer.backend_tokenizer,
        cls_id=tokenizer.cls_token_id,
        sep_id=tokenizer.sep_token_id,
        max_seq_length=corpus_args.max_seq_length,
        short_seq_prob=corpus_args.short_seq_prob,
        sentence_end=SENTENCE_ENDS[corpus_args.sentence_boundaries],
        chunking=corpus_args.chunking,
    )
    rng = np.random.default_rng(seed)
    documents = stream_documents(sources, probabilities, seed, corpus_args.shuffle_buffer, skips, with_source=True)
    # per source: documents read while it has given no example yet (None once it has given one)
    fruitless: list[int | None] = [0] * len(sources)
    boundaries = BOUNDARIES[corpus_args.sentence_boundaries]
    for index, text in documents:
        examples = builder(text, rng, with_text=with_text)
        if examples is None:
            label = sources[index].label
            skips.skip(f"{label}: document with fewer than two sentences (no {boundaries} between them)")
            if fruitless[index] is not None:
                fruitless[index] += 1
                if fruitless[index] >= MAX_FRUITLESS_DOCUMENTS:
                    raise UserError(
                        f"source '{sources[index].label}' gave no training example in {MAX_FRUITLESS_DOCUMENTS} "
                        f"documents: each has fewer than two sentences (a sentence ends at {boundaries}; '.' does "
                        "not end one). Give Bengali text, with documents of two or more sentences"
                    )
            continue
        fruitless[index] = None
        yield from examples


def batched(examples: Iterable[dict], batch_size: int, collator: PretrainingCollator) -> Iterator[dict]:
    """Group examples into collated batches of exactly `batch_size` (the stream is endless, so none is short)."""
    bucket: list[dict] = []
    for example in examples:
        bucket.append(example)
        if len(bucket) == batch_size:
            yield collator(bucket)
            bucket = []


class Prefetcher:
    """Runs an iterator in a daemon thread, `depth` items ahead, so the accelerator never waits for data.

    The queue is bounded, so memory stays flat however long the stream; an exception in the producer is re-raised
    in the consumer; `close()` stops the producer.
    """

    _DONE = object()

    def __init__(self, iterator: Iterator, depth: int = 4):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(iterator,), daemon=True, name="prefetch")
        self._thread.start()

    def _produce(self, iterator: Iterator) -> None:
        try:
            for item in iterator:
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(self._DONE)
        except BaseException as e:  # handed to the consumer, which raises it where it can be reported
            self._queue.put(e)

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self):
        return self.get()

    def get(self, stop: StopRequest | None = None):
        """The next item; with `stop`, a stop request ends the wait with StopNow (a source may be slow or stuck)."""
        while True:
            try:
                item = self._queue.get(timeout=0.5)
                break
            except queue.Empty:
                if stop is not None:
                    stop.check()
        if item is self._DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)  # a daemon thread: one busy inside a long document is left behind


def peer_seed(run_seed: int, public_key: bytes) -> int:
    """Each peer's data order: the run seed mixed with this peer's public key, so no two peers share a stream."""
    return (run_seed * 1_000_003 + int.from_bytes(hashlib.sha256(public_key).digest()[:4], "little")) % 2**31


def training_batches(
    corpus_args: CorpusArguments, tokenizer, seed: int, forward_batch: int, on_xla: bool
) -> Prefetcher:
    """A trainer's endless stream of collated batches, in its own order (`seed`: see `peer_seed`)."""
    collator = PretrainingCollator.from_tokenizer(
        tokenizer,
        mlm_probability=corpus_args.mlm_probability,
        whole_word_masking=corpus_args.masking == "whole_word",
        # XLA compiles per shape: every batch is padded to the full length, so the step compiles once
        pad_to_multiple_of=corpus_args.max_seq_length if on_xla else corpus_args.pad_to_multiple_of,
        seed=seed,
    )
    return Prefetcher(batched(iterate_examples(corpus_args, tokenizer, seed=seed), forward_batch, collator))
