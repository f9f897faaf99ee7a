"""Downstream evaluation shared by both tasks: NER (WikiANN bn) and news classification (IndicGLUE sna.bn)."""

import csv
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sahajbert.cli import UserError
from sahajbert.flags.finetune import FinetuneArguments, FinetuneTrainingArguments

logger = logging.getLogger(__name__)

# WikiANN's label ids (unimelb-nlp/wikiann), IOB2
NER_LABELS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"]
# IndicGLUE sna.bn's label ids (ai4bharat/indic_glue)
NEWS_LABELS = ["kolkata", "state", "national", "sports", "entertainment", "international"]
SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class Task:
    name: str
    dataset_name: str
    dataset_config: str
    labels: list[str]
    metric: str  # the validation metric that picks the best epoch and early-stops
    data_title: str  # what the results table calls the Hub dataset
    sample_files: tuple[str, str, str]  # train, validation and test files of finetune/sample/, for offline runs

    def sample_flags(self) -> str:
        """The flags of an offline run on the bundled sample files (paths as the user can type them from here)."""
        paths = [os.path.relpath(SAMPLE_DIR / name) for name in self.sample_files]
        return " ".join(f"--{split}_file {path}" for split, path in zip(SPLITS, paths))


SAMPLE_DIR = Path(__file__).resolve().parent.parent / "finetune" / "sample"
TASKS = {
    "ner": Task(
        "ner",
        "unimelb-nlp/wikiann",
        "bn",
        NER_LABELS,
        "f1",
        "WikiANN bn",
        ("ner_train.conll", "ner_validation.conll", "ner_test.conll"),
    ),
    "ncc": Task(
        "ncc",
        "ai4bharat/indic_glue",
        "sna.bn",
        NEWS_LABELS,
        "accuracy",
        "sna.bn",
        ("news_train.csv", "news_validation.csv", "news_test.csv"),
    ),
}


def _check_labels(names, allowed: list[str], where: str) -> None:
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise UserError(f"unknown label(s) {unknown} in {where}; expected one of {allowed}")


def read_conll(path: str) -> list[dict]:
    """One `token TAG` per line (whitespace-separated), a blank line between sentences."""
    sentences, tokens, tags = [], [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                if tokens:
                    sentences.append({"tokens": tokens, "ner_tags": tags})
                tokens, tags = [], []
                continue
            if len(parts) != 2:
                raise UserError(f"{path}:{number}: expected 'token TAG', got {line.strip()!r}")
            _check_labels([parts[1]], NER_LABELS, f"{path}:{number}")
            tokens.append(parts[0])
            tags.append(parts[1])
    if tokens:
        sentences.append({"tokens": tokens, "ner_tags": tags})
    return sentences


def read_jsonl(path: str) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}:{number}: not valid JSON ({e.msg})") from e
    return records


def read_ner_file(path: str) -> list[dict]:
    """CoNLL or JSON lines ({"tokens": [...], "ner_tags": [tag names or WikiANN ids]}), validated."""
    if not Path(path).is_file():
        raise UserError(f"data file not found: '{path}'")
    if not path.endswith((".jsonl", ".json")):
        return read_conll(path)
    sentences = []
    for number, record in enumerate(read_jsonl(path), 1):
        tokens, tags = record.get("tokens"), record.get("ner_tags")
        if not isinstance(tokens, list) or not isinstance(tags, list):
            raise UserError(f"{path}: record {number} needs lists 'tokens' and 'ner_tags'")
        if len(tokens) != len(tags):
            raise UserError(f"{path}: record {number} has {len(tokens)} tokens but {len(tags)} tags")
        tags = [NER_LABELS[t] if isinstance(t, int) and 0 <= t < len(NER_LABELS) else t for t in tags]
        _check_labels(tags, NER_LABELS, f"{path} record {number}")
        sentences.append({"tokens": tokens, "ner_tags": tags})
    return sentences


