"""Settings shared by the integration tests; the process handling itself is the library's (sahajbert.localswarm)."""

from pathlib import Path

from sahajbert.localswarm import LOOPBACK, REPO_ROOT, PeerProcess, read_train_log, tiny_trainer_flags

ROOT = REPO_ROOT
LOCAL = LOOPBACK
# every test's trainers: the library's tiny settings, a checkpoint at every global step, frequent progress lines
TINY_TRAINING = tiny_trainer_flags(averaging_timeout=20, save_steps=1, log_every_seconds=2)


def last_step(output_dir: Path) -> int:
    records = read_train_log(output_dir)
    return records[-1]["step"] if records else 0


def start_peer(script: str, tmp_path: Path, name: str, run_id: str, initial_peers: list[str], *extra) -> PeerProcess:
    """run_trainer.py or run_aux_peer.py with the tests' tiny settings; its output_dir and log are named `name`."""
    args = [
        "--run_id",
        run_id,
        "--initial_peers",
        *initial_peers,
        *TINY_TRAINING,
        "--output_dir",
        str(tmp_path / name),
    ]
    return PeerProcess(script, [*args, *extra], tmp_path / f"{name}.log")
