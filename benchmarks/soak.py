#!/usr/bin/env python
"""A long run with churn on this machine: memory (RSS) of every peer over hundreds of averaging rounds.

hivemind issues #264 and #654 report averager memory that grows over hours of rounds, tied to failed rounds,
until training halts. This runs a first peer and --trainers tiny trainers on loopback for --rounds averaging rounds
(each global step is one gradient and one parameter all-reduce). Every --churn_every seconds one trainer is killed
(SIGKILL, as a closed laptop) and a new one starts, so that rounds do fail: the peers that were matched with it
wait for its parts and give up. trainer0 is never killed: it lives through every round.

RSS is measured per peer as the sum over its whole process tree (the trainer, hivemind's DHT and averager
processes, the p2p daemons), every --sample_every seconds. Printed: one row per sample time, and per
peer that lived past its warm-up (--warmup_rounds, or --warmup_minutes of its own life) its RSS then, at its end, and
the growth in between; failed rounds split into those within --churn_grace seconds of a churn event and the rest.

With --simulated the trainers are benchmarks/scale.py's simulated peers (this project's trainer with a declared pass
time and a payload model of --payload parameters, in --mode): tens of them fit 2 cores, for hours (#48):

    python benchmarks/soak.py --simulated --mode data-parallel --trainers 8 --minutes 120 --churn_every 300
"""

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil
import scale

from sahajbert.localswarm import PeerProcess, start_first_peer, stop_on_signals, tiny_trainer_flags
from sahajbert.train_log import read_train_log

REPO = Path(__file__).resolve().parents[1]
ROUNDS_PER_STEP = 2  # a global step: the gradient all-reduce, then the parameter all-reduce (DPU, every step)
UNBOUNDED_STEPS = 1_000_000  # --max_steps of a soak bounded by --minutes: it stops them


def tree_rss(peer: PeerProcess) -> int:
    """Resident bytes of a peer's process and its descendants (hivemind's forks, p2pd), as scale.py samples them."""
    try:
        return scale.tree_usage(psutil.Process(peer.process.pid))[0]
    except psutil.NoSuchProcess:  # it exited since it was seen running
        return 0


