"""Batch collation for ALBERT pretraining: padding plus whole-word or token masked-LM masking (80/10/10)."""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100  # labels at unmasked positions; torch's cross-entropy skips them


@dataclass(frozen=True)
class MaskingVocabulary:
    """What masking needs to know of the tokenizer's vocabulary."""

    word_starts: np.ndarray  # bool per token id: the piece starts a word (▁-prefixed)
    pad_token_id: int
    mask_token_id: int
    replacement_ids: np.ndarray  # what a random replacement draws from: every id but the special tokens

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "MaskingVocabulary":
        from sahajbert.tokenization import word_start_table

        return cls(
            word_starts=np.asarray(word_start_table(tokenizer), dtype=bool),
            pad_token_id=tokenizer.pad_token_id,
            mask_token_id=tokenizer.mask_token_id,
            replacement_ids=np.setdiff1d(np.arange(len(tokenizer)), np.asarray(tokenizer.all_special_ids)),
        )


class PretrainingCollator:
    """Pads SOP examples into a batch and masks `mlm_probability` of the tokens for masked-LM.

    Whole-word masking (default) picks words, a word being a ▁-prefixed piece plus the pieces that follow it, so
    a masked word is always masked entirely. Of the chosen tokens 80% become [MASK], 10% a random token, 10% stay.
    """

    def __init__(
        self,
        vocabulary: MaskingVocabulary,
        mlm_probability: float = 0.15,
        whole_word_masking: bool = True,
        pad_to_multiple_of: int | None = None,
        seed: int | None = None,
    ):
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
        self.word_starts = vocabulary.word_starts
        self.pad_token_id, self.mask_token_id = vocabulary.pad_token_id, vocabulary.mask_token_id
        self.replacement_ids = vocabulary.replacement_ids
        self.mlm_probability, self.whole_word_masking = mlm_probability, whole_word_masking
        self.pad_to_multiple_of = pad_to_multiple_of
        self.rng = np.random.default_rng(seed)

    @classmethod
    def from_tokenizer(cls, tokenizer, **kwargs) -> "PretrainingCollator":
        return cls(MaskingVocabulary.from_tokenizer(tokenizer), **kwargs)

    def choose_positions(self, input_ids: np.ndarray, special: np.ndarray) -> np.ndarray:
        """Boolean mask of the positions to predict in one unpadded sequence."""
        candidates = ~special
        num_candidates = int(candidates.sum())
        if num_candidates == 0:
            return np.zeros_like(candidates)
        if not self.whole_word_masking:
            chosen = candidates & (self.rng.random(len(input_ids)) < self.mlm_probability)
            if not chosen.any():  # every sequence teaches something
                chosen[self.rng.choice(np.flatnonzero(candidates))] = True
            return chosen
        # word id of every candidate token: a new word starts at a ▁ piece or right after a special token
        starts = (self.word_starts[input_ids] | np.concatenate([[True], special[:-1]])) & candidates
        word_ids = np.cumsum(starts) - 1
        sizes = np.bincount(word_ids[candidates])
        num_to_predict = max(1, round(num_candidates * self.mlm_probability))
        # take whole words in random order while they fit the budget (the first one always, so nothing is empty)
        order = self.rng.permutation(len(sizes))
        fits = np.cumsum(sizes[order]) <= num_to_predict
        fits[0] = True
        chosen_words = np.zeros(len(sizes), dtype=bool)
        chosen_words[order[fits]] = True
        return candidates & chosen_words[np.maximum(word_ids, 0)]

    def __call__(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        length = max(len(e["input_ids"]) for e in examples)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = len(examples)
        input_ids = np.full((batch, length), self.pad_token_id, dtype=np.int64)
        token_type_ids = np.zeros((batch, length), dtype=np.int64)
        attention_mask = np.zeros((batch, length), dtype=np.int64)
        labels = np.full((batch, length), IGNORE_INDEX, dtype=np.int64)
        for row, example in enumerate(examples):
            ids = np.asarray(example["input_ids"], dtype=np.int64)
            n = len(ids)
            chosen = self.choose_positions(ids, np.asarray(example["special_tokens_mask"], dtype=bool))
            labels[row, :n][chosen] = ids[chosen]
            roll = self.rng.random(n)
            masked_ids = ids.copy()
            masked_ids[chosen & (roll < 0.8)] = self.mask_token_id
            random_positions = chosen & (roll >= 0.8) & (roll < 0.9)
            masked_ids[random_positions] = self.rng.choice(self.replacement_ids, size=int(random_positions.sum()))
            input_ids[row, :n] = masked_ids
            token_type_ids[row, :n] = example["token_type_ids"]
            attention_mask[row, :n] = 1
        return {
            "input_ids": torch.from_numpy(input_ids),
            "token_type_ids": torch.from_numpy(token_type_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "labels": torch.from_numpy(labels),
            "sentence_order_label": torch.tensor([e["sentence_order_label"] for e in examples], dtype=torch.long),
        }
