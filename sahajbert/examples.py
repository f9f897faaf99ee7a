"""ALBERT pretraining examples from documents: Bengali sentence splitting and sentence-order-prediction pairs."""

import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

# Where a sentence ends. "lines": a danda (। U+0964, ॥ U+0965), "?", "!" or a line break. "punctuation": "।", "?" or
# "!" only, as both references split (a danda rewrite, then NLTK punkt): line breaks and ॥ do not end one there.
SENTENCE_ENDS = {"lines": re.compile(r"[\u0964\u0965?!]+|\n+"), "punctuation": re.compile(r"[\u0964?!]+")}
SENTENCE_END = SENTENCE_ENDS["lines"]


def split_sentences(text: str, sentence_end: re.Pattern = SENTENCE_END) -> list[tuple[int, int]]:
    """Character spans (start, end) of the non-blank sentences in `text`, in order."""
    spans, start = [], 0
    for match in sentence_end.finditer(text):
        spans.append((start, match.end()))
        start = match.end()
    spans.append((start, len(text)))
    return [(s, e) for s, e in spans if text[s:e].strip()]


@dataclass
class PairBuilder:
    """Makes [CLS] A [SEP] B [SEP] examples with a sentence-order label from one tokenization per document.

    Label 0: A and B in their original order; label 1: swapped (as `AlbertForPreTraining` expects).
    """

    tokenizer: Tokenizer  # the backend `tokenizers.Tokenizer` (fast, releases the GIL)
    cls_id: int
    sep_id: int
    max_seq_length: int = 512
    short_seq_prob: float = 0.1  # ALBERT: 10% of examples use a shorter random target length
    swap_prob: float = 0.5
    sentence_end: re.Pattern = SENTENCE_END
    # "references": sentences are added until they hold max_seq_length tokens, then the pair is truncated to fit (no
    # shorter examples), as both references' data code did (DeDLOC sahajbert/dataset_streaming.py:38)
    chunking: str = "albert"

    def __call__(self, text: str, rng: np.random.Generator, with_text: bool = False) -> Iterator[dict] | None:
        """Yield the examples of one document; None if it has fewer than two sentences (the caller counts it)."""
        spans = split_sentences(text, self.sentence_end)
        if len(spans) < 2:
            return None
        # encode_batch releases the GIL (encode does not): a long document must not stall the training loop's thread
        (encoding,) = self.tokenizer.encode_batch([text], add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        # token i belongs to the sentence whose span contains its first character
        sentence_of_token = np.searchsorted(np.asarray([e for _, e in spans]), offsets[:, 0], side="right")
        cuts = np.flatnonzero(np.diff(sentence_of_token)) + 1
        bounds = np.concatenate([[0], cuts, [len(ids)]])
        sentences = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        if len(sentences) < 2:
            return None
        return self._pairs(text, ids, offsets, sentences, rng, with_text)

    def _pairs(self, text, ids, offsets, sentences, rng, with_text) -> Iterator[dict]:
        budget = self.max_seq_length - 3  # room for [CLS] and two [SEP]
        target = self._target_length(budget, rng)
        chunk: list[tuple[int, int]] = []
        length = 0
        for i, sentence in enumerate(sentences):
            chunk.append(sentence)
            length += sentence[1] - sentence[0]
            # emit at the target length, but never with fewer than two sentences: A/B always split at a boundary
            if (length < target or len(chunk) < 2) and i != len(sentences) - 1:
                continue
            example = self._make_pair(text, ids, offsets, chunk, budget, rng, with_text)
            if example is not None:
                yield example
            chunk, length = [], 0
            target = self._target_length(budget, rng)

    def _target_length(self, budget: int, rng: np.random.Generator) -> int:
        if self.chunking == "references":
            return self.max_seq_length
        return budget if rng.random() >= self.short_seq_prob else int(rng.integers(2, budget + 1))

    def _make_pair(self, text, ids, offsets, chunk, budget, rng, with_text) -> dict | None:
        if len(chunk) < 2:
            return None  # a lone trailing sentence has no partner (dropped, as in ALBERT)
        start, end = chunk[0][0], chunk[-1][1]
        split = chunk[int(rng.integers(1, len(chunk)))][0]  # A = the first k sentences, B = the rest
        a, b = [start, split], [split, end]
        # truncate the longer segment, from its far end, until the pair fits (ALBERT/BERT truncation)
        while (a[1] - a[0]) + (b[1] - b[0]) > budget:
            if a[1] - a[0] >= b[1] - b[0]:
                a[0] += 1
            else:
                b[1] -= 1
        # a segment truncated down to a lone "▁" or punctuation teaches nothing about sentence order
        if not any(text[offsets[i, 0] : offsets[i, 1]].strip(" \n\t\u2581") for i in range(a[0], a[1])) or not any(
            text[offsets[i, 0] : offsets[i, 1]].strip(" \n\t\u2581") for i in range(b[0], b[1])
        ):
            return None
        swapped = rng.random() < self.swap_prob
        first, second = (b, a) if swapped else (a, b)
        len_first, len_second = first[1] - first[0], second[1] - second[0]
        input_ids = np.empty(len_first + len_second + 3, dtype=np.int64)
        input_ids[0] = self.cls_id
        input_ids[1 : 1 + len_first] = ids[first[0] : first[1]]
        input_ids[1 + len_first] = self.sep_id
        input_ids[2 + len_first : -1] = ids[second[0] : second[1]]
        input_ids[-1] = self.sep_id
        token_type_ids = np.zeros_like(input_ids)
        token_type_ids[2 + len_first :] = 1
        special_tokens_mask = np.zeros_like(input_ids)
        special_tokens_mask[[0, 1 + len_first, -1]] = 1
        example = {
            "input_ids": input_ids,
            "token_type_ids": token_type_ids,
            "special_tokens_mask": special_tokens_mask,
            "sentence_order_label": int(swapped),
        }
        if with_text:
            example["text_a"] = text[offsets[first[0], 0] : offsets[first[1] - 1, 1]].strip()
            example["text_b"] = text[offsets[second[0], 0] : offsets[second[1] - 1, 1]].strip()
        return example