def soak(args, workdir: Path) -> dict:
    run_id = "soak"
    first_peer, initial_peers = start_first_peer(REPO / "run_first_peer.py", workdir, run_id)
    max_steps = UNBOUNDED_STEPS if args.minutes else args.rounds // ROUNDS_PER_STEP + 1

    def start(name: str) -> None:
        if args.simulated:  # scale.py's flags for a swarm of --trainers simulated peers, --max_steps its own
            swarm = argparse.Namespace(**{**vars(args), "steps": max_steps, "learning_rate": 0.05})
            flags = scale.trainer_flags(swarm, args.mode, args.trainers, run_id, initial_peers, workdir / name)
            trainers[name] = PeerProcess(Path(scale.__file__), ["peer", *flags], workdir / f"{name}.log")
            return
        flags = ["--run_id", run_id, "--initial_peers", *initial_peers] + tiny_trainer_flags(
            target_batch_size=args.target_batch_size,
            max_steps=max_steps,
            save_steps=100_000,
            output_dir=workdir / name,
        )
        trainers[name] = PeerProcess(REPO / "run_trainer.py", flags, workdir / f"{name}.log")

    trainers: dict[str, PeerProcess] = {}
    born: dict[str, float] = {}  # name -> seconds into the soak it started at
    churns: list[float] = []  # seconds into the soak of each churn event (a kill and its replacement's start)

    rng = random.Random(0)
    samples: list[dict] = []  # {"time", "step", "rss": {peer: bytes}}
    kills = 0
    try:
        started = time.time()
        for i in range(args.trainers):
            start(f"trainer{i}")
            born[f"trainer{i}"] = 0.0
        next_sample, next_churn = started, started + args.churn_every
        while trainers["trainer0"].running():
            now = time.time()
            if args.minutes and now - started >= args.minutes * 60:
                break
            if now - started > args.timeout:
                raise TimeoutError(f"the soak did not finish in {args.timeout:.0f} s")
            if now >= next_sample:
                log = read_train_log(workdir / "trainer0")
                rss = {"first_peer": tree_rss(first_peer)}
                rss.update({name: tree_rss(p) for name, p in trainers.items() if p.running()})
                samples.append({"time": now - started, "step": log[-1].step if log else 0, "rss": rss})
                next_sample = now + args.sample_every
            step = max((r.step for r in read_train_log(workdir / "trainer0")[-1:]), default=0)
            if args.churn_every and now >= next_churn and step < max_steps - 3:
                victim = rng.choice([name for name, p in trainers.items() if name != "trainer0" and p.running()])
                trainers[victim].kill()
                kills += 1
                start(f"trainer{args.trainers + kills - 1}")
                born[f"trainer{args.trainers + kills - 1}"] = now - started
                churns.append(now - started)
                print(f"{now - started:6.0f} s, step {step}: churn: killed {victim}", flush=True)
                next_churn = now + args.churn_every
            time.sleep(1)
        if not trainers["trainer0"].running() and trainers["trainer0"].process.returncode != 0:
            raise RuntimeError(trainers["trainer0"].output()[-3000:])
    finally:  # every peer asked to stop at once, then waited for
        for p in trainers.values():
            if p.running():
                p.process.send_signal(signal.SIGINT)
        for p in [*trainers.values(), first_peer]:
            p.stop(timeout=20)
    log = read_train_log(workdir / "trainer0")
    failures = [
        (record.time - started, record.failed_rounds - before)
        for name in trainers
        for before, record in failure_steps(read_train_log(workdir / name))
    ]
    near = sum(n for at, n in failures if any(0 <= at - churn <= args.churn_grace for churn in churns))
    return {
        "trainers": args.trainers,
        "simulated": args.simulated,
        "mode": args.mode if args.simulated else "data-parallel",
        "global_steps": log[-1].step if log else 0,
        "averaging_rounds": (log[-1].step if log else 0) * ROUNDS_PER_STEP,
        "failed_rounds": sum(n for _, n in failures),
        "failed_rounds_near_churn": near,
        "failed_rounds_outside_churn": sum(n for _, n in failures) - near,
        "failures": failures,
        "failed_rounds_trainer0": log[-1].failed_rounds if log else 0,
        "churn_events": kills,
        "churns": churns,
        "born": born,
        "seconds": samples[-1]["time"] if samples else 0.0,
        "samples": samples,
    }


def failure_steps(log: list) -> list[tuple[int, object]]:
    """(failed rounds before, record) for each record of a train log whose failed-round counter grew: a failure's
    time is known to within the step that recorded it."""
    steps, before = [], 0
    for record in log:
        if record.failed_rounds > before:
            steps.append((before, record))
        before = max(before, record.failed_rounds)
    return steps