def read_news_file(path: str) -> list[dict]:
    """CSV or JSON lines with `text` and `label` (the label's name), validated."""
    if not Path(path).is_file():
        raise UserError(f"data file not found: '{path}'")
    if path.endswith((".jsonl", ".json")):
        rows = read_jsonl(path)
    else:
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
    for number, row in enumerate(rows, 1):
        if not isinstance(row.get("text"), str) or "label" not in row:
            raise UserError(f"{path}: row {number} needs 'text' and 'label'")
        _check_labels([row["label"]], NEWS_LABELS, f"{path} row {number}")
    return [{"text": row["text"], "label": row["label"]} for row in rows]


def load_task_data(task: Task, finetune_args: FinetuneArguments) -> dict[str, list[dict]]:
    """train/validation/test as lists of records with label NAMES, from local files or the Hub."""
    if finetune_args.train_file:
        reader = read_ner_file if task.name == "ner" else read_news_file
        data = {split: reader(getattr(finetune_args, f"{split}_file")) for split in SPLITS}
    else:
        from datasets import load_dataset

        from sahajbert.tokenization import hub_offline, hub_unreachable

        name = finetune_args.dataset_name or task.dataset_name
        config = finetune_args.dataset_config or task.dataset_config
        offline = f"; offline, fine-tune on local files, e.g. the bundled sample: {task.sample_flags()}"
        # asked first (one request, seconds): the datasets library retries an unreachable Hub for about a minute
        unreachable = None if hub_offline() else hub_unreachable()
        if unreachable:
            raise UserError(f"cannot load {name} ({config}): the Hub is unreachable ({unreachable}){offline}")
        try:
            hub = load_dataset(name, config)
        except Exception as e:
            raise UserError(f"cannot load {name} ({config}): {str(e).strip().splitlines()[0]}{offline}") from e
        column = "ner_tags" if task.name == "ner" else "label"
        names = hub["train"].features[column]
        names = names.feature.names if task.name == "ner" else names.names
        convert = (
            (lambda r: {**r, column: [names[i] for i in r[column]]})
            if task.name == "ner"
            else (lambda r: {**r, column: names[r[column]]})
        )
        data = {split: [convert(r) for r in hub[split]] for split in SPLITS}
    for split, records in data.items():
        if not records:
            raise UserError(f"the {split} split is empty")
    if finetune_args.max_train_samples:
        data["train"] = data["train"][: finetune_args.max_train_samples]
    return data


def load_model_tokenizer(path: str):
    """A fast tokenizer from the model folder; a folder without one is a UserError (not a random vocabulary)."""
    from transformers import AutoTokenizer

    folder = Path(path)
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "spiece.model", "vocab.txt")
    if folder.is_dir() and not any((folder / f).is_file() for f in tokenizer_files):
        raise UserError(f"model folder '{path}' has no tokenizer (expected tokenizer.json beside the weights)")
    if not folder.exists() and (path.startswith((".", "/")) or path.count("/") > 1):
        raise UserError(f"model folder not found: '{path}'")
    from sahajbert.tokenization import hub_offline, hub_unreachable

    unreachable = None if folder.exists() or hub_offline() else hub_unreachable()
    if unreachable:
        raise UserError(
            f"cannot load the model '{path}': no such folder here, and the Hub is unreachable ({unreachable}): give "
            "a checkpoint folder, e.g. one a trainer saved (outputs/demo/trainer0/checkpoint-N after `make demo`)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load a tokenizer for '{path}': {str(e).splitlines()[0]}") from e
    if not tokenizer.is_fast:
        raise UserError(f"'{path}' has no fast tokenizer; NER needs word ids from a fast tokenizer")
    return tokenizer


def encode_ner(records: list[dict], tokenizer, max_length: int) -> list[dict]:
    """Label only the first sub-token of each word; the others (and specials) get -100."""
    label_ids = {name: i for i, name in enumerate(NER_LABELS)}
    encoded = []
    for record in records:
        enc = tokenizer(record["tokens"], is_split_into_words=True, truncation=True, max_length=max_length)
        labels, previous = [], None
        for word in enc.word_ids():
            labels.append(-100 if word is None or word == previous else label_ids[record["ner_tags"][word]])
            previous = word
        encoded.append({**enc, "labels": labels})
    return encoded


