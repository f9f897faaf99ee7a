#!/usr/bin/env python
"""What the robust reducer costs next to hivemind's plain mean, side by side in one run on this machine.

One all-reduce part is what a reducer combines at a time: with hivemind's default part size (2^19 values: 2 MB in
fp32) and a group of N peers, a reducer combines N contributions per part. For each rule this times
`sahajbert.robust.aggregate` on the same contributions (the median of --repeats runs) and prints the ratio to the
plain mean, and the deviation from the honest mean when one contribution is an attack (NaN, x1e4, sign flip).

    python benchmarks/bench_robust.py --peers 4 8 16 --values 524288
"""

import argparse
import statistics
import time

import torch

from sahajbert.robust import Aggregation, aggregate


def contributions(peers: int, values: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    signal = torch.randn(values, generator=generator)
    return [signal + 0.5 * torch.randn(values, generator=generator) for _ in range(peers)]


def seconds(parts, weights, how: Aggregation, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        aggregate(parts, weights, how)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--values", type=int, default=2**19, help="values per part (hivemind's default: 2^19)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a reducer shares the CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rules = [Aggregation("plain"), Aggregation("norm_clip"), Aggregation("centered_clip")]

    print(
        f"command: python benchmarks/bench_robust.py --peers {' '.join(map(str, args.peers))} "
        f"--values {args.values} --repeats {args.repeats} --threads {args.threads}\n"
    )
    print("| peers | " + " | ".join(f"{r.rule} ms" for r in rules) + " | norm_clip / plain | centered_clip / plain |")
    print("|---:|" + "---:|" * (len(rules) + 2))
    for peers in args.peers:
        parts = contributions(peers, args.values)
        weights = [1.0] * peers
        times = [seconds(parts, weights, rule, args.repeats) for rule in rules]
        print(
            f"| {peers} | "
            + " | ".join(f"{t * 1000:.1f}" for t in times)
            + f" | {times[1] / times[0]:.1f}x | {times[2] / times[0]:.1f}x |"
        )

    print("\none attacker among the peers: distance of the result from the honest mean, over the honest mean's norm\n")
    print("| attack | peers | " + " | ".join(r.rule for r in rules) + " |")
    print("|---|---:|" + "---:|" * len(rules))
    for peers in args.peers:
        parts = contributions(peers, min(args.values, 2**16))
        honest = torch.stack(parts[1:]).mean(0)
        for attack, bad in (
            ("nan", torch.full_like(honest, float("nan"))),
            ("x1e4", 1e4 * parts[0]),
            ("sign flip", -parts[0]),
        ):
            row = []
            for rule in rules:
                # the reducer is honest peer 1 (with two peers it holds one of the two contributions)
                result = aggregate([bad, *parts[1:]], [1.0] * peers, rule, own=1).tensor
                error = float((result - honest).norm() / honest.norm())
                row.append("nan" if error != error else f"{error:.3g}")
            print(f"| {attack} | {peers} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
