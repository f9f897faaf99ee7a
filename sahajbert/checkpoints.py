"""Atomic checkpoints in `save_pretrained` format: a crash never leaves a half-written one as the latest."""

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch

from sahajbert.cli import UserError
from sahajbert.tokenization import save_tokenizer

logger = logging.getLogger(__name__)
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"  # written last: a folder without it is never treated as a checkpoint
OPTIMIZER_FILE = "optimizer.pt"


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in `output_dir` as (global step, path), oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for path in output_dir.iterdir():
        match = CHECKPOINT_NAME.match(path.name)
        if match and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1][1] if checkpoints else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model,
    tokenizer,
    optimizer_state: dict | None = None,
    state: dict | None = None,
    keep: int = 3,
) -> Path:
    """Write `output_dir/checkpoint-<step>/` through a temporary folder and one rename, then keep the last `keep`."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp)
    save_tokenizer(tokenizer, tmp)
    if optimizer_state is not None:
        torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
    with open(tmp / STATE_FILE, "w") as f:
        json.dump({"global_step": step, **(state or {})}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    replaced = final.exists()
    if replaced:  # the same step saved again (the final parameters, or after a restart): replace it, never merge
        trash = output_dir / f".old-checkpoint-{step}-{os.getpid()}"
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(tmp, final)
    _fsync_dir(output_dir)
    for _, old in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    # one line per checkpoint: rewriting the same step (the run's final parameters) is not a new one
    logger.log(logging.DEBUG if replaced else logging.INFO, f"saved checkpoint {final}")
    return final


def read_state(checkpoint: str | Path) -> dict:
    try:
        return json.loads((Path(checkpoint) / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"checkpoint '{checkpoint}' is unreadable ({e}); delete it or choose another") from e


def load_optimizer_state(checkpoint: str | Path) -> dict | None:
    path = Path(checkpoint) / OPTIMIZER_FILE
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise UserError(f"checkpoint '{checkpoint}' has an unreadable {OPTIMIZER_FILE} ({e}); delete it") from e
