#!/usr/bin/env python
"""Plan a run: seconds per global step and days to N steps for a swarm of hardware kinds on link profiles.

    python benchmarks/plan_run.py --swarm 40xT4@broadband,16xT4@cloud --model sahajbert --steps 10000
    python benchmarks/plan_run.py --preset sahajbert-2021
    python benchmarks/plan_run.py --calibrate a.json b.json --validate c.json d.json   (netswarm --output_json)

The model, one global step:

    seconds per step = compute + overhead + per_peer * (peers - 1) + per_client * client_peers
                       + butterfly / efficiency

- compute: the target batch over the swarm's summed samples/s;
- butterfly: the slowest peer's seconds to move its share of one gradient and one parameter all-reduce, shares in
  proportion to the declared bandwidth as hivemind's load balancing assigns them (client-mode peers reduce no part);
- per_peer, per_client: the protocol's seconds per step for each further peer (DHT progress reports, matchmaking,
  the all-reduce's messages) and for each client-mode peer (it reaches others only through their connections);
- overhead, per_peer, per_client and efficiency are fitted on netswarm runs (`--calibrate`) and checked on runs
  they were not fitted on (`--validate`); CALIBRATED holds the values benchmarks/README.md reports. In those runs
  neither the round trip (1 to 150 ms) nor matchmaking's planned time changed the step time measurably, and
  delayed parameter updates hid no measurable part of the communication behind compute: the sum fits, a maximum
  did not (48% off on the heterogeneous run).

Compute rates are samples/s per device for each preset (HARDWARE): measure yours (run_trainer.py logs its samples/s)
and pass --rate KIND=SAMPLES_PER_S; the defaults are estimates, labelled as such.
"""

import argparse
import itertools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from sahajbert.adaptive import payload_bytes

# fitted by: python benchmarks/plan_run.py --calibrate <the runs in benchmarks/README.md, "Planning a run">
CALIBRATED = {"overhead": 0.0, "per_peer": 2.75, "per_client": 2.25, "efficiency": 1.0}
# the protocol's terms fitted instead on benchmarks/scale.py's data-parallel swarms of 4, 8 and 16 trainers (loopback,
# benchmarks/README.md "Many peers"): per further peer it costs far less than the 2-3 trainer runs above suggest
SCALE_FITTED = {**CALIBRATED, "overhead": 2.74, "per_peer": 0.164}


@dataclass(frozen=True)
class Link:
    down_mbit: float
    up_mbit: float
    round_trip_ms: float  # to a well-connected peer (not in the step model: see above)


LINKS = {
    "broadband": Link(100, 20, 50),  # netswarm's volunteers at home
    "slow": Link(20, 5, 100),
    "cloud": Link(1000, 1000, 20),  # a preemptible cloud GPU
    "datacenter": Link(1000, 1000, 1),
}
# benchmarks/scale.py's peers: one machine's loopback, whose bytes cost CPU more than time (its all-reduces of a
# 1M-parameter payload took ~0.05 s)
LOOPBACK = Link(10_000, 10_000, 0.1)

# samples/s of forward + backward per device, fp16 on GPUs; ESTIMATES for sequence 512 (sahajBERT: ALBERT-large
# shape, 24 shared layers; XL: hidden 2048), from each device's dense fp16 throughput at about 30% utilization:
# measure and override with --rate
HARDWARE = {
    "sahajbert": {"T4": 7.0, "P100": 6.0, "V100": 20.0, "A100": 55.0, "TPUv3-8": 60.0},
    "sahajbert-xl": {"T4": 1.8, "P100": 1.5, "V100": 5.0, "A100": 14.0, "TPUv3-8": 15.0},
}
TARGET_BATCH = {"sahajbert": 4096, "sahajbert-xl": 16384}
PARAMETERS = {"sahajbert": 18_000_000, "sahajbert-xl": 58_000_000}  # with the 32,000-piece vocabulary

PRESETS = {
    # the 2021 run (HF blog "collaborative-training"): 40 volunteers on T4/P100/V100 and 16 preemptible T4s
    "sahajbert-2021": ("sahajbert", "20xT4@broadband,12xP100@broadband,8xV100@broadband,16xT4@cloud"),
    "sahajbert-xl-2021": ("sahajbert-xl", "8xV100@broadband,2xTPUv3-8@cloud,4xT4@broadband"),
}


@dataclass(frozen=True)
class Peer:
    rate: float  # samples/s
    up_mbit: float
    down_mbit: float
    round_trip_ms: float
    client: bool = False


def butterfly_seconds(peers: list[Peer], payload: float) -> float:
    """The slowest peer's seconds for one bandwidth-balanced butterfly all-reduce of `payload` bytes."""
    reducers = [p for p in peers if not p.client]
    if len(peers) < 2 or not reducers:
        return 0.0
    total = sum(min(p.up_mbit, p.down_mbit) for p in reducers)
    slowest = 0.0
    for p in peers:
        share = 0.0 if p.client else min(p.up_mbit, p.down_mbit) / total
        # out: its parts of the others' shares, then its averaged share to each other peer; in: the mirror image
        sent = payload * (1 - share) + (len(peers) - 1) * share * payload
        slowest = max(slowest, sent * 8 / (p.up_mbit * 1e6), sent * 8 / (p.down_mbit * 1e6))
    return slowest


