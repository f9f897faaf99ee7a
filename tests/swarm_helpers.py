"""Settings shared by the integration tests; the process handling itself is the library's (sahajbert.localswarm)."""

from pathlib import Path

from sahajbert.localswarm import LOOPBACK, REPO_ROOT, read_train_log

ROOT = REPO_ROOT
LOCAL = LOOPBACK
SAMPLE_FILES = [str(ROOT / "data" / "sample" / "bn_wiki.txt"), str(ROOT / "data" / "sample" / "bn_web.txt")]
# A tiny ALBERT that learns visibly in a few global steps on 2 CPU cores. A global step (384 samples) takes a few
# seconds, longer than hivemind's progress refresh, so peers see each other as they would on real hardware.
TINY_TRAINING = (
    "--model tiny --max_seq_length 64 --per_device_train_batch_size 8 --target_batch_size 384 --warmup_steps 1 "
    "--total_steps 200 --learning_rate 0.02 --matchmaking_time 3 --averaging_timeout 20 --save_steps 1 "
    "--log_every_seconds 2 --shuffle_buffer 200"
).split() + ["--data_files", *SAMPLE_FILES, *LOCAL]


def last_step(output_dir: Path) -> int:
    records = read_train_log(output_dir)
    return records[-1]["step"] if records else 0
