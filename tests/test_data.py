"""The example stream: sentences, SOP pairs, masking, per-peer shuffling, source mixing, and bad input."""

import itertools
import json
import threading
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from sahajbert.cli import UserError
from sahajbert.collators import IGNORE_INDEX, PretrainingCollator
from sahajbert.corpus import SkipCounter, resolve_probabilities, resolve_sources, stream_documents
from sahajbert.examples import SENTENCE_ENDS, PairBuilder, split_sentences
from sahajbert.flags import CorpusArguments
from sahajbert.stream import Prefetcher, batched, iterate_examples
from sahajbert.tokenization import word_start_table

from .swarm_helpers import assert_one_error, run_main, run_script


def corpus_args(files, **overrides) -> CorpusArguments:
    defaults = dict(sources=[], data_files=files, shuffle_buffer=1000, max_seq_length=128, short_seq_prob=0.1)
    return CorpusArguments(**{**defaults, **overrides})


def test_split_sentences_on_danda_question_exclamation_and_newline():
    text = "আমি ভাত খাই। তুমি কী খাও? চমৎকার! নতুন লাইন\nশেষ বাক্য॥ শেষ"
    parts = [text[s:e].strip() for s, e in split_sentences(text)]
    assert parts == ["আমি ভাত খাই।", "তুমি কী খাও?", "চমৎকার!", "নতুন লাইন", "শেষ বাক্য॥", "শেষ"]


def test_split_sentences_ignores_blank_spans():
    assert split_sentences("।।  \n\n ") == [(0, 2)]
    assert len(split_sentences("এক। \n\n দুই।")) == 2


def make_builder(tokenizer, max_seq_length=128):
    return PairBuilder(tokenizer.backend_tokenizer, tokenizer.cls_token_id, tokenizer.sep_token_id, max_seq_length)


def test_sop_pairs_are_contiguous_and_labelled(tokenizer, sample_texts):
    builder, labels = make_builder(tokenizer), []
    for text, seed in itertools.product(sample_texts, range(5)):
        rng = np.random.default_rng(seed)
        normalized = tokenizer.backend_tokenizer.normalizer.normalize_str(text)
        for ex in builder(text, rng, with_text=True):
            ids = ex["input_ids"]
            seps = np.flatnonzero(ids == tokenizer.sep_token_id)
            assert ids[0] == tokenizer.cls_token_id and list(seps) == [seps[0], len(ids) - 1]
            assert len(ids) <= 128
            assert list(ex["token_type_ids"]) == [0] * (seps[0] + 1) + [1] * (len(ids) - seps[0] - 1)
            assert list(np.flatnonzero(ex["special_tokens_mask"])) == [0, seps[0], len(ids) - 1]
            first, second = ids[1 : seps[0]].tolist(), ids[seps[0] + 1 : -1].tolist()
            original = second + first if ex["sentence_order_label"] else first + second
            # A then B (in text order) is one contiguous stretch of the document's tokens
            decoded = tokenizer.decode(original).replace(" ", "")
            assert decoded in normalized.replace(" ", "")
            # segments end or start at sentence boundaries: the earlier segment ends with a sentence end
            earlier = ex["text_b"] if ex["sentence_order_label"] else ex["text_a"]
            assert earlier.rstrip()[-1] in "।॥?!" or "\n" in text
            labels.append(ex["sentence_order_label"])
    assert len(labels) > 600
    assert 0.45 < np.mean(labels) < 0.55, f"SOP labels should be ~50/50, got {np.mean(labels):.2f}"


def test_documents_without_a_boundary_are_skipped(tokenizer):
    builder, rng = make_builder(tokenizer), np.random.default_rng(0)
    assert builder("একটি বাক্য যার কোনো শেষ চিহ্ন নেই", rng) is None
    assert builder("", rng) is None
    assert list(builder("এক বাক্য। দুই বাক্য।", rng))


def collator_for(tokenizer, **kwargs):
    return PretrainingCollator.from_tokenizer(tokenizer, seed=0, **kwargs)


def test_whole_word_masking_masks_whole_words(tokenizer, sample_texts):
    collator = collator_for(tokenizer)
    table = np.asarray(word_start_table(tokenizer))
    builder, rng = make_builder(tokenizer), np.random.default_rng(1)
    examples = [ex for text in sample_texts[:40] for ex in builder(text, rng)]
    batch = collator(examples)
    total_predicted = total_candidates = 0
    for row, ex in enumerate(examples):
        ids = np.asarray(ex["input_ids"])
        labels = batch["labels"][row, : len(ids)].numpy()
        chosen = labels != IGNORE_INDEX
        assert (labels[chosen] == ids[chosen]).all()
        assert not chosen[np.asarray(ex["special_tokens_mask"], dtype=bool)].any()
        # every word (start piece + continuation pieces) is masked entirely or not at all
        word_ids = np.cumsum(table[ids] | np.concatenate([[True], ex["special_tokens_mask"][:-1].astype(bool)]))
        for word in np.unique(word_ids[chosen]):
            assert chosen[word_ids == word].all(), "a word was masked only partly"
        total_predicted += chosen.sum()
        total_candidates += (~np.asarray(ex["special_tokens_mask"], dtype=bool)).sum()
    assert 0.10 < total_predicted / total_candidates < 0.17
    assert batch["input_ids"].shape[1] % 8 == 0 or collator.pad_to_multiple_of is None


