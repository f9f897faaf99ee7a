#!/usr/bin/env python
"""Do trainers started together with the defaults train one model? A first peer and two trainers on 127.0.0.1.

Each run starts the two trainers at the same moment with different seeds (so with different initial parameters)
and the trainer's default timing: the tiny model on the bundled sample, `--target_batch_size 32
--per_device_train_batch_size 4 --max_steps 3`. A run agrees when both trainers were counted in one global step
and their final checkpoints hold the same parameters (fp16 averaging tolerance). Prints one row per run and the
tally: `python benchmarks/start_agreement.py --runs 10`.
"""

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from sahajbert.checkpoints import latest_checkpoint
from sahajbert.localswarm import PeerProcess, checkpoints_agree, start_first_peer, tiny_trainer_flags
from sahajbert.train_log import read_train_log

REPO = Path(__file__).resolve().parents[1]


def one_run(workdir: Path, index: int) -> dict:
    run_id = f"start{index}"
    first, initial_peers = start_first_peer(REPO / "run_first_peer.py", workdir, run_id)
    trainers = []
    started = time.monotonic()
    try:
        for seed in (1, 2):
            flags = ["--run_id", run_id, "--initial_peers", *initial_peers, "--seed", str(seed)]
            flags += tiny_trainer_flags(
                target_batch_size=32,
                per_device_train_batch_size=4,
                max_steps=3,
                output_dir=workdir / f"t{seed}",
                save_steps=3,
            )
            trainers.append(PeerProcess(REPO / "run_trainer.py", flags, workdir / f"t{seed}.log"))
        codes = [trainer.wait(600) for trainer in trainers]
    finally:
        for trainer in trainers:
            trainer.stop()
        first.stop()
    logs = [read_train_log(workdir / f"t{seed}") for seed in (1, 2)]
    checkpoints = [latest_checkpoint(workdir / f"t{seed}") for seed in (1, 2)]
    agree, difference = checkpoints_agree(checkpoints) if all(checkpoints) else (False, float("inf"))
    together = all(log and max(r.peers for r in log) >= 2 for log in logs)
    downloaded = sum("downloaded the first trainer's parameters" in t.output() for t in trainers)
    return {
        "run": index,
        "exit_codes": codes,
        "both_in_one_step": together,
        "started_from_first_trainer": downloaded,
        "max_parameter_difference": difference,
        "agree": agree and together and codes == [0, 0],
        "seconds": time.monotonic() - started,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--runs", type=int, default=10, help="scripted runs, one after the other")
    parser.add_argument("--keep_logs", default=None, help="copy every run's logs to this folder")
    args = parser.parse_args(argv)
    print(f"command: python benchmarks/start_agreement.py --runs {args.runs}\n")
    print(
        "| run | exit codes | both trainers in one global step | downloads of the first trainer's parameters "
        "| max parameter difference | agree | seconds |"
    )
    print("|---:|---|---|---:|---:|---|---:|")
    results = []
    for index in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="start-") as tmp:
            result = one_run(Path(tmp), index)
            if args.keep_logs:
                shutil.copytree(
                    tmp, Path(args.keep_logs) / f"run{index}", ignore=shutil.ignore_patterns("*.safetensors", "*.pt")
                )
        results.append(result)
        print(
            f"| {index} | {result['exit_codes']} | {'yes' if result['both_in_one_step'] else 'NO'} | "
            f"{result['started_from_first_trainer']} | {result['max_parameter_difference']:.2e} | "
            f"{'yes' if result['agree'] else 'NO'} | {result['seconds']:.0f} |",
            flush=True,
        )
    agreed = sum(r["agree"] for r in results)
    print(f"\n{agreed} of {len(results)} runs agree")
    return 0 if agreed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
