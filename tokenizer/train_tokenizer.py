#!/usr/bin/env python
"""Train the sahajBERT Unigram tokenizer from the streamed corpus (default) or local files (--data_files)."""

import itertools
import logging

from tqdm.auto import tqdm

from sahajbert.cli import Flags, parse_args, run, setup_logging
from sahajbert.corpus import SkipCounter, resolve_probabilities, resolve_sources, stream_documents
from sahajbert.flags import CorpusArguments, TokenizerTrainingArguments
from sahajbert.tokenization import save_tokenizer, train_tokenizer

logger = logging.getLogger("train_tokenizer")
FLAGS = Flags(
    (CorpusArguments, TokenizerTrainingArguments),
    description="Train the sahajBERT Unigram tokenizer from the streamed corpus (default) or local files.",
    # examples, masking and the tokenizer to load are for training the model, not the tokenizer
    skip=frozenset(
        {
            "max_seq_length",
            "short_seq_prob",
            "mlm_probability",
            "masking",
            "pad_to_multiple_of",
            "tokenizer_path",
            "sentence_boundaries",
            "chunking",
        }
    ),
)


def main(argv=None) -> int:
    setup_logging()
    corpus_args, args = parse_args(FLAGS, argv)
    sources = resolve_sources(corpus_args.sources, corpus_args.data_files)
    probabilities = resolve_probabilities(sources, corpus_args.source_probabilities)
    skips = SkipCounter()
    # one pass over local files; a Hub stream is bounded by --max_texts
    documents = stream_documents(sources, probabilities, args.seed, corpus_args.shuffle_buffer, skips, repeat=False)
    documents = tqdm(itertools.islice(documents, args.max_texts), total=args.max_texts, desc="reading", unit="doc")
    tokenizer = train_tokenizer(documents, args.vocab_size, length=args.max_texts)
    save_tokenizer(tokenizer, args.output_dir)
    logger.info(f"saved a {len(tokenizer)}-piece tokenizer to {args.output_dir}")
    logger.info(f"trained on {documents.n} documents; skipped records: {skips.counts or 'none'}")
    return 0


if __name__ == "__main__":
    run(main)
