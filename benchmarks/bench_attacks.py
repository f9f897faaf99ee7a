#!/usr/bin/env python
"""One misbehaving peer against honest trainers, attack by attack, with and without the defence: a robustness table.

Each scenario is its own swarm on 127.0.0.1: a first peer, --honest trainers (tiny model, the same identities and so
the same data order in every scenario) and --attackers peers of `tests/attacker.py` (the trainer's own code, speaking
the protocol, with corrupted gradients, averages or progress claims) that attack from the first step all peers are
in. A clean scenario (honest trainers alone) comes first; every other row compares the honest trainers' loss over
the last two global steps with it. A scenario whose honest trainers do not finish within --timeout is "stalled".

    python benchmarks/bench_attacks.py --attacks nan scaled sign_flipped bad_reducer progress \
        --aggregation centered_clip plain
"""

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from sahajbert.localswarm import PeerProcess, start_first_peer, tiny_trainer_flags
from sahajbert.train_log import read_train_log

ROOT = Path(__file__).resolve().parents[1]
# what tests/attacker.py is told for each attack: it attacks once the swarm has all its peers
PLANS = {
    "nan": "nan",
    "scaled": "scaled",
    "sign_flipped": "sign_flipped",
    "bad_reducer": "bad_reducer",
    "progress": "honest+progress",
}
# evidence in the honest trainers' logs that the defence met the attacker ({id}: the attacker's peer id)
CAUGHT = (
    "dropped the non-finite or misshapen contribution of {id}",
    "bounded the outlying contribution of {id}",
    "from peer {id}",
    "peer {id} is left out",
)


def trainer_flags(run_id: str, initial_peers: list[str], steps: int, output_dir: Path, aggregation: str) -> list[str]:
    flags = tiny_trainer_flags(max_steps=steps, target_batch_size=96, final_averaging_window=20)
    # every peer declares one link, so each reduces an equal share of a round: hivemind shares the parts out by
    # declared bandwidth, and on loopback the slowest measured link (an attacker's, 1,107 Mbit/s against 2,579 and
    # 2,685 in a test run) could get none, and a bad_reducer attack then never ran
    flags += ["--bandwidth", "1000"]
    return ["--run_id", run_id, "--initial_peers", *initial_peers, "--aggregation", aggregation, *flags] + [
        "--output_dir",
        str(output_dir),
    ]


def last_steps_loss(output_dirs: list[Path], steps: int) -> float | None:
    """The honest trainers' mean loss per mini-step over the last two global steps (None: they did not get there)."""
    records = [r for d in output_dirs for r in read_train_log(d) if r.step in (steps - 1, steps)]
    passes = sum(r.mini_steps for r in records)
    return sum(r.loss * r.mini_steps for r in records) / passes if passes else None


def scenario(work: Path, attack: str, aggregation: str, args, initial_peers: list[str]) -> dict:
    run_id = f"{attack}-{aggregation}"
    folder = work / run_id
    peers = args.honest + (0 if attack == "clean" else args.attackers)
    attackers = []
    if attack != "clean":
        plan = f"{peers}@{PLANS[attack]}"
        for i in range(args.attackers):
            # the attacker's own rule is always a robust one: its lying reducer wraps robust.aggregate, which
            # hivemind's plain reducer never calls
            flags = trainer_flags(run_id, initial_peers, args.steps, folder / f"attacker{i}", "centered_clip")
            attackers.append(PeerProcess(ROOT / "tests" / "attacker.py", [plan, *flags], folder / f"attacker{i}.log"))
    honest = []
    for i in range(args.honest):
        flags = trainer_flags(run_id, initial_peers, args.steps, folder / f"h{i}", aggregation)
        flags += ["--identity_path", str(work / f"h{i}.key")]
        honest.append(PeerProcess(ROOT / "run_trainer.py", flags, folder / f"h{i}.log"))
    started, stalled = time.monotonic(), False
    try:
        for peer in honest:
            left = args.timeout - (time.monotonic() - started)
            try:
                peer.wait(max(left, 1))
            except TimeoutError:
                stalled = True
                break
    finally:
        for peer in honest + attackers:
            peer.stop()
    outputs = "\n".join(peer.output() for peer in honest)
    ids = [re.search(r"attacker peer id (\S+)", a.output()) for a in attackers]
    caught = sum(outputs.count(line.format(id=m.group(1))) for m in ids if m for line in CAUGHT)
    dirs = [folder / f"h{i}" for i in range(args.honest)]
    reached = min((read_train_log(d)[-1].step if read_train_log(d) else 0) for d in dirs)
    return {
        "attack": attack,
        "aggregation": aggregation,
        "peers": f"{len(attackers)} of {peers}",
        "loss": None if stalled else last_steps_loss(dirs, args.steps),
        "rollbacks": outputs.count("rolling back to the last good state"),
        "dropped": len(re.findall(r"this batch is dropped", outputs)),
        "steps": reached,
        "caught": caught,
        "seconds": time.monotonic() - started,
        "stalled": stalled,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", nargs="+", default=list(PLANS), choices=list(PLANS))
    parser.add_argument("--aggregation", nargs="+", default=["centered_clip"], help="the honest trainers' rules")
    parser.add_argument("--honest", type=int, default=2)
    parser.add_argument("--attackers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=7, help="--max_steps of every trainer")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a scenario may run")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_attacks."))
    rows = []
    scenarios = [("clean", args.aggregation[0])] + [(a, g) for a in args.attacks for g in args.aggregation]
    for attack, aggregation in scenarios:
        # each scenario its own swarm: its own first peer and run id
        run_id = f"{attack}-{aggregation}"
        first, initial_peers = start_first_peer(ROOT / "run_first_peer.py", work / run_id, run_id)
        try:
            rows.append(scenario(work, attack, aggregation, args, initial_peers))
        finally:
            first.stop()
        print(rows[-1], file=sys.stderr, flush=True)
    clean = rows[0]["loss"]
    print(
        f"command: python benchmarks/bench_attacks.py --attacks {' '.join(args.attacks)} --aggregation "
        f"{' '.join(args.aggregation)} --honest {args.honest} --attackers {args.attackers} --steps {args.steps}\n"
    )
    print(
        "| attack | attackers | honest trainers' rule | loss, last 2 steps | vs clean | rollbacks | dropped batches "
        "| global steps | defence log lines | seconds |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        loss = "stalled" if row["stalled"] else ("-" if row["loss"] is None else f"{row['loss']:.3f}")
        versus = f"{100 * (row['loss'] / clean - 1):+.1f}%" if row["loss"] is not None and clean else "-"
        print(
            f"| {row['attack']} | {row['peers']} | {row['aggregation']} | {loss} | {versus} | {row['rollbacks']} "
            f"| {row['dropped']} | {row['steps']} of {args.steps} | {row['caught']} | {row['seconds']:.0f} |"
        )
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
