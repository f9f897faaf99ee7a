#!/usr/bin/env python
"""ALBERT examples per second on one CPU core: our pipeline vs the predecessors' tokenize-twice baseline.

Both turn the same documents into the same kind of training-ready examples (SOP pair, [CLS] A [SEP] B [SEP],
token types, masked-LM labels from the same collator); they differ only in how often text is tokenized.
"""

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch

from sahajbert.collators import PretrainingCollator
from sahajbert.examples import PairBuilder, split_sentences
from sahajbert.samples import SAMPLE_FILES, SAMPLE_TOKENIZER
from sahajbert.tokenization import load_tokenizer


def ours(tokenizer, documents, max_seq_length, rng):
    builder = PairBuilder(tokenizer.backend_tokenizer, tokenizer.cls_token_id, tokenizer.sep_token_id, max_seq_length)
    for text in documents:
        yield from builder(text, rng) or ()


def baseline(tokenizer, documents, max_seq_length, rng):
    """Tokenize each sentence to learn its length, then tokenize the chosen A/B texts again as a pair."""
    for text in documents:
        sentences = [text[s:e].strip() for s, e in split_sentences(text)]
        lengths = [len(tokenizer(s, add_special_tokens=False)["input_ids"]) for s in sentences]
        chunk, total = [], 0
        for i, (sentence, length) in enumerate(zip(sentences, lengths)):
            chunk.append(sentence)
            total += length
            if (total < max_seq_length - 3 or len(chunk) < 2) and i != len(sentences) - 1:
                continue
            if len(chunk) >= 2:
                split = int(rng.integers(1, len(chunk)))
                a, b = " ".join(chunk[:split]), " ".join(chunk[split:])
                swapped = rng.random() < 0.5
                first, second = (b, a) if swapped else (a, b)
                enc = tokenizer(
                    first,
                    second,
                    truncation="longest_first",
                    max_length=max_seq_length,
                    return_special_tokens_mask=True,
                )
                yield {
                    "input_ids": enc["input_ids"],
                    "token_type_ids": enc["token_type_ids"],
                    "special_tokens_mask": enc["special_tokens_mask"],
                    "sentence_order_label": int(swapped),
                }
            chunk, total = [], 0


def measure(make_examples, tokenizer, documents, max_seq_length, batch_size, collate: bool):
    collator = PretrainingCollator.from_tokenizer(tokenizer, seed=0, pad_to_multiple_of=8)
    rng = np.random.default_rng(0)
    start, count, bucket = time.perf_counter(), 0, []
    for example in make_examples(tokenizer, documents, max_seq_length, rng):
        bucket.append(example)
        if len(bucket) == batch_size:
            if collate:
                collator(bucket)
            count += len(bucket)
            bucket = []
    return count, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--repeats", type=int, default=20, help="passes over the bundled sample corpus")
    parser.add_argument("--max_seq_length", type=int, default=512, help="tokens per example")
    parser.add_argument("--batch_size", type=int, default=8, help="examples per collated batch")
    parser.add_argument("--trials", type=int, default=5, help="interleaved trials; the best time of each is kept")
    args = parser.parse_args(argv)
    # one core: set before the first tokenization starts the `tokenizers` thread pool
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(SAMPLE_TOKENIZER)
    documents = [d for path in SAMPLE_FILES for d in Path(path).read_text(encoding="utf-8").split("\n\n") if d.strip()]
    documents = documents * args.repeats
    pipelines = [("ours (tokenize each document once)", ours), ("baseline (sentences, then pairs)", baseline)]
    print(
        f"\nALBERT examples/s, 1 CPU core, max_seq_length={args.max_seq_length}, {len(documents)} documents, "
        f"best of {args.trials} interleaved trials\n"
    )
    print("| pipeline | stage | examples | seconds | examples/s | vs baseline |\n|---|---|---:|---:|---:|---:|")
    for collate, stage in [(False, "SOP examples"), (True, "+ masking collator")]:
        best = {}
        for _ in range(args.trials):  # interleaved, best time kept: timing noise on a shared machine only adds
            for name, fn in pipelines:
                count, seconds = measure(fn, tokenizer, documents, args.max_seq_length, args.batch_size, collate)
                best[name] = min(best.get(name, (count, seconds)), (count, seconds), key=lambda r: r[1])
        baseline_rate = best[pipelines[1][0]][0] / best[pipelines[1][0]][1]
        for name, _ in pipelines:
            count, seconds = best[name]
            print(
                f"| {name} | {stage} | {count} | {seconds:.2f} | {count / seconds:.0f} | "
                f"{count / seconds / baseline_rate:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
