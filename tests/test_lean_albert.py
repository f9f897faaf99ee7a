"""LeanALBERT (sahajBERT-XL's model): parity with the reference implementation, its released format, our loader."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sahajbert.lean_albert import LeanAlbertConfig, LeanAlbertForPreTraining
from sahajbert.model import build_model, count_parameters, load_model, read_config

from .swarm_helpers import ROOT, require

REFERENCE = ROOT.parent / "shared" / "reference" / "lean-albert-tiny"


@pytest.fixture(scope="module")
def reference() -> Path:
    """The tiny checkpoint and outputs the reference implementation wrote (shared/reference/README.md)."""
    require((REFERENCE / "config.json").is_file(), str(REFERENCE), "a checkout beside ../shared (CI has one)")
    return REFERENCE


def reference_outputs(folder: Path) -> dict:
    return torch.load(folder / "reference_outputs.pt", map_location="cpu", weights_only=True)


def test_load_model_reproduces_the_reference_outputs(reference):
    model = load_model(reference).eval()
    assert isinstance(model, LeanAlbertForPreTraining)
    out = reference_outputs(reference)
    with torch.no_grad():
        inputs = {name: out[name] for name in ("input_ids", "token_type_ids", "attention_mask")}
        ours = model(**inputs)
    unpadded = out["attention_mask"].bool()
    prediction_error = (ours.prediction_logits - out["prediction_logits"])[unpadded].abs().max().item()
    sop_error = (ours.sop_logits - out["sop_logits"]).abs().max().item()
    assert prediction_error < 1e-5 and sop_error < 1e-5, (prediction_error, sop_error)


def test_a_saved_model_keeps_the_released_format(reference, tmp_path):
    """model_type albert with the two LeanALBERT fields, the reference's key names, the unused norms kept."""
    released = torch.load(reference / "pytorch_model.bin", map_location="cpu", weights_only=True)
    load_model(reference).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "albert" and config["hidden_act_gated"] is True
    assert config["position_embedding_type"] == "rotary"
    saved = load_file(tmp_path / "model.safetensors")
    # a tied tensor is stored once: the decoder weight is the word embeddings, its bias the MLM bias
    tied = {"predictions.decoder.weight", "predictions.decoder.bias"}
    assert set(saved) | tied == set(released), sorted(set(saved) ^ set(released))
    assert any("full_layer_layer_norm" in key for key in saved)
    assert all(torch.equal(saved[key], released[key]) for key in saved)
    again = load_model(tmp_path).eval()
    out = reference_outputs(reference)
    with torch.no_grad():
        logits = again(input_ids=out["input_ids"], attention_mask=out["attention_mask"]).prediction_logits
        first = load_model(reference).eval()(input_ids=out["input_ids"], attention_mask=out["attention_mask"])
    assert torch.equal(logits, first.prediction_logits)


@pytest.mark.parametrize("architecture", ["AlbertForMaskedLM", "AlbertForPreTraining"])
def test_a_released_config_is_lean_albert_by_its_fields_not_its_name(reference, tmp_path, architecture):
    config = json.loads((reference / "config.json").read_text())
    config["architectures"] = [architecture]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "pytorch_model.bin").symlink_to(reference / "pytorch_model.bin")
    assert isinstance(load_model(tmp_path), LeanAlbertForPreTraining)
    plain = {k: v for k, v in config.items() if k not in ("hidden_act_gated", "position_embedding_type")}
    (tmp_path / "plain.json").write_text(json.dumps(plain))
    assert not isinstance(read_config(str(tmp_path / "plain.json")), LeanAlbertConfig), "without them: ALBERT"


def test_the_xl_preset_is_lean_albert_at_the_reference_size():
    config = read_config("sahajbert-xl")
    assert isinstance(config, LeanAlbertConfig) and config.hidden_act_gated
    assert config.position_embedding_type == "rotary" and config.rotary_embedding_base == 10_000
    config.vocab_size = 32_000
    assert round(count_parameters(config) / 1e6, 1) == 76.0
    base = read_config("sahajbert")
    base.vocab_size = 32_000
    assert not isinstance(base, LeanAlbertConfig) and round(count_parameters(base) / 1e6, 1) == 18.1


@pytest.mark.parametrize(
    "task, labels, shape",
    [
        ("masked_lm", lambda b, s: torch.randint(0, 2000, (b, s)), (2, 12, 2000)),
        ("token_classification", lambda b, s: torch.randint(0, 7, (b, s)), (2, 12, 7)),
        ("sequence_classification", lambda b, s: torch.randint(0, 7, (b,)), (2, 7)),
    ],
)
def test_every_head_loads_from_a_pretraining_checkpoint_and_trains(reference, task, labels, shape):
    model = load_model(reference, task, num_labels=7)
    ids = torch.randint(5, 2000, (2, 12))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels(2, 12))
    assert out.logits.shape == shape and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None for name, p in model.named_parameters() if "full_layer_layer_norm" not in name)


