#!/usr/bin/env python
"""Show what the model trains on: decoded A/B segments, the sentence-order label and the masked positions."""

import itertools
import json

from sahajbert.cli import Flags, parse_args, run, setup_logging
from sahajbert.collators import IGNORE_INDEX, PretrainingCollator
from sahajbert.flags import CorpusArguments, PreviewArguments
from sahajbert.stream import iterate_examples
from sahajbert.tokenization import load_tokenizer

FLAGS = Flags(
    (CorpusArguments, PreviewArguments),
    description="Show what the model trains on: A/B segments, the sentence-order label and the masked positions.",
    skip=frozenset({"pad_to_multiple_of"}),
)


def main(argv=None) -> int:
    setup_logging()
    corpus_args, args = parse_args(FLAGS, argv)
    tokenizer = load_tokenizer(corpus_args.tokenizer_path)
    collator = PretrainingCollator.from_tokenizer(
        tokenizer,
        mlm_probability=corpus_args.mlm_probability,
        whole_word_masking=corpus_args.masking == "whole_word",
        seed=args.seed,
    )
    examples = iterate_examples(corpus_args, tokenizer, seed=args.seed, with_text=True)
    for index, example in enumerate(itertools.islice(examples, args.num_examples)):
        batch = collator([example])
        masked = (batch["labels"][0] != IGNORE_INDEX).nonzero().flatten().tolist()
        if args.json:
            record = {key: value.tolist() if hasattr(value, "tolist") else value for key, value in example.items()}
            record["masked_positions"] = masked
            record["masked_input_ids"] = batch["input_ids"][0].tolist()
            print(json.dumps(record, ensure_ascii=False), flush=True)
            continue
        tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())
        order = "swapped (B came first in the text)" if example["sentence_order_label"] else "original order"
        print(
            f"--- example {index}: {len(example['input_ids'])} tokens, sentence order label "
            f"{example['sentence_order_label']} = {order}"
        )
        print(f"A: {example['text_a']}")
        print(f"B: {example['text_b']}")
        print(
            f"masked ({len(masked)}): "
            + " ".join(
                f"{p}:{tokenizer.convert_ids_to_tokens(int(example['input_ids'][p]))}->{tokens[p]}" for p in masked
            )
        )
    return 0


if __name__ == "__main__":
    run(main)
