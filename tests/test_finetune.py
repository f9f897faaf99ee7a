"""Downstream evaluation end to end, on a tiny checkpoint made by the pretraining code itself."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load_file
from transformers import DataCollatorWithPadding

from sahajbert.checkpoints import latest_checkpoint
from sahajbert.cli import parse_args
from sahajbert.finetuning import (
    NER_LABELS,
    TASKS,
    encode_ner,
    encode_news,
    load_model_tokenizer,
    markdown_table,
    ner_metrics,
    news_metrics,
    read_news_file,
    summarize,
)
from sahajbert.flags import PeerArguments
from sahajbert.localswarm import peer_env, tiny_trainer_flags
from sahajbert.model import load_model
from sahajbert.samples import SAMPLE_TOKENIZER
from sahajbert.signals import StopRequest
from sahajbert.tokenization import HUB_OFFLINE_VARIABLES
from sahajbert.trainer import TrainerPeer

from .swarm_helpers import ROOT, assert_one_error, run_main

SAMPLE = ROOT / "finetune" / "sample"
NER_FILES = [
    "--train_file",
    str(SAMPLE / "ner_train.conll"),
    "--validation_file",
    str(SAMPLE / "ner_validation.conll"),
    "--test_file",
    str(SAMPLE / "ner_test.jsonl"),
]
NEWS_FILES = [
    "--train_file",
    str(SAMPLE / "news_train.csv"),
    "--validation_file",
    str(SAMPLE / "news_validation.csv"),
    "--test_file",
    str(SAMPLE / "news_test.csv"),
]
QUICK = ["--learning_rate", "3e-3", "--per_device_train_batch_size", "16", "--disable_tqdm", "true"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """Two global steps of 64 samples of real pretraining (a trainer alone in its swarm, in this process) -> its
    final checkpoint."""
    output_dir = tmp_path_factory.mktemp("pretrain")
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    flags = tiny_trainer_flags(target_batch_size=64, max_steps=2, output_dir=output_dir)
    (peer_args,) = parse_args((PeerArguments,), flags)
    with TrainerPeer(peer_args) as peer:
        result = peer.run(StopRequest())
    assert result.final_step == 2 and result.checkpoint == latest_checkpoint(output_dir), result
    # the trainer left the swarm: hivemind's processes (DHT, averager, p2p daemon) ended with it. torch's
    # shared-memory manager, started for the tensors shared with them, serves this process until it exits
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in children]
    left = [p for p in started if p.name() != "torch_shm_manager"]
    assert not left, [p.cmdline() for p in left]
    return str(result.checkpoint)


def run_script(script, args):
    # offline and with one math thread, as the peers run: the tiny models gain nothing from a second thread, and on a
    # busy machine threads that wait for cores slow a run several times over
    return subprocess.run(
        [sys.executable, str(ROOT / "finetune" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=peer_env(),
    )


def validation_loss(model_dir: Path) -> float:
    """A saved news classifier's loss on the validation file, as the script evaluates it: its 60 texts in one batch
    (the evaluation batch is 64), at the default --max_seq_length."""
    tokenizer = load_model_tokenizer(str(model_dir))
    model = load_model(model_dir, "sequence_classification").eval()
    records = encode_news(read_news_file(str(SAMPLE / "news_validation.csv")), tokenizer, max_length=128)
    with torch.no_grad():
        return model(**DataCollatorWithPadding(tokenizer)(records)).loss.item()


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_ner_learns_and_writes_results(pretrained, tmp_path):
    result = run_script(
        "train_ner.py",
        [
            "--model_name_or_path",
            pretrained,
            *NER_FILES,
            *QUICK,
            "--num_train_epochs",
            "6",
            "--output_dir",
            str(tmp_path),
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # the final validation and test scores are not epochs: early stopping has nothing to say about them
    assert "early stopping is disabled" not in result.stderr, result.stderr[-3000:]
    # the new head is said in one line, not in transformers' load-report table
    assert "LOAD REPORT" not in result.stderr and "new tensors (classifier) start freshly" in result.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["test"]) >= {"precision", "recall", "f1"}
    assert results["test"]["f1"] > results["majority_baseline_test"]["f1"] + 0.3, results["test"]
    assert (tmp_path / "config.json").exists(), "the best model is saved"


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_news_classification_learns_and_writes_results(pretrained, tmp_path):
    # from a checkpoint of two pretraining steps (near its random start) fine-tuning first tells two groups of three
    # labels apart (loss near ln 3, accuracy 1/3: under the bar) and leaves that plateau after a number of epochs that
    # the seed (the new head's weights, the data order) decides more than the checkpoint does. A constant 1e-3 in
    # batches of 8, the best epoch by validation loss (it still falls on the plateau, where accuracy does not): over
    # 5 checkpoints x 10 seeds every run's validation accuracy was over the bar by epoch 8 and over 0.9 by epoch 11;
    # at seed 42, over 10 checkpoints, by epochs 3 and 4. Higher rates and larger batches stay on the plateau longer
    result = run_script(
        "train_ncc.py",
        [
            "--model_name_or_path",
            pretrained,
            *NEWS_FILES,
            "--learning_rate",
            "1e-3",
            "--lr_scheduler_type",
            "constant",
            "--per_device_train_batch_size",
            "8",
            "--best_model_metric",
            "loss",
            "--num_train_epochs",
            "12",
            "--early_stopping_patience",
            "6",
            "--seed",
            "42",
            "--disable_tqdm",
            "true",
            "--output_dir",
            str(tmp_path),
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["test"]) >= {"accuracy", "macro_f1"}
    assert results["test"]["accuracy"] > results["majority_baseline_test"]["accuracy"] + 0.2, results["test"]


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_early_stopping_keeps_the_best_epoch(pretrained, tmp_path):
    # patience 1 on the validation loss: training ends at the first epoch whose loss is no lower than the best one's,
    # so the last epoch is never the best. On 24 samples at 1e-2 the loss rises soon (after 2 to 5 epochs in 110 runs)
    epochs = 20
    flags = ["--max_train_samples", "24", "--per_device_train_batch_size", "8", "--learning_rate", "1e-2"]
    flags += ["--lr_scheduler_type", "constant", "--best_model_metric", "loss", "--early_stopping_patience", "1"]
    result = run_script(
        "train_ncc.py",
        [
            "--model_name_or_path",
            pretrained,
            *NEWS_FILES,
            *flags,
            "--disable_tqdm",
            "true",
            "--num_train_epochs",
            str(epochs),
            "--output_dir",
            str(tmp_path),
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    losses = {log["epoch"]: log["eval_loss"] for log in state["log_history"] if "eval_loss" in log}
    best, last = min(losses, key=losses.get), max(losses)
    assert results["epochs_trained"] == last < epochs and best < last, losses
    assert results["best_epoch_metric"] == losses[best]
    assert results["validation"]["loss"] == pytest.approx(losses[best], abs=1e-5)
    # the model saved in output_dir is the best epoch's checkpoint, and scores as it did, not as the last epoch did
    saved = load_file(tmp_path / "model.safetensors")
    best_weights = load_file(Path(state["best_model_checkpoint"]) / "model.safetensors")
    assert saved.keys() == best_weights.keys() and all(torch.equal(saved[k], best_weights[k]) for k in saved)
    loss = validation_loss(tmp_path)
    assert loss == pytest.approx(losses[best], abs=1e-5), losses
    assert abs(loss - losses[best]) < abs(loss - losses[last]), losses


@pytest.mark.slow
@pytest.mark.timeout(960)
def test_evaluate_prints_the_table(pretrained, tmp_path):
    files = " ".join(NER_FILES)
    news = " ".join(NEWS_FILES)
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "finetune" / "evaluate.py"),
            "--models",
            pretrained,
            "--seeds",
            "0",
            "1",
            "--output_dir",
            str(tmp_path),
            # sahajBERT-XL's protocol, with the quick settings given in --ner_args/--ncc_args winning over it
            "--protocol",
            "sahajbert-xl",
            "--ner_args",
            f"{files} --num_train_epochs 2 {' '.join(QUICK)}",
            "--ncc_args",
            f"{news} --num_train_epochs 2 {' '.join(QUICK)}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env=peer_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # the columns name the data the scores come from (the local test files here), the last row the majority class
    assert "| model | NER F1 (ner_test.jsonl) | News accuracy (news_test.csv) |" in result.stdout, result.stdout
    assert " ± " in result.stdout.split("| model |", 1)[1]
    baseline = next(line for line in result.stdout.splitlines() if line.startswith("| majority-class baseline |"))
    saved = json.loads((tmp_path / "results.json").read_text())
    news_baseline = saved["runs"][-1]["majority_baseline_test"]["accuracy"]
    assert baseline == f"| majority-class baseline | 0.00 | {100 * news_baseline:.2f} |", baseline
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["runs"]) == 4 and len(saved["table"][pretrained]["ner"]["scores"]) == 2
    assert "fine-tuned with the sahajbert-xl protocol" in result.stdout
    assert (tmp_path / "results.md").read_text().startswith("fine-tuning protocol: sahajbert-xl\n\n| model |")
    # the protocol's own choices stand where no flag replaced them: the best epoch by validation loss, dropout 0.1
    assert all(run["protocol"] == "sahajbert-xl" and run["best_model_metric"] == "loss" for run in saved["runs"])
    assert all(run["epochs_trained"] <= 2 for run in saved["runs"]), "--num_train_epochs 2 wins over the protocol's 20"
    config = json.loads((tmp_path / "model0" / "ner" / "seed0" / "config.json").read_text())
    assert config["hidden_dropout_prob"] == 0.1


def test_seqeval_on_a_hand_made_example():
    ids = {name: i for i, name in enumerate(NER_LABELS)}
    # gold: [PER: 0-1] [LOC: 3]      predicted: [PER: 0-1] [ORG: 3] [LOC: 5]
    gold = ["B-PER", "I-PER", "O", "B-LOC", "O", "O"]
    pred = ["B-PER", "I-PER", "O", "B-ORG", "O", "B-LOC"]
    labels = np.array([[ids[t] for t in gold] + [-100]])
    predictions = np.array([[ids[t] for t in pred] + [ids["B-PER"]]])  # the -100 position is ignored
    scores = ner_metrics(predictions, labels)
    assert scores["precision"] == pytest.approx(1 / 3) and scores["recall"] == pytest.approx(1 / 2)
    assert scores["f1"] == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))


def test_news_metrics_accuracy_and_macro_f1():
    scores = news_metrics(np.array([0, 0, 1, 3]), np.array([0, 1, 1, 3]))
    assert scores["accuracy"] == 0.75
    assert scores["macro_f1"] == pytest.approx(np.mean([2 / 3, 2 / 3, 1.0, 0, 0, 0]))


def test_only_the_first_sub_token_is_labelled(tokenizer):
    record = {"tokens": ["বঙ্গোপসাগরের", "তীরে", "ঢাকা"], "ner_tags": ["B-LOC", "O", "B-LOC"]}
    (encoded,) = encode_ner([record], tokenizer, 64)
    words = tokenizer(record["tokens"], is_split_into_words=True).word_ids()
    assert words.count(0) > 1, "the test needs a word split into several pieces"
    labelled = [label for label in encoded["labels"] if label != -100]
    assert labelled == [NER_LABELS.index(t) for t in record["ner_tags"]]
    first = words.index(0)
    assert encoded["labels"][first] == NER_LABELS.index("B-LOC") and encoded["labels"][first + 1] == -100


def test_summary_table():
    runs = [
        {"task": "ner", "model_name_or_path": "m", "test": {"f1": f}, "majority_baseline_test": {"f1": 0.0}}
        for f in (0.9, 0.8)
    ]
    runs = [{**run, "data": "WikiANN bn"} for run in runs]
    table = summarize(runs)
    assert table["m"]["ner"]["mean"] == pytest.approx(0.85) and table["m"]["ner"]["std"] == pytest.approx(0.05)
    lines = markdown_table(table, ["ner", "ncc"]).splitlines()
    assert lines[0] == "| model | NER F1 (WikiANN bn) | News accuracy |"
    assert lines[2:] == ["| m | 85.00 ± 5.00 | - |", "| majority-class baseline | 0.00 | - |"]


@pytest.mark.parametrize("task", ["ner", "ncc"])
def test_without_the_hub_the_error_names_the_bundled_sample_files(task, tmp_path, capsys, monkeypatch):
    """Offline, a run on the Hub's dataset ends at once with one line that gives the sample's flags: with the Hub
    switched off (as the tests run), and with the Hub unreachable (its address a closed local port here)."""
    from huggingface_hub import constants

    files = TASKS[task].sample_files
    args = ["--model_name_or_path", str(SAMPLE_TOKENIZER), "--output_dir", str(tmp_path / "o")]
    line = assert_one_error(
        *run_main(f"finetune/train_{task}.py", args, capsys), f"--train_file finetune/sample/{files[0]}"
    )
    assert f"--test_file finetune/sample/{files[2]}" in line and "offline, fine-tune on local files" in line
    for name in HUB_OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    line = assert_one_error(*run_main(f"finetune/train_{task}.py", args, capsys), "the Hub is unreachable")
    assert f"--train_file finetune/sample/{files[0]}" in line
    # the model by its Hub name, likewise: one line, before anything retries
    args = ["--model_name_or_path", "neuropark/sahajBERT", *NER_FILES, "--output_dir", str(tmp_path / "o")]
    assert_one_error(
        *run_main("finetune/train_ner.py", args, capsys), "no such folder here, and the Hub is unreachable"
    )


@pytest.mark.parametrize(
    "script, files, content, message",
    [
        ("train_ner.py", "conll", "ঢাকা B-MISC\n", "unknown label(s) ['B-MISC']"),
        ("train_ner.py", "jsonl", '{"tokens": ["ঢাকা", "শহর"], "ner_tags": ["B-LOC"]}\n', "2 tokens but 1 tags"),
        ("train_ner.py", "conll", "ঢাকা\n", "expected 'token TAG'"),
        ("train_ncc.py", "csv", "text,label\nখেলা হবে।,weather\n", "unknown label(s) ['weather']"),
    ],
)
def test_bad_data_is_one_clear_line(tmp_path, script, files, content, message, capsys):
    path = tmp_path / f"bad.{files}"
    path.write_text(content, encoding="utf-8")
    args = [
        "--model_name_or_path",
        str(SAMPLE_TOKENIZER),
        "--train_file",
        str(path),
        "--validation_file",
        str(path),
        "--test_file",
        str(path),
        "--output_dir",
        str(tmp_path / "o"),
    ]
    assert_one_error(*run_main(f"finetune/{script}", args, capsys), message)


@pytest.mark.parametrize(
    "ncc_args, message",
    [
        ("--seed 'oops", "--ncc_args is not a valid command line (no closing quotation)"),
        ("--no_such_flag 1", "--ncc_args: unknown flag --no_such_flag"),
        # a shortened or mistyped flag is refused, not taken as another one (argparse would match prefixes)
        ("--learning_rat 1e-4", "--ncc_args: unknown flag --learning_rat (did you mean --learning_rate?)"),
    ],
)
def test_evaluate_checks_every_runs_flags_before_training(tmp_path, ncc_args, message, capsys):
    """A mistake in the classification flags is found before the NER runs (listed first) train anything."""
    model = str(SAMPLE_TOKENIZER)  # never loaded: the flags fail first
    out = tmp_path / "evaluation"
    args = ["--models", model, "--output_dir", str(out), "--ner_args", " ".join(NER_FILES), "--ncc_args", ncc_args]
    assert_one_error(*run_main("finetune/evaluate.py", args, capsys), message)
    assert not out.exists(), "no run may start before every run's flags are checked"


def test_model_folder_without_tokenizer(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    args = ["--model_name_or_path", str(tmp_path / "model"), *NER_FILES, "--output_dir", str(tmp_path / "o")]
    assert_one_error(*run_main("finetune/train_ner.py", args, capsys), "has no tokenizer")


@pytest.mark.slow
def test_the_sahajbert_protocol_sets_the_runs_settings_under_the_flags_given(pretrained, tmp_path, capsys):
    # --protocol sahajbert (DeDLOC's fine-tuning): its values where no flag is given, the flags where one is
    args = ["--model_name_or_path", pretrained, *NEWS_FILES, "--protocol", "sahajbert", "--num_train_epochs", "1"]
    args += ["--per_device_train_batch_size", "16", "--disable_tqdm", "true", "--output_dir", str(tmp_path)]
    assert run_main("finetune/train_ncc.py", args, capsys)[0] == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["protocol"] == "sahajbert" and results["best_model_metric"] == "loss", results
    settings = torch.load(tmp_path / "training_args.bin", weights_only=False)
    assert (settings.learning_rate, settings.per_device_eval_batch_size) == (1e-5, 128), "the protocol's"
    assert (settings.num_train_epochs, settings.per_device_train_batch_size) == (1, 16), "the flags'"


@pytest.fixture(scope="module")
def lean_checkpoint(tmp_path_factory):
    """A LeanALBERT (sahajBERT-XL's architecture, tiny sizes) checkpoint, as our trainers write it."""
    from sahajbert.checkpoints import save_checkpoint
    from sahajbert.model import build_model
    from sahajbert.tokenization import load_tokenizer

    tokenizer = load_tokenizer("sample")
    model = build_model("tiny-xl", tokenizer, seed=0)
    return save_checkpoint(tmp_path_factory.mktemp("lean"), 1, model, tokenizer)


@pytest.mark.slow
@pytest.mark.timeout(660)
@pytest.mark.parametrize("task", ["ner", "ncc"])
def test_fine_tuning_trains_a_lean_albert_checkpoint(lean_checkpoint, tmp_path, task):
    files = NER_FILES if task == "ner" else NEWS_FILES
    args = ["--model_name_or_path", str(lean_checkpoint), *files, *QUICK, "--num_train_epochs", "2"]
    result = run_script(f"train_{task}.py", [*args, "--output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["epochs_trained"] == 2 and results["test"]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["hidden_act_gated"] and saved["position_embedding_type"] == "rotary", "fine-tuned LeanALBERT"
    expected = "LeanAlbertForTokenClassification" if task == "ner" else "LeanAlbertForSequenceClassification"
    assert saved["architectures"] == [expected]