def encode_news(records: list[dict], tokenizer, max_length: int) -> list[dict]:
    label_ids = {name: i for i, name in enumerate(NEWS_LABELS)}
    return [
        {**tokenizer(r["text"], truncation=True, max_length=max_length), "labels": label_ids[r["label"]]}
        for r in records
    ]


def ner_metrics(predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """seqeval precision/recall/F1 (entity level, micro-averaged) over the labelled positions."""
    from seqeval.metrics import f1_score, precision_score, recall_score

    true, pred = [], []
    for p_row, l_row in zip(predictions, labels):
        keep = l_row != -100
        true.append([NER_LABELS[i] for i in l_row[keep]])
        pred.append([NER_LABELS[i] for i in p_row[keep]])
    return {
        "precision": precision_score(true, pred, zero_division=0),
        "recall": recall_score(true, pred, zero_division=0),
        "f1": f1_score(true, pred, zero_division=0),
    }


def news_metrics(predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    from sklearn.metrics import f1_score

    return {
        "accuracy": float((predictions == labels).mean()),
        "macro_f1": float(
            f1_score(labels, predictions, average="macro", labels=range(len(NEWS_LABELS)), zero_division=0)
        ),
    }


def majority_baseline(task: Task, train: list[dict], test: list[dict]) -> dict[str, float]:
    """The score of always predicting the most frequent training label (for NER: all "O", F1 = 0)."""
    if task.name == "ner":
        return {"f1": 0.0}
    labels = [r["label"] for r in train]
    majority = max(set(labels), key=labels.count)
    return {"accuracy": sum(r["label"] == majority for r in test) / len(test)}


def run_task(task_name: str, finetune_args: FinetuneArguments, training_args: FinetuneTrainingArguments) -> dict:
    """Fine-tune, evaluate every epoch, keep the best, early-stop, score the test split; write results.json."""
    import torch
    from transformers import (
        DataCollatorForTokenClassification,
        DataCollatorWithPadding,
        EarlyStoppingCallback,
        Trainer,
        set_seed,
    )

    from sahajbert.devices import choose_precision, describe_device
    from sahajbert.model import load_model

    task = TASKS[task_name]
    tokenizer = load_model_tokenizer(finetune_args.model_name_or_path)
    data = load_task_data(task, finetune_args)
    encode = encode_ner if task.name == "ner" else encode_news
    encoded = {split: encode(records, tokenizer, finetune_args.max_seq_length) for split, records in data.items()}
    labels = {"num_labels": len(task.labels), "id2label": dict(enumerate(task.labels))}
    labels["label2id"] = {name: i for i, name in enumerate(task.labels)}
    if finetune_args.hidden_dropout_prob is not None:  # sahajBERT-XL fine-tuned with dropout 0.1
        labels["hidden_dropout_prob"] = finetune_args.hidden_dropout_prob
    head = "token_classification" if task.name == "ner" else "sequence_classification"
    # the seed also picks the new head's initial weights (the Trainer seeds only once the model exists)
    set_seed(training_args.seed)
    model = load_model(finetune_args.model_name_or_path, head, **labels)
    if torch.cuda.is_available() and not (training_args.fp16 or training_args.bf16):
        training_args.fp16 = choose_precision(describe_device("cuda"), "auto") == "fp16"
    if not torch.cuda.is_available():
        training_args.dataloader_pin_memory = False  # pinning needs an accelerator; avoid the warning per epoch
    # the best epoch (kept, and judged by early stopping): by the task's score, or by the validation loss
    by_loss = finetune_args.best_model_metric == "loss"
    training_args.metric_for_best_model = "loss" if by_loss else task.metric
    training_args.greater_is_better = not by_loss
    metric_fn = ner_metrics if task.name == "ner" else news_metrics

    def compute_metrics(prediction) -> dict[str, float]:
        return metric_fn(np.argmax(prediction.predictions, axis=-1), prediction.label_ids)

    collator = (DataCollatorForTokenClassification if task.name == "ner" else DataCollatorWithPadding)(tokenizer)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=encoded["train"],
        eval_dataset=encoded["validation"],
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics,
        callbacks=[
            EarlyStoppingCallback(finetune_args.early_stopping_patience, finetune_args.early_stopping_threshold)
        ],
    )
    trainer.train()
    # the final scores below are not epochs: early stopping would only warn that it finds no eval_ metric in them
    trainer.remove_callback(EarlyStoppingCallback)
    validation = trainer.evaluate(encoded["validation"], metric_key_prefix="validation")
    test = trainer.evaluate(encoded["test"], metric_key_prefix="test")
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json: every epoch's validation scores, and which checkpoint was the best
    results = {
        "task": task.name,
        "model_name_or_path": finetune_args.model_name_or_path,
        "seed": training_args.seed,
        "protocol": finetune_args.protocol,
        "best_model_metric": training_args.metric_for_best_model,
        "epochs_trained": trainer.state.epoch,
        "best_epoch_metric": trainer.state.best_metric,
        "validation": {k.removeprefix("validation_"): v for k, v in validation.items()},
        "test": {k.removeprefix("test_"): v for k, v in test.items()},
        "majority_baseline_test": majority_baseline(task, data["train"], data["test"]),
        # what the table names: the Hub dataset, or the local test file the scores come from
        "data": Path(finetune_args.test_file).name if finetune_args.train_file else task.data_title,
    }
    path = Path(training_args.output_dir) / "results.json"
    path.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    logger.info(f"{task.name} test {task.metric}: {results['test'][task.metric]:.4f} (written to {path})")
    return results


TABLE_COLUMNS = {"ner": ("NER F1", "f1"), "ncc": ("News accuracy", "accuracy")}
BASELINE_ROW = "majority-class baseline"


def summarize(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """{model: {task: {"mean", "std", "scores"}}} of the test metric over seeds (std: population, as numpy), and a
    row BASELINE_ROW: {task: {"mean", "data"}}, the score of always predicting the most frequent training label, and
    the data the task's scores come from."""
    table: dict[str, dict[str, dict]] = {}
    for run in runs:
        metric = TABLE_COLUMNS[run["task"]][1]
        cell = table.setdefault(run["model_name_or_path"], {}).setdefault(run["task"], {"scores": []})
        cell["scores"].append(run["test"][metric])
    for tasks in table.values():
        for cell in tasks.values():
            cell["mean"], cell["std"] = float(np.mean(cell["scores"])), float(np.std(cell["scores"]))
    for run in runs:  # the same data for every model and seed of a task (evaluate.py gives each task's flags once)
        metric = TABLE_COLUMNS[run["task"]][1]
        baseline = {"mean": run["majority_baseline_test"][metric], "data": run.get("data")}
        table.setdefault(BASELINE_ROW, {})[run["task"]] = baseline
    return table


def markdown_table(table: dict[str, dict[str, dict]], tasks: list[str]) -> str:
    """Paper-style table: one row per model, mean ± std (in %) per task, the data each task's column scores, and the
    majority-class baseline as the last row."""
    baseline = table.get(BASELINE_ROW, {})
    titles = [
        TABLE_COLUMNS[t][0] + (f" ({baseline[t]['data']})" if baseline.get(t, {}).get("data") else "") for t in tasks
    ]
    lines = ["| model | " + " | ".join(titles) + " |", "|---|" + "---:|" * len(tasks)]
    for model, cells in table.items():
        if model == BASELINE_ROW:
            continue
        values = [f"{100 * cells[t]['mean']:.2f} ± {100 * cells[t]['std']:.2f}" if t in cells else "-" for t in tasks]
        lines.append(f"| {model} | " + " | ".join(values) + " |")
    if baseline:
        values = [f"{100 * baseline[t]['mean']:.2f}" if t in baseline else "-" for t in tasks]
        lines.append(f"| {BASELINE_ROW} | " + " | ".join(values) + " |")
    return "\n".join(lines)
