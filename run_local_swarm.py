#!/usr/bin/env python
"""The demo: a first peer and two trainers on 127.0.0.1 train the tiny ALBERT on the bundled Bengali sample."""

import logging
import shutil
import time
from pathlib import Path

from sahajbert.cli import Flags, parse_args, run, setup_logging
from sahajbert.flags import LocalSwarmArguments

logger = logging.getLogger("local_swarm")
HERE = Path(__file__).resolve().parent  # the trainer and first-peer scripts beside this one
FLAGS = Flags(
    (LocalSwarmArguments,),
    description="The demo: a first peer and trainers on 127.0.0.1 train the tiny ALBERT on the bundled sample.",
)


def trainer_args(args: LocalSwarmArguments, initial_peers: list[str], index: int) -> list[str]:
    from sahajbert.localswarm import tiny_trainer_flags

    return ["--run_id", args.run_id, "--initial_peers", *initial_peers] + tiny_trainer_flags(
        target_batch_size=args.target_batch_size,
        max_steps=args.max_steps,
        save_steps=args.max_steps,
        output_dir=Path(args.output_dir) / f"trainer{index}",
    )


def main(argv=None) -> int:
    setup_logging()
    (args,) = parse_args(FLAGS, argv)
    from sahajbert.checkpoints import latest_checkpoint
    from sahajbert.localswarm import PeerProcess, start_first_peer
    from sahajbert.model import load_model
    from sahajbert.train_log import read_train_log

    output_dir = Path(args.output_dir)
    shutil.rmtree(output_dir, ignore_errors=True)  # a demo starts from scratch every time
    started = time.monotonic()
    first_peer, initial_peers = start_first_peer(HERE / "run_first_peer.py", output_dir, args.run_id)
    logger.info(f"first peer is up: --initial_peers {' '.join(initial_peers)}")
    trainers = [
        PeerProcess(HERE / "run_trainer.py", trainer_args(args, initial_peers, i), output_dir / f"trainer{i}.log")
        for i in range(args.num_trainers)
    ]
    logger.info(f"started {len(trainers)} trainers; logs in {output_dir}/trainer*.log")
    try:
        for i, trainer in enumerate(trainers):
            remaining = args.timeout - (time.monotonic() - started)
            if trainer.wait(max(1.0, remaining)) != 0:
                logger.error(f"trainer {i} failed:\n{trainer.output()[-2000:]}")
                return 1
    finally:
        for process in [*trainers, first_peer]:
            process.stop()
    logs = [read_train_log(output_dir / f"trainer{i}") for i in range(args.num_trainers)]
    first = sum(log[0].loss for log in logs) / len(logs)
    last = sum(log[-1].loss for log in logs) / len(logs)
    checkpoint = latest_checkpoint(output_dir / "trainer0")
    model = load_model(checkpoint)
    print("\n=== local swarm summary ===")
    print(f"global steps:     {max(log[-1].step for log in logs)}")
    print(f"loss (per mini-step, mean of trainers): {first:.4f} at step {logs[0][0].step} -> {last:.4f} at the end")
    print(f"peers seen:       {max(r.peers for log in logs for r in log)} trainers in one global step")
    print(
        f"checkpoint:       {checkpoint} ({sum(p.numel() for p in model.parameters()):,} parameters, "
        "loads with sahajbert.model.load_model)"
    )
    print(f"wall time:        {time.monotonic() - started:.0f} s; every process stopped")
    return 0


if __name__ == "__main__":
    run(main)
