#!/usr/bin/env python
"""Collaboration overhead, side by side in one run on this machine:

1. samples/s of a plain PyTorch loop (same model, batch, LAMB and data, no hivemind) vs one trainer alone in
   its swarm (run_trainer.py: hivemind.Optimizer, offloading, progress reports, metrics);
2. the time per global step with 1 and 2 trainer peers (same target batch size);
3. the same 2 peers in an invite-only run (every DHT request signed and checked, every averaging call gated).
Each trainer is a real process; every process shares this machine's cores, so 2 peers get one core each.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sahajbert.access import add_invite
from sahajbert.collators import PretrainingCollator
from sahajbert.flags import CorpusArguments
from sahajbert.localswarm import PeerProcess, start_first_peer, tiny_trainer_flags
from sahajbert.model import build_model
from sahajbert.optim import Lamb, parameter_groups
from sahajbert.samples import SAMPLE_FILES, SAMPLE_TOKENIZER
from sahajbert.stream import Prefetcher, batched, iterate_examples
from sahajbert.tokenization import load_tokenizer
from sahajbert.train_log import read_train_log

REPO = Path(__file__).resolve().parents[1]  # the first-peer and trainer scripts


def plain_loop(args, threads: int) -> float:
    """samples/s of forward + backward + LAMB step, no hivemind, after `warmup` batches."""
    torch.set_num_threads(threads)
    tokenizer = load_tokenizer(SAMPLE_TOKENIZER)
    model = build_model(args.model, tokenizer, seed=0)
    optimizer = Lamb(parameter_groups(model, 0.01), lr=0.001, clamp_value=10_000.0)
    corpus = CorpusArguments(data_files=SAMPLE_FILES, shuffle_buffer=200, max_seq_length=args.max_seq_length)
    collator = PretrainingCollator.from_tokenizer(tokenizer, seed=0, pad_to_multiple_of=8)
    batches = Prefetcher(batched(iterate_examples(corpus, tokenizer, seed=0), args.batch_size, collator))
    for i in range(args.warmup + args.batches):
        if i == args.warmup:
            start = time.perf_counter()
        model(**next(batches)).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    batches.close()
    return args.batches * args.batch_size / (time.perf_counter() - start)


def swarm(args, workdir: Path, peers: int, invite_only: bool = False) -> tuple[float, float]:
    """(samples/s of one trainer, seconds per global step) for `peers` trainers, measured after step 1."""
    run_id = f"bench{peers}" + ("invited" if invite_only else "")
    (workdir / run_id).mkdir(parents=True)
    extra, invites = [], [[] for _ in range(peers)]
    if invite_only:
        allowlist = workdir / run_id / "allow.txt"
        invites = [
            ["--invite", f"{i.name}:{i.secret}"] for i in (add_invite(allowlist, f"v{n}") for n in range(peers))
        ]
        extra = ["--allowlist", str(allowlist), "--identity_path", str(workdir / run_id / "first.id")]
    first_peer, initial_peers = start_first_peer(REPO / "run_first_peer.py", workdir / run_id, run_id, extra)
    trainers = []
    try:
        for i in range(peers):
            flags = tiny_trainer_flags(
                model=args.model,
                max_seq_length=args.max_seq_length,
                per_device_train_batch_size=args.batch_size,
                target_batch_size=args.target_batch_size,
                max_steps=args.steps,
                save_steps=100_000,
                output_dir=workdir / run_id / f"trainer{i}",
            )
            trainers.append(
                PeerProcess(
                    REPO / "run_trainer.py",
                    ["--run_id", run_id, "--initial_peers", *initial_peers, *flags, *invites[i]],
                    workdir / run_id / f"trainer{i}.log",
                )
            )
        for trainer in trainers:
            if trainer.wait(1800) != 0:
                raise RuntimeError(trainer.output()[-3000:])
    finally:
        for process in [*trainers, first_peer]:
            process.stop()
    log = read_train_log(workdir / run_id / "trainer0")
    measured = [r for r in log if r.step > 1]  # step 1 includes start-up and the first matchmaking
    seconds = measured[-1].time - log[0].time
    return sum(r.samples for r in measured) / seconds, seconds / len(measured)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="tiny", help="model preset")
    parser.add_argument("--max_seq_length", type=int, default=128, help="tokens per example")
    parser.add_argument("--batch_size", type=int, default=16, help="examples per forward/backward")
    parser.add_argument("--target_batch_size", type=int, default=1024, help="samples per global step")
    parser.add_argument("--steps", type=int, default=6, help="global steps per swarm run")
    parser.add_argument("--repeats", type=int, default=3, help="2-peer runs of each kind, open and invite-only")
    parser.add_argument("--batches", type=int, default=150, help="measured batches of the plain loop")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured batches of the plain loop")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        plain = plain_loop(args, threads=1)  # each trainer process also computes with one thread
        alone, step_1 = swarm(args, Path(tmp), peers=1)
        # open and invite-only alternate, so that both see the same drift of this machine's load
        open_steps, invited_steps = [], []
        for repeat in range(args.repeats):
            open_steps.append(swarm(args, Path(tmp) / f"r{repeat}", peers=2)[1])
            invited_steps.append(swarm(args, Path(tmp) / f"r{repeat}", peers=2, invite_only=True)[1])
        step_2, step_invited = statistics.median(open_steps), statistics.median(invited_steps)
    print(
        f"\nmodel={args.model}, seq={args.max_seq_length}, batch={args.batch_size}, "
        f"target batch={args.target_batch_size}, 1 thread per process\n"
    )
    print("| measurement | value | ratio |\n|---|---:|---:|")
    print(f"| plain PyTorch loop, samples/s | {plain:.1f} | 1.00 |")
    print(f"| one trainer alone in its swarm, samples/s | {alone:.1f} | {alone / plain:.2f} |")
    print(f"| seconds per global step, 1 peer | {step_1:.2f} | 1.00 |")
    print(f"| seconds per global step, 2 peers (median of {args.repeats}) | {step_2:.2f} | {step_2 / step_1:.2f} |")
    print(
        f"| seconds per global step, 2 peers, invite-only (median of {args.repeats}) | {step_invited:.2f} | "
        f"{step_invited / step_1:.2f} |"
    )
    print(
        f"\n2 peers, open: {' '.join(f'{s:.2f}' for s in open_steps)} s; invite-only: "
        f"{' '.join(f'{s:.2f}' for s in invited_steps)} s (run by run)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
