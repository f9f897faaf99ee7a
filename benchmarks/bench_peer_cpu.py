#!/usr/bin/env python
"""The CPU a training swarm's own processes use, by kind, with this project's paced DHT traffic and with hivemind's
(benchmarks/unpaced.py), side by side in one run.

A local swarm on 127.0.0.1 (a first peer and --trainers tiny trainers, as `make demo` runs them) trains; once every
trainer has made --warmup_steps global steps, the CPU time of each of their processes is measured over --window
seconds, with the global steps made meanwhile. The tiny model's own compute is small, so what remains is the
swarm's overhead, which a volunteer's machine pays beside its training at any model size.

    python benchmarks/bench_peer_cpu.py [--trainers 2] [--window 30] [--output_json FILE]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil

from sahajbert.localswarm import PeerProcess, start_first_peer, tiny_trainer_flags, wait_for
from sahajbert.train_log import read_train_log

REPO = Path(__file__).resolve().parents[1]
MODES = {"hivemind's (unpaced)": [str(REPO / "benchmarks" / "unpaced.py")], "paced (ours)": []}
KINDS = ("trainer main", "DHT process", "p2pd daemon", "averagers", "first peer (all)")


def kind_of(process: psutil.Process, trainer_pid: int | None) -> str:
    if trainer_pid is None:
        return "first peer (all)"
    if process.pid == trainer_pid:
        return "trainer main"
    if process.name() == "p2pd":
        return "p2pd daemon"
    if any(child.name() == "p2pd" for child in process.children()):
        return "DHT process"
    return "averagers"


def cpu_seconds(peers: list[tuple[PeerProcess, bool]]) -> dict[int, tuple[str, float]]:
    """pid -> (kind, user + system seconds so far) of every process of the peers (`True`: a trainer)."""
    seen = {}
    for peer, trainer in peers:
        for process in [psutil.Process(peer.process.pid), *peer.descendants()]:
            try:
                times = process.cpu_times()
                seen[process.pid] = (
                    kind_of(process, peer.process.pid if trainer else None),
                    times.user + times.system,
                )
            except psutil.NoSuchProcess:
                continue
    return seen


def measure(mode: str, args, work: Path) -> dict:
    first, initial_peers = start_first_peer(REPO / "run_first_peer.py", work, "cpu")
    trainers = []
    try:
        for i in range(args.trainers):
            flags = tiny_trainer_flags(max_steps=100_000, output_dir=work / f"trainer{i}", save_steps=100_000)
            flags += ["--run_id", "cpu", "--initial_peers", *initial_peers]
            script = [*MODES[mode], str(REPO / "run_trainer.py")]
            trainers.append(PeerProcess(script[0], [*script[1:], *flags], work / f"trainer{i}.log"))

        def steps() -> list[int]:
            return [len(read_train_log(work / f"trainer{i}")) for i in range(args.trainers)]

        wait_for(lambda: min(steps()) >= args.warmup_steps, 600, f"{args.warmup_steps} global steps of every trainer")
        peers = [(first, False), *((t, True) for t in trainers)]
        before, steps_before, began = cpu_seconds(peers), steps(), time.monotonic()
        time.sleep(args.window)  # the measurement window itself
        after, steps_after, seconds = cpu_seconds(peers), steps(), time.monotonic() - began
    finally:
        for peer in [*trainers, first]:
            peer.stop()
    cores = {kind: 0.0 for kind in KINDS}
    for pid, (kind, used) in after.items():
        cores[kind] += (used - before.get(pid, (kind, 0.0))[1]) / seconds
    made = min(b - a for a, b in zip(steps_before, steps_after))
    return {"cores": cores, "total": sum(cores.values()), "steps_per_minute": 60 * made / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--warmup_steps", type=int, default=2)
    parser.add_argument("--window", type=float, default=30.0, help="seconds measured")
    parser.add_argument("--output_json", type=Path)
    args = parser.parse_args()
    results = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory() as work:
            results[mode] = measure(mode, args, Path(work))
    print(f"`python benchmarks/bench_peer_cpu.py {' '.join(sys.argv[1:])}`".replace(" `", "`"))
    print(f"\n{args.trainers} tiny trainers and a first peer on 127.0.0.1; CPU cores used over {args.window:.0f} s\n")
    print("| process | " + " | ".join(MODES) + " |")
    print("|---|" + "---:|" * len(MODES))
    for kind in KINDS:
        print(f"| {kind} | " + " | ".join(f"{results[m]['cores'][kind]:.2f}" for m in MODES) + " |")
    print("| **all** | " + " | ".join(f"**{results[m]['total']:.2f}**" for m in MODES) + " |")
    print("| global steps per minute | " + " | ".join(f"{results[m]['steps_per_minute']:.1f}" for m in MODES) + " |")
    if args.output_json:
        args.output_json.write_text(json.dumps({"args": vars(args) | {"output_json": None}, "results": results}))


if __name__ == "__main__":
    main()