def pretraining_batch(vocab_size: int, size: int = 4, length: int = 16) -> dict:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab_size, (size, length), generator=generator)
    labels = torch.where(torch.rand(size, length, generator=generator) < 0.3, ids, torch.full_like(ids, -100))
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": labels,
        "sentence_order_label": torch.randint(0, 2, (size,), generator=generator),
    }


def test_gradient_checkpointing_gives_the_same_gradients(tokenizer):
    grads = []
    for checkpointing in (False, True):
        model = build_model("tiny-xl", tokenizer, seed=0).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        torch.manual_seed(1)  # the same dropout masks (the SOP head's) in both runs
        model(**pretraining_batch(len(tokenizer))).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])


def test_it_learns_and_runs_under_bf16_autocast(tokenizer):
    model = build_model("tiny-xl", tokenizer, seed=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = pretraining_batch(len(tokenizer))
    losses = []
    for _ in range(15):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(model(**batch).loss)


REMOTE_CODE_USER = """
import json, sys
import torch
from transformers import AutoModelForPreTraining, AutoModelForSequenceClassification, AutoModelForTokenClassification

try:
    import sahajbert  # noqa: F401
    sys.exit("this environment must not have the project")
except ImportError:
    pass
folder, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
model = AutoModelForPreTraining.from_pretrained(folder, trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).prediction_logits
tokens = AutoModelForTokenClassification.from_pretrained(folder, trust_remote_code=True, num_labels=7)
news = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True, num_labels=6)
print(json.dumps({
    "classes": [type(m).__name__ for m in (model, tokens, news)],
    "logits": logits.tolist(),
    "token_logits": list(tokens(input_ids=ids).logits.shape),
    "sequence_logits": list(news(input_ids=ids).logits.shape),
}))
"""


def dependency_closure(names: list[str]) -> set[str]:
    """The installed distributions `names` need, themselves included (their requirements, without extras)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    needed, todo = set(), list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in needed:
            continue
        try:
            requirements = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue  # an optional dependency this environment does not have
        needed.add(name)
        for requirement in map(Requirement, requirements):
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return needed


def link_distributions(names: set[str], site_packages: Path) -> None:
    """Link each distribution's top-level files (its modules and its .dist-info) into `site_packages`."""
    from importlib import metadata

    for name in names:
        distribution = metadata.distribution(name)
        for top in {file.parts[0] for file in distribution.files or []}:
            source = Path(distribution.locate_file(top))
            if top != ".." and not top.endswith(".pth") and source.exists():
                target = site_packages / top
                if not target.exists():
                    target.symlink_to(source)


@pytest.mark.slow
def test_a_checkpoint_loads_with_only_torch_and_transformers(tmp_path, tokenizer):
    """What a Hub user of an uploaded checkpoint does: a fresh virtualenv with torch and transformers, no project.

    Offline: the new environment gets exactly the distributions torch and transformers need, linked from this one.
    """
    import subprocess
    import sys
    import sysconfig

    from sahajbert.checkpoints import save_checkpoint

    model = build_model("tiny-xl", tokenizer, seed=0).eval()
    checkpoint = save_checkpoint(tmp_path / "run", 3, model, tokenizer)
    assert (checkpoint / "lean_albert.py").is_file()
    assert json.loads((checkpoint / "config.json").read_text())["auto_map"]["AutoModelForPreTraining"]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site_packages = venv / Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)
    needed = dependency_closure(["torch", "transformers"])
    assert "sahajbert-collab" not in needed and {"torch", "transformers", "tokenizers"} <= needed
    link_distributions(needed, site_packages)
    (tmp_path / "user.py").write_text(REMOTE_CODE_USER)
    ids = torch.randint(5, len(tokenizer), (2, 10))
    env = {"PATH": os.environ["PATH"], "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)}
    result = subprocess.run(
        [str(venv / "bin" / "python"), str(tmp_path / "user.py"), str(checkpoint), json.dumps(ids.tolist())],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["classes"] == [
        "LeanAlbertForPreTraining",
        "LeanAlbertForTokenClassification",
        "LeanAlbertForSequenceClassification",
    ]
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=torch.ones_like(ids)).prediction_logits
    assert torch.allclose(torch.tensor(report["logits"]), ours, atol=1e-5)
    assert report["token_logits"] == [2, 10, 7] and report["sequence_logits"] == [2, 6]


@pytest.mark.parametrize(
    "preset, expected", [("tiny", "AlbertForPreTraining"), ("tiny-xl", "LeanAlbertForPreTraining")]
)
def test_load_model_reads_our_own_checkpoints_of_both_architectures(tmp_path, tokenizer, preset, expected):
    from sahajbert.checkpoints import save_checkpoint

    model = build_model(preset, tokenizer, seed=0)
    loaded = load_model(save_checkpoint(tmp_path, 1, model, tokenizer))
    assert type(loaded).__name__ == expected
    saved, again = model.state_dict(), loaded.state_dict()
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)