def growth(peers: int, form: str) -> float:
    """How the protocol's seconds per step grow with the swarm: "linear" (one term per further peer) or "log2"."""
    return math.log2(peers) if form == "log2" else float(peers - 1)


def step_seconds(
    peers: list[Peer],
    parameters: int,
    target_batch: int,
    constants: dict,
    compression: str = "fp16",
    mode: str = "data-parallel",
):
    """(seconds per global step, compute part, communication part) for this swarm. DiLoCo ("diloco"): a global step
    is an outer step (the target batch: every peer's inner steps), with one 8-bit pseudo-gradient all-reduce."""
    compute = target_batch / sum(p.rate for p in peers)
    gradient_bytes, state_bytes = payload_bytes(parameters, "8bit" if mode == "diloco" else compression)
    moving = butterfly_seconds(peers, gradient_bytes) + (
        0.0 if mode == "diloco" else butterfly_seconds(peers, state_bytes)
    )
    communication = (
        constants["overhead"]
        + constants["per_peer"] * growth(len(peers), constants.get("growth", "linear"))
        + constants["per_client"] * sum(p.client for p in peers)
        + moving / constants["efficiency"]
    )
    return compute + communication, compute, communication


def parse_swarm(spec: str, model: str, rates: dict) -> list[Peer]:
    peers = []
    for item in spec.split(","):
        try:
            count, rest = item.strip().split("x", 1)
            kind, link_name = rest.split("@", 1)
            client = link_name.endswith(":client")
            link = LINKS[link_name.removesuffix(":client")]
            rate = rates.get(kind, HARDWARE.get(model, {}).get(kind))
            if rate is None:
                raise KeyError(kind)
        except (ValueError, KeyError) as e:
            raise SystemExit(
                f"error: --swarm item '{item}': expected COUNTxKIND@LINK[:client] with KIND in "
                f"{sorted(HARDWARE.get(model, {}))} (or given by --rate) and LINK in {sorted(LINKS)} ({e})"
            ) from None
        peers += [Peer(rate, link.up_mbit, link.down_mbit, link.round_trip_ms, client)] * int(count)
    return peers


def peers_of_run(result: dict) -> list[Peer]:
    """The trainers of a netswarm run (its --output_json) or a benchmarks/scale.py run, as the planner sees them."""
    if "trainer_links" not in result:  # scale.py: N alike trainers on loopback
        rate = result["samples_per_pass"] / result["pass_seconds"]
        return [Peer(rate, LOOPBACK.up_mbit, LOOPBACK.down_mbit, LOOPBACK.round_trip_ms)] * result["peers"]
    return [
        Peer(t["samples_per_compute_second"], t["up_mbit"], t["down_mbit"], 2 * t["one_way_ms"], t["client"])
        for t in result["trainer_links"].values()
    ]


def predict_run(result: dict, constants: dict) -> float:
    peers = peers_of_run(result)
    mode = result.get("mode", "diloco" if result.get("diloco_inner_steps") else "data-parallel")
    parameters = result.get("parameters", result.get("payload_parameters"))
    return step_seconds(peers, parameters, result["target_batch_size"], constants, result["compression"], mode)[0]


def fit_protocol(results: list[dict], form: str) -> dict:
    """The protocol's constants (overhead, per_peer, with `form` of growth) by least squares on the seconds per step
    that neither compute nor moving the bytes explains; both at least 0."""
    base = {"overhead": 0.0, "per_peer": 0.0, "per_client": 0.0, "efficiency": 1.0, "growth": form}
    points = [(growth(len(peers_of_run(r)), form), r["seconds_per_step"] - predict_run(r, base)) for r in results]
    xs, ys = [x for x, _ in points], [y for _, y in points]
    x_mean, y_mean = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - x_mean) ** 2 for x in xs)
    slope = max(0.0, sum((x - x_mean) * (y - y_mean) for x, y in points) / spread) if spread else 0.0
    intercept = y_mean - slope * x_mean
    if intercept < 0:  # through the origin instead
        intercept, slope = 0.0, max(0.0, sum(x * y for x, y in points) / max(1e-12, sum(x * x for x in xs)))
    return {**base, "overhead": intercept, "per_peer": slope}


