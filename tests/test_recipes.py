"""`--recipe` and `--protocol`: what the flags give is what the documented tables say, and explicit flags win."""

import dataclasses
import json
import runpy

import pytest

from sahajbert import cli
from sahajbert.flags.finetune import finetune_flags
from sahajbert.recipes import PROTOCOLS, RECIPES

from .swarm_helpers import ROOT, script

# the page that holds the recipe and protocol tables (the README links to it)
TABLES_PAGE = "docs/models-and-evaluation.md"


def docs_table(first_header_cell: str) -> list[list[str]]:
    """The documented table whose header row starts with `first_header_cell`, as rows of cells (backticks removed)."""
    lines = (ROOT / TABLES_PAGE).read_text(encoding="utf-8").splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith(f"| {first_header_cell} |")]
    assert len(headers) == 1, f"one table headed {first_header_cell!r} in {TABLES_PAGE}"
    rows = []
    for line in lines[headers[0] + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
    return rows


def flat_values(parsed: tuple) -> dict:
    values = {}
    for obj in parsed:
        parts = [getattr(obj, f.name) for f in dataclasses.fields(obj)] if hasattr(obj, "GROUPS") else [obj]
        for part in parts:
            values.update({f.name: getattr(part, f.name) for f in dataclasses.fields(part)})
    return values


def same(cell: str, value) -> bool:
    if value is None or isinstance(value, str):
        return cell == str(value)
    return float(cell) == float(value)


TRAINER_FLAGS = runpy.run_path(str(script("run_trainer.py")))["FLAGS"]


def test_the_recipe_table_is_what_the_flags_give():
    rows = docs_table("flag | our default | `--recipe sahajbert`")
    columns = {
        "ours": flat_values(cli.parse_args(TRAINER_FLAGS, [])),
        "sahajbert": flat_values(cli.parse_args(TRAINER_FLAGS, ["--recipe", "sahajbert"])),
        "sahajbert-xl": flat_values(cli.parse_args(TRAINER_FLAGS, ["--recipe", "sahajbert-xl"])),
    }
    names = [row[0].removeprefix("--") for row in rows]
    assert sorted(names) == sorted(RECIPES["sahajbert"]) == sorted(RECIPES["sahajbert-xl"]), "every recipe value"
    for name, ours, dedloc, xl, why in rows:
        name = name.removeprefix("--")
        for column, cell in (("ours", ours), ("sahajbert", dedloc), ("sahajbert-xl", xl)):
            assert same(cell, columns[column][name]), (
                f"{name} under {column}: {TABLES_PAGE} {cell}, flags {columns[column][name]}"
            )
        if ours != dedloc and ours != xl:
            assert why, f"--{name}: our default differs from both references, and {TABLES_PAGE} must say why"


@pytest.mark.parametrize("task", ["ner", "ncc"])
def test_the_protocol_table_is_what_the_flags_give(task):
    rows = docs_table("flag | our default | `--protocol sahajbert` (NER, news)")
    flags, model = finetune_flags(task), ["--model_name_or_path", "some/model"]
    columns = {
        "ours": flat_values(cli.parse_args(flags, model)),
        "sahajbert": flat_values(cli.parse_args(flags, [*model, "--protocol", "sahajbert"])),
        "sahajbert-xl": flat_values(cli.parse_args(flags, [*model, "--protocol", "sahajbert-xl"])),
    }
    assert sorted(row[0].removeprefix("--") for row in rows) == sorted(PROTOCOLS[task]["sahajbert-xl"])
    for name, ours, dedloc, xl_ner, xl_news in rows:
        name = name.removeprefix("--")
        xl = xl_ner if task == "ner" else xl_news
        for column, cell in (("ours", ours), ("sahajbert", dedloc), ("sahajbert-xl", xl)):
            assert same(cell, columns[column][name]), f"{task} {name} under {column}: {TABLES_PAGE} {cell}"


def test_flags_win_over_the_recipe_and_the_recipe_over_the_defaults(tmp_path):
    values = flat_values(cli.parse_args(TRAINER_FLAGS, ["--recipe", "sahajbert-xl", "--target_batch_size", "512"]))
    assert (
        values["target_batch_size"] == 512 and values["learning_rate"] == 0.005 and values["model"] == "sahajbert-xl"
    )
    settings = tmp_path / "run.json"
    settings.write_text(json.dumps({"recipe": "sahajbert", "warmup_steps": 10}))
    values = flat_values(cli.parse_args(TRAINER_FLAGS, [str(settings), "--max_steps", "3"]))
    assert values["warmup_steps"] == 10, "a settings file wins over its recipe"
    assert values["total_steps"] == 1_000_000 and values["clip_gradients"] == "local" and values["max_steps"] == 3
    aux_flags = runpy.run_path(str(script("run_aux_peer.py")))["FLAGS"]
    values = flat_values(cli.parse_args(aux_flags, ["--recipe", "sahajbert-xl"]))
    assert values["learning_rate"] == 0.005 and values["compression"] == "adaptive", "the aux peer takes it too"
    with pytest.raises(cli.UserError, match="invalid choice: 'sahajbert-xxl'"):
        cli.parse_args(TRAINER_FLAGS, ["--recipe", "sahajbert-xxl"])
