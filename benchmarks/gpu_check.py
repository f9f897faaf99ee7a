#!/usr/bin/env python
"""The GPU check: the paths only a CUDA machine runs, in one prepared run of a few minutes that prints one table.

    make gpu-check                      # on a CUDA machine: builds .venv with PyPI's CUDA torch, then runs this
    python benchmarks/gpu_check.py      # in an environment with the requirements and this package (pip install -e
                                        # ., or PYTHONPATH=<this checkout>)

1. the device: torch's CUDA build, the GPU, its compute capability and memory;
2. fp16: two trainers of the tiny model share the GPU, in fp16 (hivemind's GradScaler) with --clip_gradients local,
   make --max_steps global steps together and end with the same parameters;
3. DiLoCo in bf16 (fp32 on a GPU older than Ampere): two trainers, --diloco_inner_steps, the same (DiLoCo takes no
   fp16 loss scaler);
4. the overhead: benchmarks/bench_overhead.py on the GPU (sahajbert and sahajbert-xl at sequence 512, data parallel
   in fp16 and DiLoCo in the precision of check 3), a trainer alone against a plain loop, host and GPU memory.

`--device cpu` runs the same checks on the CPU, in fp32 where the GPU runs fp16 (fp16 needs CUDA) and with the tiny
model in step 4: the test suite runs it so (`make test-scale`), so that the script works the day a GPU is at hand.
Exit status 0 when every check passed.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# a swarm check's global steps, and its trainers' batch: small, so that both checks take a minute or two
SWARM_STEPS = 3
SWARM_BATCH = 64
DILOCO_INNER_STEPS = 4


def device_row(device: str) -> tuple[bool, str]:
    import torch

    if device == "cpu":
        return True, f"torch {torch.__version__}, CPU (the checks a GPU runs in fp16 run in fp32)"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA GPU (CUDA build: {torch.version.cuda})"
    props = torch.cuda.get_device_properties(0)
    return True, (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), {props.name}, compute capability "
        f"{props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB"
    )


def swarm_row(workdir: Path, name: str, device: str, precision: str, extra: dict, timeout: float) -> tuple[bool, str]:
    """Two trainers of the tiny model on this machine's device: both reach the last step and agree."""
    from sahajbert.checkpoints import latest_checkpoint
    from sahajbert.localswarm import PeerProcess, checkpoints_agree, start_first_peer, tiny_trainer_flags
    from sahajbert.train_log import read_train_log

    folder = workdir / name
    shutil.rmtree(folder, ignore_errors=True)
    first, initial_peers = start_first_peer(REPO / "run_first_peer.py", folder, name)
    trainers = []
    try:
        for i in range(2):
            flags = tiny_trainer_flags(
                device=device,
                precision=precision,
                target_batch_size=SWARM_BATCH,
                max_steps=SWARM_STEPS,
                save_steps=SWARM_STEPS,
                output_dir=folder / f"trainer{i}",
                **extra,
            )
            args = ["--run_id", name, "--initial_peers", *initial_peers, *flags]
            trainers.append(PeerProcess(REPO / "run_trainer.py", args, folder / f"trainer{i}.log"))
        deadline = time.monotonic() + timeout
        for i, trainer in enumerate(trainers):
            if trainer.wait(max(1.0, deadline - time.monotonic())) != 0:
                return False, f"trainer {i} failed: " + " | ".join(trainer.output().strip().splitlines()[-3:])
    finally:
        for process in [*trainers, first]:
            process.stop()
    logs = [read_train_log(folder / f"trainer{i}") for i in range(2)]
    steps = [log[-1].step if log else 0 for log in logs]
    agree, difference = checkpoints_agree([latest_checkpoint(folder / f"trainer{i}") for i in range(2)])
    losses = [log[-1].loss for log in logs if log]
    passed = steps == [SWARM_STEPS] * 2 and agree and all(loss == loss for loss in losses)  # (NaN != NaN)
    return passed, (
        f"steps {steps}, last loss {', '.join(f'{loss:.3f}' for loss in losses)}, parameters "
        f"{'agree' if agree else 'differ'} (max difference {difference:.1e})"
    )


def diloco_precision(device: str) -> str:
    """bf16 where the device computes in it (the CPU, CUDA from Ampere on), else fp32."""
    import torch

    return "bf16" if device == "cpu" or torch.cuda.get_device_capability(0) >= (8, 0) else "fp32"


