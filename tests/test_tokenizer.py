"""The sahajBERT tokenizer: normalization, pre-tokenization, specials, template, and loading via AutoTokenizer."""

import pytest
from transformers import AutoTokenizer

from sahajbert.samples import SAMPLE_TOKENIZER
from sahajbert.tokenization import SPECIAL_TOKENS, build_normalizer, build_pre_tokenizer

from .swarm_helpers import assert_one_error, run_main


@pytest.mark.parametrize(
    "raw, normalized",
    [
        ("আমি ভাত খাই\u09e4", "আমি ভাত খাই\u0964"),  # Bengali-block danda -> danda
        ("শেষ\u09e5", "শেষ\u0965"),  # Bengali-block double danda -> double danda
        ("আমি ভাত খাই|", "আমি ভাত খাই\u0964"),  # ASCII pipe typed as a danda
        ("খাই\u09f7", "খাই\u0964"),  # U+09F7 typed as a danda
        ("দুঃখ দু:খ", "দুঃখ দুঃখ"),  # colon after a Bengali letter -> visarga
        ("সময় 10:30", "সময় 10:30"),  # ... but not after a digit
        ("Hello WORLD", "hello world"),  # Latin is lowercased
        ("আমি   তুমি", "আমি তুমি"),  # repeated spaces collapse
    ],
)
def test_normalization(raw, normalized):
    assert build_normalizer().normalize_str(raw) == normalized


def test_digits_split_one_by_one_bengali_and_latin():
    pieces = [p for p, _ in build_pre_tokenizer().pre_tokenize_str("২০২৬ সালে 42 জন")]
    assert pieces == ["▁", "২", "০", "২", "৬", "▁সালে", "▁", "4", "2", "▁জন"]


def test_punctuation_is_split_off():
    pieces = [p for p, _ in build_pre_tokenizer().pre_tokenize_str("খাই। কেন?")]
    assert pieces == ["▁খাই", "।", "▁কেন", "?"]


def test_auto_tokenizer_round_trip(trained_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(trained_tokenizer_dir)
    assert tok.is_fast
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (tok.pad_token, tok.unk_token, tok.cls_token, tok.sep_token, tok.mask_token) == tuple(SPECIAL_TOKENS)
    assert tok.unk_token_id == 1 and tok.model_max_length == 512
    text = "বাংলাদেশ দক্ষিণ এশিয়ার একটি রাষ্ট্র।"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text


def test_pair_template_and_token_types(tokenizer):
    enc = tokenizer("আমি ভাত খাই।", "তুমি কী খাও?", return_special_tokens_mask=True)
    ids, types = enc["input_ids"], enc["token_type_ids"]
    first_sep = ids.index(tokenizer.sep_token_id)
    assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
    assert types == [0] * (first_sep + 1) + [1] * (len(ids) - first_sep - 1)
    special_positions = [i for i, flag in enumerate(enc["special_tokens_mask"]) if flag]
    assert special_positions == [0, first_sep, len(ids) - 1]


def test_mask_inside_text(tokenizer):
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("আমি [MASK] খাই")["input_ids"])
    assert tokens.count("[MASK]") == 1
    index = tokens.index("[MASK]")
    assert tokens[index - 1] != "▁", "the space before [MASK] must be absorbed"
    assert tokens[index + 1].startswith("▁"), "the word after [MASK] starts a new word"


def test_unknown_characters_map_to_unk(tokenizer):
    assert tokenizer.unk_token_id in tokenizer("漢")["input_ids"]


def test_shipped_sample_tokenizer_loads_and_cli_rebuilds_it(tmp_path, sample_files, capsys):
    shipped = AutoTokenizer.from_pretrained(SAMPLE_TOKENIZER)
    assert shipped.mask_token_id == 4 and len(shipped) == 2000
    out = tmp_path / "rebuilt"
    args = ["--data_files", *sample_files, "--vocab_size", "2000", "--output_dir", str(out)]
    assert run_main("tokenizer/train_tokenizer.py", args, capsys)[0] == 0
    rebuilt = AutoTokenizer.from_pretrained(out)
    # Unigram's multithreaded EM may order tied pieces differently, so ids can move; the pieces may not
    assert set(rebuilt.get_vocab()) == set(shipped.get_vocab()), "the README command must rebuild the same pieces"
    assert [rebuilt.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]


def test_train_tokenizer_rejects_bad_input(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for args, message in [
        (["--data_files", str(tmp_path / "missing.txt")], "data file not found"),
        (["--data_files", str(empty)], "data file is empty"),
        (["--sources", "nonexistent_corpus"], "unknown source"),
    ]:
        code, stderr = run_main("tokenizer/train_tokenizer.py", [*args, "--output_dir", str(tmp_path / "o")], capsys)
        assert_one_error(code, stderr, message)