def test_token_masking_80_10_10(tokenizer, sample_texts):
    collator = collator_for(tokenizer, whole_word_masking=False)
    builder, rng = make_builder(tokenizer), np.random.default_rng(2)
    examples = [ex for text in sample_texts for ex in builder(text, rng)]
    batch = collator(examples)
    chosen = batch["labels"] != IGNORE_INDEX
    inputs = batch["input_ids"][chosen]
    originals = batch["labels"][chosen]
    masked = (inputs == tokenizer.mask_token_id).float().mean().item()
    kept = (inputs == originals).float().mean().item()
    assert 0.76 < masked < 0.84 and 0.07 < kept < 0.13
    candidates = (batch["attention_mask"].bool() & (batch["input_ids"] != tokenizer.cls_token_id)).sum().item()
    assert 0.12 < chosen.sum().item() / candidates < 0.18


def test_padding_to_multiple_and_attention(tokenizer):
    builder, rng = make_builder(tokenizer), np.random.default_rng(3)
    examples = list(builder("প্রথম বাক্য। দ্বিতীয় বাক্য। তৃতীয় বাক্য।", rng))
    batch = PretrainingCollator.from_tokenizer(tokenizer, pad_to_multiple_of=16, seed=0)(examples)
    n = len(examples[0]["input_ids"])
    assert batch["input_ids"].shape[1] == -(-n // 16) * 16 and batch["attention_mask"][0].sum().item() == n
    assert (batch["input_ids"][0, n:] == tokenizer.pad_token_id).all()
    assert (batch["labels"][0, n:] == IGNORE_INDEX).all()


def test_two_peer_seeds_give_different_streams_and_one_seed_repeats(tokenizer, sample_files):
    def first_texts(seed):
        return [
            ex["text_a"]
            for ex in itertools.islice(
                iterate_examples(corpus_args(sample_files), tokenizer, seed=seed, with_text=True), 30
            )
        ]

    assert first_texts(0) == first_texts(0)
    a, b = first_texts(0), first_texts(1)
    assert len(set(a) & set(b)) < 10, "two peers must not train on the same stream"


def test_mixing_probabilities_respected(sample_files):
    sources = resolve_sources([], sample_files)
    probabilities = resolve_probabilities(sources, [0.23, 0.77])
    wiki = set(t for t in open(sample_files[0], encoding="utf-8").read().split("\n\n") if t.strip())
    docs = list(itertools.islice(stream_documents(sources, probabilities, seed=5, shuffle_buffer=100), 4000))
    share = sum(d in wiki for d in docs) / len(docs)
    assert abs(share - 0.23) < 0.03, f"wikipedia share {share:.3f} should be ~0.23"


def test_default_probabilities():
    two = [SimpleNamespace()] * 2
    assert resolve_probabilities(two, None) == [0.23, 0.77]
    assert resolve_probabilities([SimpleNamespace()] * 3, None) == pytest.approx([1 / 3] * 3)
    with pytest.raises(UserError, match="2 sources"):
        resolve_probabilities(two, [1.0])


def test_local_jsonl_and_parquet_sources_use_the_same_path(tmp_path, tokenizer, sample_texts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in sample_texts[:20]))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"content": sample_texts[20:40]}), parquet)
    examples = list(itertools.islice(iterate_examples(corpus_args([str(jsonl), str(parquet)]), tokenizer, 0), 50))
    assert len(examples) == 50


def test_gzip_and_zstd_files_give_the_examples_of_the_plain_files(tmp_path, tokenizer, sample_texts):
    import gzip

    import zstandard

    text = "\n\n".join(sample_texts[:30])
    jsonl = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in sample_texts[30:60])
    (tmp_path / "docs.txt").write_text(text, encoding="utf-8")
    (tmp_path / "docs.txt.gz").write_bytes(gzip.compress(text.encode("utf-8")))
    (tmp_path / "docs.jsonl").write_text(jsonl, encoding="utf-8")
    (tmp_path / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl.encode("utf-8")))

    def examples(name: str) -> list:
        found = list(itertools.islice(iterate_examples(corpus_args([str(tmp_path / name)]), tokenizer, 0), 20))
        assert len(found) == 20, name
        return [{key: np.asarray(value).tolist() for key, value in example.items()} for example in found]

    assert examples("docs.txt.gz") == examples("docs.txt")
    assert examples("docs.jsonl.zst") == examples("docs.jsonl")