def overhead_row(workdir: Path, device: str, quick: bool, timeout: float) -> tuple[bool, str, list]:
    """bench_overhead.py on this device, data parallel in fp16 (the CPU: fp32) and DiLoCo in `diloco_precision`
    (the CPU: fp32, as the plain loop there); the row says each model's and mode's ratios."""
    import subprocess

    if quick:
        flags = ["--models", "tiny", "--max_seq_length", "128", "--steps", "3"]
    else:
        # seq 512 as the 2021 runs trained; batches a GPU of 16 GB or more holds in fp16
        flags = ["--models", "sahajbert", "sahajbert-xl", "--max_seq_length", "512", "--batch_size", "16"]
        flags += ["--passes_per_step", "2", "--steps", "4"]
    runs = [("dp", "fp16"), ("diloco", diloco_precision(device))] if device == "cuda" else [("dp diloco", "fp32")]
    rows = []
    for modes, precision in runs:
        output = workdir / f"overhead-{precision}.json"
        command = [sys.executable, str(REPO / "benchmarks" / "bench_overhead.py"), *flags, "--device", device]
        command += ["--modes", *modes.split(), "--precision", precision, "--output_json", str(output)]
        command += ["--throughput_from", "sampled"]  # one run per process: the check's 10 minutes
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            return False, "bench_overhead.py failed: " + " | ".join(done.stderr.strip().splitlines()[-3:]), rows
        rows += [{**row, "precision": precision} for row in json.loads(output.read_text())]

    def gpu(row: dict) -> str:
        if device != "cuda":
            return ""
        if row["trainer_peak_gpu_mib"] is None:  # nvidia-smi reports other pids in some containers
            return ", GPU memory not read"
        # measured against sahajbert.memory's estimate (what --check prints), untested on a GPU before this run
        return (
            f", GPU {row['trainer_peak_gpu_mib']:.0f}/{row['plain_peak_gpu_mib']:.0f} MiB "
            f"(estimated {row['estimated_peak_gpu_mib']:.0f})"
        )

    text = "; ".join(
        f"{r['model']} {r['mode']} {r['precision']}: {r['throughput_ratio']:.2f}x samples/s, "
        f"{r['memory_ratio']:.2f}x host memory (estimate {r['estimate_error']:+.0%}){gpu(r)}"
        for r in rows
    )
    return True, text, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the checks without a GPU")
    parser.add_argument("--quick", action="store_true", help="the tiny model in the overhead check (minutes less)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds each swarm check may take")
    parser.add_argument("--output_json", type=Path, help="also write the table's rows to this file")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    started = time.monotonic()
    rows: list[dict] = []

    def record(check: str, passed: bool, result: str, began: float, **extra) -> bool:
        rows.append({"check": check, "passed": passed, "result": result, "seconds": time.monotonic() - began, **extra})
        return passed

    fp16 = "fp16" if args.device == "cuda" else "fp32"
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        began = time.monotonic()
        if record("device", *device_row(args.device), began):
            began = time.monotonic()
            passed, result = swarm_row(workdir, "fp16", args.device, fp16, {"clip_gradients": "local"}, args.timeout)
            record(f"two trainers, {fp16}, local clipping", passed, result, began)
            began = time.monotonic()
            diloco = {"diloco_inner_steps": DILOCO_INNER_STEPS}
            precision = diloco_precision(args.device)
            passed, result = swarm_row(workdir, "diloco", args.device, precision, diloco, args.timeout)
            record(f"two DiLoCo trainers, {precision}", passed, result, began)
            began = time.monotonic()
            passed, result, overhead = overhead_row(workdir, args.device, args.quick, 6 * args.timeout)
            record("trainer alone vs plain loop", passed, result, began, rows=overhead)
    print(f"command: python benchmarks/gpu_check.py {' '.join(sys.argv[1:] if argv is None else argv)}\n")
    print("| check | result | passed | seconds |")
    print("|---|---|---|---:|")
    for row in rows:
        print(f"| {row['check']} | {row['result']} | {'yes' if row['passed'] else 'NO'} | {row['seconds']:.0f} |")
    print(f"\n{sum(row['passed'] for row in rows)}/{len(rows)} checks passed in {time.monotonic() - started:.0f} s")
    if args.output_json:
        args.output_json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if rows and all(row["passed"] for row in rows) and len(rows) == 4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