def hold_out(results: list[dict], form: str = "linear") -> list[dict]:
    """Per mode of benchmarks/scale.py runs: the protocol fitted on every swarm size but the largest, and its
    prediction for the largest, held out (what the planner's scale-up is checked on)."""
    checks = []
    for mode in sorted({r["mode"] for r in results}):
        runs = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["peers"])
        if len({r["peers"] for r in runs}) < 3:
            continue  # two sizes to fit at least, one to hold out
        held_out = runs[-1]
        constants = fit_protocol([r for r in runs if r["peers"] < held_out["peers"]], form)
        predicted = predict_run(held_out, constants)
        checks.append(
            {
                "held_out_peers": held_out["peers"],
                "mode": mode,
                "fitted_on_peers": [r["peers"] for r in runs if r["peers"] < held_out["peers"]],
                "constants": constants,
                "predicted_seconds_per_step": predicted,
                "measured_seconds_per_step": held_out["seconds_per_step"],
                "error": predicted / held_out["seconds_per_step"] - 1,
            }
        )
    return checks


def fit(results: list[dict]) -> dict:
    """Grid search for the constants with the least mean squared relative error over `results`."""
    best, best_error = None, float("inf")
    for overhead, per_peer, per_client, efficiency in itertools.product(
        [x / 4 for x in range(0, 25)],  # overhead, s
        [x / 4 for x in range(0, 25)],  # s per further peer
        [x / 4 for x in range(0, 21)],  # s per client-mode peer
        [x / 20 for x in range(2, 21)],  # efficiency: the share of the shaped bandwidth a round gets
    ):
        constants = {"overhead": overhead, "per_peer": per_peer, "per_client": per_client, "efficiency": efficiency}
        error = sum((predict_run(r, constants) / r["seconds_per_step"] - 1) ** 2 for r in results) / len(results)
        if error < best_error:
            best, best_error = constants, error
    return best


def load(paths: list[str]) -> list[dict]:
    runs = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        for run in data if isinstance(data, list) else [data]:
            run["source"] = Path(path).name
            runs.append(run)
    return runs


def describe(run: dict) -> str:
    links = sorted({f"{t['up_mbit']:g}/{t['down_mbit']:g}" for t in run["trainer_links"].values()})
    return f"{run['source']}: {run['model']}, {len(run['trainer_links'])} trainers, up/down {', '.join(links)} Mbit/s"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--swarm", help="COUNTxKIND@LINK[:client],... e.g. 40xT4@broadband,16xT4@cloud")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a swarm of the 2021 runs")
    parser.add_argument("--model", default="sahajbert", choices=sorted(HARDWARE))
    parser.add_argument("--target_batch_size", type=int, default=None, help="default: the model's recipe")
    parser.add_argument("--steps", type=int, default=10_000, help="global steps to plan for")
    parser.add_argument("--rate", action="append", default=[], help="KIND=SAMPLES_PER_S, measured on your device")
    parser.add_argument("--calibrate", nargs="+", help="netswarm --output_json files to fit the constants on")
    parser.add_argument("--validate", nargs="+", help="netswarm --output_json files to check the constants on")
    args = parser.parse_args(argv)
    print(f"command: python benchmarks/plan_run.py {' '.join(sys.argv[1:] if argv is None else argv)}\n")
    constants = dict(CALIBRATED)
    if args.calibrate:
        constants = fit(load(args.calibrate))
        print(f"fitted: {constants}\n")
    if args.calibrate or args.validate:
        print("| run | role | measured s/step | predicted s/step | error |\n|---|---|---:|---:|---:|")
        for role, paths in (("calibration", args.calibrate or []), ("validation", args.validate or [])):
            for run in load(paths):
                predicted, measured = predict_run(run, constants), run["seconds_per_step"]
                error = predicted / measured - 1
                print(f"| {describe(run)} | {role} | {measured:.2f} | {predicted:.2f} | {error:+.1%} |")
        return 0
    if args.preset:
        args.model, args.swarm = PRESETS[args.preset]
    if not args.swarm:
        parser.error("give --swarm, --preset, or --calibrate/--validate")
    try:
        rates = {kind: float(value) for kind, value in (item.split("=", 1) for item in args.rate)}
    except ValueError:
        parser.error("--rate takes KIND=SAMPLES_PER_S, e.g. --rate T4=6.5")
    peers = parse_swarm(args.swarm, args.model, rates)
    batch = args.target_batch_size or TARGET_BATCH[args.model]
    seconds, compute, communication = step_seconds(peers, PARAMETERS[args.model], batch, constants)
    print(f"| swarm | {args.swarm} ({len(peers)} peers) |\n|---|---:|")
    print(f"| model, target batch | {args.model}, {batch} samples |")
    print(f"| compute per step (summed rate {sum(p.rate for p in peers):.0f} samples/s) | {compute:.1f} s |")
    print(f"| protocol and all-reduce per step | {communication:.1f} s |")
    print(f"| seconds per global step | {seconds:.1f} |")
    print(f"| days to {args.steps:,} steps | {seconds * args.steps / 86400:.1f} |")
    if not args.calibrate:  # the same swarm with the protocol's terms measured on larger swarms
        scaled = step_seconds(peers, PARAMETERS[args.model], batch, SCALE_FITTED)[0]
        print(f"| seconds per global step, protocol fitted on 4-16 peers (benchmarks/scale.py) | {scaled:.1f} |")
        print(f"| days to {args.steps:,} steps, so fitted | {scaled * args.steps / 86400:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
