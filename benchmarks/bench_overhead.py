#!/usr/bin/env python
"""What joining a swarm costs a peer, at the real model sizes: a trainer alone vs a plain PyTorch loop.

For each model, side by side in one run on this machine: a plain loop (same model, batch, LAMB, data and steps: one
LAMB step every --passes_per_step passes, no hivemind) and run_trainer.py alone in its swarm (hivemind.Optimizer with
the offloaded optimizer and delayed updates, its DHT, averager processes and p2p daemon). Both are processes of their
own with the same number of math threads. Measured: samples/s after the first optimizer step, and peak memory as PSS
of the process and all its children (so that pages they share count once), sampled every 0.25 s.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def plain_loop(args) -> None:
    """The --plain child: prints {"samples_per_second": ...} after its measured passes."""
    from sahajbert.collators import PretrainingCollator
    from sahajbert.flags import CorpusArguments
    from sahajbert.model import build_model
    from sahajbert.optim import Lamb, parameter_groups
    from sahajbert.stream import Prefetcher, batched, iterate_examples
    from sahajbert.tokenization import load_tokenizer

    tokenizer = load_tokenizer("sample")
    model = build_model(args.model, tokenizer, seed=0).train()
    optimizer = Lamb(parameter_groups(model, 0.01), lr=0.001, clamp_value=10_000.0, max_grad_norm=1.0)
    corpus = CorpusArguments(data_files=["sample"], max_seq_length=args.max_seq_length, shuffle_buffer=200)
    collator = PretrainingCollator.from_tokenizer(tokenizer, seed=0, pad_to_multiple_of=8)
    batches = Prefetcher(batched(iterate_examples(corpus, tokenizer, seed=0), args.batch_size, collator))
    for step in range(args.steps):
        if step == 1:  # as for the trainer: from the end of the first optimizer step
            started = time.perf_counter()
        for _ in range(args.passes_per_step):
            (model(**next(batches)).loss / args.passes_per_step).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    samples = (args.steps - 1) * args.passes_per_step * args.batch_size
    batches.close()
    print(json.dumps({"samples_per_second": samples / (time.perf_counter() - started)}), flush=True)


class PeakPss:
    """Samples the PSS of a process and all its descendants in a thread; `peak` in bytes."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.root, self.interval, self.peak = psutil.Process(pid), interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            total = 0
            try:
                for process in [self.root, *self.root.children(recursive=True)]:
                    try:
                        total += process.memory_full_info().pss
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        pass
            except psutil.NoSuchProcess:
                return
            self.peak = max(self.peak, total)
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_measured(command: list[str], env: dict, log: Path, timeout: float) -> int:
    """Run `command` to its end, its output to `log`; returns its peak PSS in bytes."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        memory = PeakPss(process.pid)
        try:
            code = process.wait(timeout)
        finally:
            peak = memory.stop()
    if code != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed:\n{log.read_text()[-3000:]}")
    return peak


def measure(args, model: str, workdir: Path) -> dict:
    from sahajbert.localswarm import peer_env, tiny_trainer_flags
    from sahajbert.train_log import read_train_log

    env = {**peer_env(), "OMP_NUM_THREADS": str(args.threads)}
    common = ["--model", model, "--max_seq_length", str(args.max_seq_length), "--batch_size", str(args.batch_size)]
    common += ["--steps", str(args.steps), "--passes_per_step", str(args.passes_per_step)]
    plain_log = workdir / f"plain-{model}.log"
    plain_peak = run_measured([sys.executable, __file__, "--plain", *common], env, plain_log, timeout=args.timeout)
    plain = json.loads(plain_log.read_text().strip().splitlines()[-1])["samples_per_second"]

    output = workdir / f"trainer-{model}"
    flags = tiny_trainer_flags(
        model=model,
        max_seq_length=args.max_seq_length,
        per_device_train_batch_size=args.batch_size,
        target_batch_size=args.batch_size * args.passes_per_step,
        max_steps=args.steps,
        learning_rate=0.001,
        save_steps=10**9,
        final_averaging_window=0,
        output_dir=output,
    )
    trainer_peak = run_measured(
        [sys.executable, str(REPO / "run_trainer.py"), *flags], env, workdir / f"trainer-{model}.log", args.timeout
    )
    records = read_train_log(output)
    measured = [r for r in records if r.step > 1]
    trainer = sum(r.samples for r in measured) / (measured[-1].time - records[0].time)
    return {"plain": plain, "trainer": trainer, "plain_pss": plain_peak, "trainer_pss": trainer_peak}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--models", nargs="+", default=["sahajbert", "sahajbert-xl"], help="model presets")
    parser.add_argument("--max_seq_length", type=int, default=128, help="tokens per example")
    parser.add_argument("--batch_size", type=int, default=4, help="examples per forward/backward pass")
    parser.add_argument("--passes_per_step", type=int, default=4, help="passes per optimizer (global) step")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps; the first is not measured")
    parser.add_argument("--threads", type=int, default=2, help="math threads of each process")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one measured process may take")
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # the plain loop's own process
    parser.add_argument("--model", default="sahajbert", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plain:
        plain_loop(args)
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            r = measure(args, model, Path(tmp))
            rows.append(
                f"| {model} | {r['plain']:.2f} | {r['trainer']:.2f} | {r['trainer'] / r['plain']:.2f} "
                f"| {r['plain_pss'] / 2**20:.0f} | {r['trainer_pss'] / 2**20:.0f} "
                f"| {r['trainer_pss'] / r['plain_pss']:.2f} |"
            )
    print(
        f"\nseq {args.max_seq_length}, batch {args.batch_size} x {args.passes_per_step} passes per step, "
        f"{args.steps} steps (the first not measured), {args.threads} threads per process\n"
    )
    print(
        "| model | plain loop, samples/s | trainer alone, samples/s | ratio | plain loop, peak PSS MiB "
        "| trainer + children, peak PSS MiB | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
