#!/usr/bin/env python
"""DiLoCo against synchronous data parallelism on slow links, side by side: bytes per sample, compute, loss.

Each mode is one run of benchmarks/netswarm.py (network namespaces, every trainer on the --profile link, `slow`: 20/5
Mbit/s) with the same trainers, model and total samples: data parallelism (delayed updates, fp16 gradients and
parameters every global step of --target_batch_size samples) and DiLoCo at each H of --inner_steps (int8
pseudo-gradients once per H inner steps of each trainer). The learning rates are constant after one warm-up step
(--total_steps far away) so that the horizons compare, or with --decay fall linearly to 0 over the run (as a real
run's schedule does over --total_steps): --dp_lr for data parallelism's LAMB (its batch is the swarm's), --inner_lr
for DiLoCo's inner LAMB (its batch is one trainer's pass); DiLoCo's outer learning rate is constant in both. "loss"
is the swarm's mean loss over the last quarter of the samples every mode trained; its ratio to data parallelism's is
the goal's measure. Bytes are every trainer's, from the moment all train to the end ("in training": to the swarm's
last step, without the final parameter round, which sends parameters and optimizer state once per run). "compute
utilization" is forward and backward seconds over wall seconds; "with inner steps" adds DiLoCo's inner optimizer
steps, the rest of a trainer's own work (data parallelism's optimizer steps with the swarm's, once per global step).
With --step_matched_samples, data parallelism whose global step is as large per trainer as a DiLoCo inner step (BATCH
samples) runs too, for fewer samples (its rounds take seconds each on slow links): the bytes goal's baseline ("fp16
gradients and parameters every step" against int8 once per H steps), which the reduction column then divides by. Its
passes are BATCH / trainers samples and its target BATCH: a hivemind trainer counts its own samples toward the
swarm's batch at once and the others' only once it reads them, so each steps after about its own BATCH samples
(with passes of BATCH and a target of trainers x BATCH it stepped after ~2.1 passes, twice a DiLoCo inner step).

    sudo python benchmarks/bench_diloco.py --profile slow --samples 12288 --inner_steps 10 50 200 \
        --plot benchmarks/diloco_curves.svg
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH = 8  # samples per pass (tiny_trainer_flags' --per_device_train_batch_size)
FAR = 1_000_000  # --total_steps: a schedule that stays at its peak over the run


# (H: 0 is data parallelism, --diloco_overlap, --pseudo_gradient_compression, --diloco_fragments)
Mode = tuple[int, bool, str, int]


def mode_name(mode: Mode) -> str:
    inner_steps, overlap, compression, fragments = mode
    if inner_steps == 0:
        return "data parallel"
    kind = "sparse DiLoCo" if compression == "sparse" else "DiLoCo"
    return (
        f"{kind} H={inner_steps}"
        + (f", {fragments} fragments" if fragments > 1 else "")
        + (", overlapped" if overlap else "")
    )


def run_mode(args, mode: Mode, work: Path, matched: bool = False) -> dict:
    """One netswarm run; its JSON result. DiLoCo's --max_steps: outer steps to reach --samples with every trainer's
    H passes of BATCH samples. `matched`: data parallelism with a global step per BATCH samples of each trainer
    (--step_matched_samples of them, at --inner_lr: its batch is the trainers' inner-step batches)."""
    inner_steps, overlap, compression, fragments = mode
    per_pass = max(1, BATCH // args.trainers) if matched else BATCH
    target_batch_size = args.trainers * per_pass if matched else args.target_batch_size
    # the swarm's samples per global step
    if matched:
        per_step = args.trainers * BATCH
    elif inner_steps == 0:
        per_step = target_batch_size
    else:  # a global step is a round: of the whole model, or of one of its fragments every H / F inner steps
        per_step = args.trainers * (inner_steps // fragments) * BATCH
    steps = math.ceil((args.step_matched_samples if matched else args.samples) / per_step)
    output = work / (
        "matched.json" if matched else f"h{inner_steps}{'o' if overlap else ''}{compression}{fragments}.json"
    )
    command = [sys.executable, str(ROOT / "benchmarks" / "netswarm.py"), "--profile", args.profile]
    command += ["--trainers", str(args.trainers), "--max_steps", str(steps), "--model", args.model]
    command += ["--per_device_train_batch_size", str(per_pass)]
    # the schedule counts global steps in data parallelism and inner steps in DiLoCo
    total_steps = steps * max(1, inner_steps // fragments) if args.decay else FAR
    command += ["--target_batch_size", str(target_batch_size), "--total_steps", str(total_steps)]
    command += ["--timeout", str(args.timeout), "--output_json", str(output)]
    if inner_steps:
        command += ["--diloco_inner_steps", str(inner_steps), "--learning_rate", str(args.inner_lr)]
        command += ["--diloco_overlap"] if overlap else []
        command += ["--pseudo_gradient_compression", compression, "--diloco_fragments", str(fragments)]
    else:
        command += ["--learning_rate", str(args.inner_lr if matched else args.dp_lr)]
    print("running:", " ".join(command[1:]), flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        name = "step-matched data parallel" if matched else mode_name(mode)
        raise RuntimeError(f"netswarm failed for {name}: {done.stderr.strip()[-2000:]}")
    return json.loads(output.read_text())


def tail_loss(curve: list[dict], samples: int) -> float:
    """The mean loss of the steps that end within the last quarter of `samples` (by each step's samples)."""
    points, before = [], 0
    for point in curve:
        if 0.75 * samples < point["samples"] <= samples * 1.05:
            points.append((point["loss"], point["samples"] - before))
        before = point["samples"]
    weight = sum(w for _, w in points)
    return sum(loss * w for loss, w in points) / weight if weight else float("nan")


def loss_at(curve: list[dict], samples: float) -> float | None:
    """The loss of the last step that ended at or before `samples` (None before the first)."""
    before = [point["loss"] for point in curve if point["samples"] <= samples]
    return before[-1] if before else None


def curve_table(results: dict[Mode, dict], samples: int, rows: int = 8) -> list[str]:
    """The loss curves as a markdown table: each mode's loss at `rows` equal steps of samples up to `samples`."""
    modes = sorted(results)
    lines = ["| samples | " + " | ".join(mode_name(mode) for mode in modes) + " |"]
    lines.append("|---:|" + "---:|" * len(modes))
    for row in range(1, rows + 1):
        at = samples * row / rows
        losses = [loss_at(results[mode]["curve"], at) for mode in modes]
        cells = " | ".join("" if loss is None else f"{loss:.3f}" for loss in losses)
        lines.append(f"| {at:,.0f} | {cells} |")
    return lines


def svg_plot(results: dict[Mode, dict], path: Path) -> None:
    """The loss curves against samples trained, as a self-contained SVG (no plotting library needed)."""
    width, height, margin = 640, 400, 50
    points = [p for r in results.values() for p in r["curve"]]
    max_samples = max(p["samples"] for p in points)
    low, high = min(p["loss"] for p in points), max(p["loss"] for p in points)
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]

    def xy(point) -> str:
        x = margin + (width - 2 * margin) * point["samples"] / max_samples
        y = height - margin - (height - 2 * margin) * (point["loss"] - low) / max(1e-9, high - low)
        return f"{x:.1f},{y:.1f}"

    lines = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12"><rect width="100%" height="100%" fill="white"/>',
        f'<line x1="{margin}" y1="{height - margin}" x2="{width - margin}" y2="{height - margin}" stroke="black"/>',
        f'<line x1="{margin}" y1="{margin}" x2="{margin}" y2="{height - margin}" stroke="black"/>',
        f'<text x="{width / 2}" y="{height - 15}" text-anchor="middle">samples trained (0 to {max_samples:,})</text>',
        f'<text x="15" y="{height / 2}" transform="rotate(-90 15 {height / 2})" text-anchor="middle">'
        f"loss ({low:.2f} to {high:.2f})</text>",
    ]
    for index, (mode, result) in enumerate(sorted(results.items())):
        # one colour per H and compression; an overlapped run is drawn dashed in its colour
        kinds = sorted({(m[0], m[2], m[3]) for m in results})
        colour = colours[kinds.index((mode[0], mode[2], mode[3])) % len(colours)]
        dash = ' stroke-dasharray="6 4"' if mode[1] else ""
        label = mode_name(mode) + (" (dashed)" if mode[1] else "")
        lines.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="2"{dash} '
            f'points="{" ".join(xy(p) for p in result["curve"])}"/>'
        )
        lines.append(f'<text x="{width - margin - 170}" y="{margin + 16 * index}" fill="{colour}">{label}</text>')
    path.write_text("\n".join([*lines, "</svg>"]) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--profile", default="slow", help="netswarm's link profile of every trainer")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--samples", type=int, default=12288, help="samples every mode trains (the swarm's)")
    parser.add_argument("--target_batch_size", type=int, default=384, help="data parallelism's global batch")
    parser.add_argument("--inner_steps", type=int, nargs="+", default=[10, 50, 200], help="DiLoCo's H values")
    parser.add_argument(
        "--overlap",
        choices=["off", "on", "both"],
        default="off",
        help="DiLoCo's --diloco_overlap: off, on, or both (every H run twice)",
    )
    parser.add_argument(
        "--compressions",
        nargs="+",
        choices=["8bit", "sparse"],
        default=["8bit"],
        help="DiLoCo's --pseudo_gradient_compression: every H runs with each (sparse: SparseLoCo's top-k, 2-bit, "
        "error feedback, at the trainers' default --sparse_density and --outer_lr)",
    )
    parser.add_argument(
        "--fragments",
        type=int,
        default=0,
        help="also run sparse DiLoCo at each H with this many --diloco_fragments (0: not run)",
    )
    parser.add_argument("--dp_lr", type=float, default=0.1, help="data parallelism's LAMB learning rate")
    parser.add_argument("--inner_lr", type=float, default=0.01, help="DiLoCo's inner LAMB learning rate")
    parser.add_argument(
        "--decay",
        action="store_true",
        help="both learning rates fall linearly to 0 over each run (default: constant after one warm-up step)",
    )
    parser.add_argument(
        "--step_matched_samples",
        type=int,
        default=0,
        help="also run data parallelism with a global step per inner step's samples of each trainer (the bytes "
        "goal's baseline) for this many samples (0: not run; its rounds are slow on slow links, so it gets fewer "
        "samples than the others)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per netswarm run")
    parser.add_argument("--output_json", default=None, help="also write every mode's netswarm result here")
    parser.add_argument("--plot", default=None, help="write the loss curves as an SVG image here")
    args = parser.parse_args(argv)
    if args.step_matched_samples < 0:
        parser.error(f"--step_matched_samples must be 0 (not run) or more, got {args.step_matched_samples}")
    overlaps = {"off": [False], "on": [True], "both": [False, True]}[args.overlap]
    modes = [(0, False, "8bit", 1)]
    modes += [(h, overlap, kind, 1) for h in args.inner_steps for overlap in overlaps for kind in args.compressions]
    if args.fragments > 1:
        modes += [(h, overlap, "sparse", args.fragments) for h in args.inner_steps for overlap in overlaps]
    results: dict[Mode, dict] = {}
    matched = None
    with tempfile.TemporaryDirectory(prefix="bench-diloco-") as tmp:
        try:
            for mode in modes:
                results[mode] = run_mode(args, mode, Path(tmp))
            if args.step_matched_samples:
                matched = run_mode(args, (0, False, "8bit", 1), Path(tmp), matched=True)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    common = min(r["curve"][-1]["samples"] for r in results.values())
    dp = results[(0, False, "8bit", 1)]
    dp_loss = tail_loss(dp["curve"], common)
    print(f"\n    sudo python benchmarks/bench_diloco.py {' '.join(argv if argv is not None else sys.argv[1:])}\n")
    print(
        f"profile {args.profile}, {args.trainers} trainers, model {args.model}; loss over the last quarter of "
        f"{common:,} samples; first logged loss (data parallel) {dp['curve'][0]['loss']:.3f}\n"
    )
    # bytes in training (to the last step, without the final round) against the baseline's: step-matched data
    # parallelism when it ran, else the default data parallelism
    base = matched if matched is not None else dp
    print(
        "| mode | outer/global steps | samples per trainer per step | bytes sent per sample | in training | vs "
        f"{'step-matched ' if matched is not None else ''}data parallel (in training) | compute utilization | "
        "with inner steps | most bytes in one round (a trainer's) | failed rounds | loss | vs data parallel | "
        "parameters agree |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    codec = {"8bit": " (int8)", "sparse": " (top-k, 2-bit)"}
    rows = [(mode_name(m) + (" (DPU, fp16)" if m[0] == 0 else codec[m[2]]), r) for m, r in sorted(results.items())]
    if matched is not None:
        rows.insert(0, ("step-matched data parallel (DPU, fp16)", matched))
    for name, result in rows:
        # a DiLoCo step is an outer step: H inner steps of each trainer
        per_step = result["curve"][-1]["samples"] / max(1, result["global_steps"]) / args.trainers
        if result is matched:  # its loss over the last quarter of its own (fewer) samples
            samples = matched["curve"][-1]["samples"]
            loss_cells = f"{tail_loss(result['curve'], samples):.3f} (at {samples:,} samples) | |"
        else:
            loss = tail_loss(result["curve"], common)
            loss_cells = f"{loss:.3f} | {loss / dp_loss - 1:+.1%} |"
        reduction = base["bytes_per_sample_training"] / max(1e-9, result["bytes_per_sample_training"])
        print(
            f"| {name} | {result['global_steps']} | {per_step:,.1f} | {result['bytes_per_sample']:,.0f} | "
            f"{result['bytes_per_sample_training']:,.0f} | "
            f"{'1x' if result is base else f'{reduction:,.0f}x less'} | {result['compute_utilization']:.1%} | "
            f"{result['training_utilization']:.1%} | {result['max_round_bytes']:,.0f} | {result['failed_rounds']} | "
            f"{loss_cells} "
            f"{'yes' if result['parameters_agree'] else 'NO'} |"
        )
    print("\nloss curves (the last step's loss at each point; every step below and in --plot):\n")
    print("\n".join(curve_table(results, common)))
    print("\ncurves (samples: loss):")
    for mode, result in sorted(results.items()):
        name = mode_name(mode)
        points = ", ".join(f"{p['samples']}: {p['loss']:.3f}" for p in result["curve"])
        print(f"  {name}: {points}")
    if args.plot:
        svg_plot(results, Path(args.plot))
        print(f"\nplot: {args.plot}")
    if args.output_json:
        everything = {mode_name(k): v for k, v in results.items()}
        if matched is not None:
            everything["step-matched data parallel"] = matched
        Path(args.output_json).write_text(json.dumps(everything, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