def test_bad_records_are_skipped_and_counted(tmp_path, tokenizer):
    jsonl = tmp_path / "mixed.jsonl"
    records = [
        {"text": "ভালো বাক্য। আরেকটি বাক্য।"},
        {"text": ""},
        {"text": None},
        {"title": "no text"},
        {"text": "কোনো সীমানা নেই"},
        {"text": "শেষ ভালো বাক্য। সত্যিই শেষ।"},
    ]
    jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    skips = SkipCounter()
    examples = list(itertools.islice(iterate_examples(corpus_args([str(jsonl)]), tokenizer, 0, skips=skips), 10))
    assert len(examples) == 10
    reasons = Counter({k.split(": ")[-1][:20]: v for k, v in skips.counts.items()})
    assert any("empty document" in k for k in skips.counts)
    assert any("without a text field" in k for k in skips.counts)
    assert any("fewer than two sentences" in k for k in skips.counts)
    assert sum(reasons.values()) >= 4


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.txt", None, "data file not found"),
        ("empty.txt", b"", "data file is empty"),
        ("latin1.txt", "café".encode("latin-1") * 10, "not UTF-8"),
        ("data.csv", b"a,b", "unsupported file type"),
        ("*.nothing", None, "no data files match"),
    ],
)
def test_bad_files_are_clear_errors(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError, match=message):
        resolve_sources([], [str(tmp_path / name)])


def test_unknown_source_is_a_clear_error():
    with pytest.raises(UserError, match="unknown source 'wikipedya'"):
        resolve_sources(["wikipedya"], None)


def test_prefetcher_is_bounded_and_propagates_errors():
    depth, count = 3, 100
    # asked[i]: how many items the consumer had asked for when the producer asked the source for item i
    asked, taken, changed = [], [0], threading.Condition()

    def numbers():
        for i in range(count):
            with changed:
                asked.append(taken[0])
                changed.notify_all()
            yield i

    prefetcher = Prefetcher(numbers(), depth=depth)
    for expected in range(count):
        with changed:
            # it runs ahead: before each item is taken, the producer has asked for all the queue holds and one more
            ahead = min(count, taken[0] + depth + 1)
            assert changed.wait_for(lambda: len(asked) >= ahead, timeout=30), (len(asked), taken[0])  # noqa: B023
            taken[0] += 1
        assert next(prefetcher) == expected
    # and no further: item i is asked for only once item i - depth - 1 was taken (it waits for room in the queue)
    assert all(i - asked_then <= depth for i, asked_then in enumerate(asked)), asked
    with pytest.raises(StopIteration):
        next(prefetcher)

    def broken():
        yield 1
        raise UserError("boom")

    failing = Prefetcher(broken())
    assert next(failing) == 1
    with pytest.raises(UserError, match="boom"):
        next(failing)


def test_batches_are_full(tokenizer, sample_files):
    collator = PretrainingCollator.from_tokenizer(tokenizer, seed=0)
    batches = list(
        itertools.islice(batched(iterate_examples(corpus_args(sample_files), tokenizer, 0), 4, collator), 3)
    )
    assert all(b["input_ids"].shape[0] == 4 for b in batches)
    assert set(batches[0]) == {"input_ids", "token_type_ids", "attention_mask", "labels", "sentence_order_label"}


def test_preview_json_offline(sample_files, capsys):
    args = ["--tokenizer_path", "sample", "--data_files", *sample_files, "--num_examples", "3", "--json"]
    code, out, _ = run_script("data/preview.py", [*args, "--max_seq_length", "64", "--seed", "7"], capsys)
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 3
    for record in records:
        assert {"input_ids", "token_type_ids", "sentence_order_label", "text_a", "text_b"} <= set(record)
        assert len(record["input_ids"]) <= 64 and record["text_a"] and record["text_b"]


def test_preview_bad_tokenizer_is_one_line(tmp_path, sample_files, capsys):
    code, stderr = run_main(
        "data/preview.py", ["--data_files", *sample_files, "--tokenizer_path", str(tmp_path)], capsys
    )
    assert_one_error(code, stderr, "no tokenizer in")


def test_the_references_sentence_boundaries_are_danda_question_and_exclamation_only():
    text = "আমি ভাত খাই। তুমি কী খাও? নতুন লাইন\nএকই বাক্য॥ এখনও একই"
    spans = split_sentences(text, SENTENCE_ENDS["punctuation"])
    assert [text[s:e].strip() for s, e in spans] == ["আমি ভাত খাই।", "তুমি কী খাও?", "নতুন লাইন\nএকই বাক্য॥ এখনও একই"]


def test_the_references_chunking_fills_every_example_to_the_maximum_length(tokenizer, sample_files):
    """chunking=references: sentences until max_seq_length tokens, then truncated; albert: some shorter examples."""
    lengths = {}
    for chunking in ("albert", "references"):
        args = corpus_args(sample_files, max_seq_length=64, chunking=chunking, short_seq_prob=0.5)
        examples = itertools.islice(iterate_examples(args, tokenizer, seed=3), 200)
        lengths[chunking] = [len(e["input_ids"]) for e in examples]
    # a pair is cut from whole sentences, so a document's last chunk may come out shorter in either mode
    full = {chunking: sum(n == 64 for n in found) for chunking, found in lengths.items()}
    assert full["references"] >= 0.6 * 200 and full["references"] > 1.3 * full["albert"], full