def growth(result: dict, peer: str, warmup_step: int, warmup_seconds: float = 0.0) -> tuple[float, ...] | None:
    """(RSS after warm-up, RSS at its end, growth) in MiB of a peer: its samples from trainer0's `warmup_step` on
    and at least `warmup_seconds` after the peer started."""
    born = result.get("born", {}).get(peer, 0.0)
    series = [(s["step"], s["time"], s["rss"][peer]) for s in result["samples"] if peer in s["rss"]]
    after = [rss for step, at, rss in series if step >= warmup_step and at - born >= warmup_seconds]
    if len(after) < 2:
        return None
    # the median of the first and of the last three samples: one sample can catch a round's buffers in flight
    start = sorted(after[:3])[len(after[:3]) // 2] / 2**20
    end = sorted(after[-3:])[len(after[-3:]) // 2] / 2**20
    return start, end, end / start - 1


def print_tables(result: dict, args) -> None:
    print(f"\ncommand: python benchmarks/soak.py {' '.join(sys.argv[1:])}\n")
    peers = ["first_peer", "trainer0"]
    print("| seconds | trainer0's step | " + " | ".join(f"{p} RSS MiB" for p in peers) + " | other trainers RSS MiB |")
    print("|---:|---:|" + "---:|" * len(peers) + "---|")
    for s in result["samples"][:: max(1, len(result["samples"]) // 20)] + result["samples"][-1:]:
        others = ", ".join(f"{s['rss'][n] / 2**20:.0f}" for n in s["rss"] if n not in peers)
        cells = " | ".join(f"{s['rss'][p] / 2**20:.0f}" if p in s["rss"] else "-" for p in peers)
        print(f"| {s['time']:.0f} | {s['step']} | {cells} | {others} |")
    warmup_step = args.warmup_rounds // ROUNDS_PER_STEP
    print(
        f"\n{result['global_steps']} global steps ({result['averaging_rounds']} averaging rounds), "
        f"{result['churn_events']} churn events, {result['failed_rounds']} failed rounds in all "
        f"({result['failed_rounds_near_churn']} within {args.churn_grace:.0f} s after a churn event, "
        f"{result['failed_rounds_outside_churn']} outside; {result['failed_rounds_trainer0']} seen by trainer0), "
        f"{result['seconds'] / 60:.1f} min\n"
    )
    print("| peer | started at, s | RSS after warm-up, MiB | RSS at its end, MiB | growth |")
    print("|---|---:|---:|---:|---:|")
    names = sorted({n for s in result["samples"] for n in s["rss"]}, key=lambda n: (n != "first_peer", len(n), n))
    for peer in names:
        grown = growth(result, peer, warmup_step, args.warmup_minutes * 60)
        if grown:
            born = result.get("born", {}).get(peer, 0.0)
            print(f"| {peer} | {born:.0f} | {grown[0]:.0f} | {grown[1]:.0f} | {grown[2]:+.1%} |")


def main(argv=None) -> int:
    stop_on_signals()  # a signal stops the peers this started
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=300, help="averaging rounds trainer0 lives through")
    parser.add_argument("--trainers", type=int, default=3, help="trainers at any time (trainer0 is never killed)")
    parser.add_argument("--churn_every", type=float, default=120.0, help="seconds between churn events (0: none)")
    parser.add_argument("--target_batch_size", type=int, default=128, help="samples per global step")
    parser.add_argument("--sample_every", type=float, default=10.0, help="seconds between RSS samples")
    parser.add_argument("--warmup_rounds", type=int, default=40, help="rounds before growth is measured")
    parser.add_argument("--timeout", type=float, default=5400.0, help="seconds before the soak is abandoned")
    parser.add_argument("--output_json", default=None, help="also write the samples and totals here")
    parser.add_argument("--workdir", default=None, help="keep the peers' logs and outputs here (default: deleted)")
    parser.add_argument("--minutes", type=float, default=None, help="run this long instead of --rounds")
    parser.add_argument("--warmup_minutes", type=float, default=0.0, help="minutes of each peer's life before growth")
    parser.add_argument("--churn_grace", type=float, default=120.0, help="seconds after churn its failures count in")
    simulated = parser.add_argument_group("simulated trainers (benchmarks/scale.py's peers)")
    simulated.add_argument("--simulated", action="store_true", help="declared compute and a payload model")
    simulated.add_argument("--mode", choices=scale.MODES, default="data-parallel", help="their training mode")
    simulated.add_argument("--payload", default="1000000", help="parameters averaged: a preset or N")
    simulated.add_argument("--pass_seconds", type=float, default=2.0, help="declared seconds of one pass")
    simulated.add_argument("--passes_per_step", type=int, default=4, help="each peer's passes per global step")
    simulated.add_argument("--target_group_size", type=int, default=None, help="every peer's --target_group_size")
    args = parser.parse_args(argv)
    if args.minutes:
        args.timeout = max(args.timeout, args.minutes * 60 + 600)
    if args.trainers < 2:
        parser.error("--trainers must be at least 2: churn needs a trainer besides trainer0")
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        try:
            result = soak(args, Path(args.workdir or tmp))
        except (TimeoutError, RuntimeError, KeyboardInterrupt) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    print_tables(result, args)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
