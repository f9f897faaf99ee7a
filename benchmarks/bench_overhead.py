#!/usr/bin/env python
"""What joining a swarm costs a peer, at the real model sizes: a trainer alone vs a plain PyTorch loop.

For each model, side by side in one run on this machine: a plain loop (same model, batch, LAMB, data and steps: one
LAMB step every --passes_per_step passes, no hivemind) and run_trainer.py alone in its swarm (hivemind.Optimizer with
the offloaded optimizer and delayed updates, its DHT, averager processes and p2p daemon). Both are processes of their
own with the same number of math threads. Measured: samples/s after the first optimizer step, and peak memory as PSS
of the process and all its children (so that pages they share count once), sampled every second, with the trainer's
peak split by process. Each process runs twice: once unsampled, for its samples/s, and once sampled, for its memory
(sampling slows what it samples, the trainer's 6 processes more than the plain loop's one: see PeakPss);
`--throughput_from sampled` takes both from one run, in half the time. The plain loop runs a second time with the
allocator setting the trainer makes (tensors of 8 MiB and more mapped on their own: sahajbert.memory), to tell that
setting's share of each gap from the trainer's own. Modes: data parallel (`dp`) and DiLoCo (`diloco`: an inner step
per plain-loop step).
`--output_json FILE` writes one object per model and mode; `--device cuda` measures on a GPU (benchmarks/gpu_check.py).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
# DiLoCo mode: inner steps per outer (global) step; each inner step covers the plain loop's optimizer step
DILOCO_INNER_STEPS = 2
# Both loops read the same examples in the same order (the trainer's --data_seed): a pass's time grows with its batch's
# padded length, which otherwise differs from run to run with the trainer's random key.
DATA_SEED = 0


def plain_loop(args) -> None:
    """The --plain child: prints {"samples_per_second": ...} after its measured passes. On CUDA in fp16 it scales the
    loss with torch's GradScaler, as the trainer's fp16 path does with hivemind's."""
    import torch

    from sahajbert.devices import autocast_dtype
    from sahajbert.flags import CorpusArguments
    from sahajbert.model import build_model
    from sahajbert.optim import Lamb, parameter_groups
    from sahajbert.samples import SAMPLE_FILES
    from sahajbert.stream import training_batches
    from sahajbert.tokenization import load_tokenizer

    tokenizer = load_tokenizer("sample")
    model = build_model(args.model, tokenizer, seed=0).train().to(args.device)
    optimizer = Lamb(parameter_groups(model, 0.01), lr=0.001, clamp_value=10_000.0, max_grad_norm=1.0)
    dtype = autocast_dtype(args.precision)
    scaler = torch.amp.GradScaler("cuda") if args.precision == "fp16" else None
    # the trainer's stream, batch for batch: its corpus flags (sahajbert.localswarm.tiny_trainer_flags) and DATA_SEED
    corpus = CorpusArguments(data_files=SAMPLE_FILES, max_seq_length=args.max_seq_length, shuffle_buffer=200)
    batches = training_batches(corpus, tokenizer, DATA_SEED, args.batch_size, on_xla=False)
    for step in range(args.steps):
        if step == 1:  # as for the trainer: from the end of the first optimizer step
            started = time.perf_counter()
        for _ in range(args.passes_per_step):
            batch = {name: value.to(args.device) for name, value in next(batches).items()}
            with torch.autocast(torch.device(args.device).type, dtype=dtype, enabled=dtype is not None):
                loss = model(**batch).loss / args.passes_per_step
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if args.device == "cuda":
        torch.cuda.synchronize()
    samples = (args.steps - 1) * args.passes_per_step * args.batch_size
    batches.close()
    print(json.dumps({"samples_per_second": samples / (time.perf_counter() - started)}), flush=True)


def gpu_memory() -> dict[int, int]:
    """Bytes of GPU memory each process holds (nvidia-smi), by pid; empty without an NVIDIA GPU."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used = {}
    for line in out.strip().splitlines():
        pid, mib = (field.strip() for field in line.split(","))
        if pid.isdigit() and mib.isdigit():
            used[int(pid)] = int(mib) * 2**20
    return used


def role(process: psutil.Process, root: psutil.Process) -> str:
    """Which part of a peer a process of its tree is: the script's own process, a process forked from it (hivemind's
    DHT and averagers, torch's shared-memory manager), or a p2p daemon."""
    if process.pid == root.pid:
        return "main"
    return "p2pd" if "p2pd" in process.name() else "forked"


class PeakPss:
    """Samples the PSS of a process and all its descendants in a thread; `peak` in bytes, and `parts`: at that peak,
    each role's (see `role`) processes, PSS and private bytes (USS: pages no other process shares)."""

    # Each sample walks the page tables of every process of the tree (smaps_rollup) and holds their memory map locks:
    # at 0.25 s a sahajbert DiLoCo trainer's passes took 66-73 s for 32 samples instead of 56 s unsampled (its tree
    # is 6 processes, the plain loop's 1, so sampling slowed the trainer more); at 1 s, 52-61 s. A pass's peak lasts
    # seconds (sahajbert: a pass of 4 examples takes about 8 s), which 1 s still catches.
    def __init__(self, pid: int, interval: float = 1.0, gpu: bool = False):
        self.root, self.interval, self.peak = psutil.Process(pid), interval, 0
        self.parts: dict[str, dict] = {}
        self.gpu, self.gpu_peak = gpu, 0  # with `gpu`: the tree's peak GPU memory in bytes, from nvidia-smi
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            total, parts = 0, {}
            try:
                tree = [self.root, *self.root.children(recursive=True)]
                if self.gpu:
                    used = gpu_memory()
                    self.gpu_peak = max(self.gpu_peak, sum(used.get(process.pid, 0) for process in tree))
                for process in tree:
                    try:
                        info = process.memory_full_info()
                        part = parts.setdefault(role(process, self.root), {"processes": 0, "pss": 0, "private": 0})
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        continue
                    total += info.pss
                    part["processes"] += 1
                    part["pss"] += info.pss
                    part["private"] += info.uss
            except psutil.NoSuchProcess:
                return
            if total > self.peak:
                self.peak, self.parts = total, parts
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_measured(command: list[str], env: dict, log: Path, timeout: float, gpu: bool = False) -> PeakPss:
    """Run `command` to its end, its output to `log`; returns its memory samples (peak PSS in bytes, parts)."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        memory = PeakPss(process.pid, gpu=gpu)
        try:
            code = process.wait(timeout)
        finally:
            memory.stop()
    if code != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed:\n{log.read_text()[-3000:]}")
    return memory


def run_unsampled(command: list[str], env: dict, log: Path, timeout: float) -> None:
    """Run `command` to its end, its output to `log`, with nothing reading its memory: the run its samples/s is
    taken from."""
    with open(log, "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
    if code != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed:\n{log.read_text()[-3000:]}")


def run_twice(args, command: list[str], env: dict, log: Path, output: Path | None = None) -> PeakPss:
    """`command` run for its memory (sampled) and, unless --throughput_from sampled, again unsampled; returns the
    memory samples. The unsampled run goes second, so that `log` and the folder `output` (removed before each run: a
    trainer would resume from the first run's checkpoint) hold what its samples/s is read from."""
    if output:
        shutil.rmtree(output, ignore_errors=True)
    memory = run_measured(command, env, log, args.timeout, gpu=args.device == "cuda")
    if args.throughput_from == "unsampled":
        if output:
            shutil.rmtree(output, ignore_errors=True)
        run_unsampled(command, env, log, args.timeout)
    return memory


def measure_plain(args, model: str, workdir: Path, trainer_allocator: bool = False) -> tuple[float, PeakPss]:
    """The plain loop: its samples/s and memory samples; with `trainer_allocator`, with the allocator setting the
    trainer makes (sahajbert.memory.return_large_frees), to tell that setting's share of each gap from the trainer's
    own."""
    from sahajbert.localswarm import peer_env

    env = {**peer_env(), "OMP_NUM_THREADS": str(args.threads)}
    common = ["--model", model, "--max_seq_length", str(args.max_seq_length), "--batch_size", str(args.batch_size)]
    common += ["--steps", str(args.steps), "--passes_per_step", str(args.passes_per_step)]
    common += ["--device", args.device, "--precision", args.precision]
    common += ["--return_large_frees"] if trainer_allocator else []
    plain_log = workdir / f"plain-{model}{'-tuned' if trainer_allocator else ''}.log"
    command = [sys.executable, __file__, "--plain", *common]
    plain_memory = run_twice(args, command, env, plain_log)
    return json.loads(plain_log.read_text().strip().splitlines()[-1])["samples_per_second"], plain_memory


def trainer_estimate(args, model: str):
    """sahajbert.memory's estimate of the measured trainer's peak (the bench's tokenizer, batch and precision)."""
    from sahajbert.memory import estimate_peak
    from sahajbert.model import load_config
    from sahajbert.tokenization import load_tokenizer

    config = load_config(model, load_tokenizer("sample"))
    return estimate_peak(config, args.batch_size, args.max_seq_length, args.device, args.precision)


def measure(args, model: str, mode: str, workdir: Path, plain: float, plain_memory: PeakPss) -> dict:
    """The trainer alone, for one model in one mode, beside the plain loop's measures; the table's values."""
    from sahajbert.localswarm import peer_env, tiny_trainer_flags
    from sahajbert.train_log import read_train_log

    env = {**peer_env(), "OMP_NUM_THREADS": str(args.threads)}

    output = workdir / f"trainer-{model}-{mode}"
    batch = args.batch_size * args.passes_per_step
    if mode == "diloco":  # an inner step per plain-loop step: --passes_per_step passes accumulated
        per_mode = dict(
            diloco_inner_steps=DILOCO_INNER_STEPS,
            gradient_accumulation_steps=args.passes_per_step,
            max_steps=-(-args.steps // DILOCO_INNER_STEPS),
        )
    else:
        per_mode = dict(target_batch_size=batch, max_steps=args.steps)
    flags = tiny_trainer_flags(
        model=model,
        max_seq_length=args.max_seq_length,
        per_device_train_batch_size=args.batch_size,
        learning_rate=0.001,
        save_steps=10**9,
        data_seed=DATA_SEED,
        final_averaging_window=0,
        output_dir=output,
        device=args.device,
        precision=args.precision,
        **per_mode,
    )
    trainer_log = workdir / f"trainer-{model}-{mode}.log"
    command = [sys.executable, str(REPO / "run_trainer.py"), *flags]
    trainer_memory = run_twice(args, command, env, trainer_log, output)
    estimate = trainer_estimate(args, model)
    records = read_train_log(output)
    measured = [r for r in records if r.step > 1]
    if not measured:
        raise RuntimeError(f"the trainer made no measured global step:\n{trainer_log.read_text()[-3000:]}")
    trainer = sum(r.samples for r in measured) / (measured[-1].time - records[0].time)
    return {
        "model": model,
        "mode": mode,
        "plain_samples_per_s": plain,
        "trainer_samples_per_s": trainer,
        "throughput_ratio": trainer / plain,
        "plain_peak_pss_mib": plain_memory.peak / 2**20,
        "trainer_peak_pss_mib": trainer_memory.peak / 2**20,
        "memory_ratio": trainer_memory.peak / plain_memory.peak,
        # what --check and --auto_config estimate for this trainer before it joins (sahajbert.memory), host and GPU
        "estimated_peak_pss_mib": estimate.host_bytes / 2**20,
        "estimate_error": estimate.host_bytes / trainer_memory.peak - 1,
        "estimated_peak_gpu_mib": None if estimate.device_bytes is None else estimate.device_bytes / 2**20,
        # None where nothing was read (no GPU; or nvidia-smi reports the pids of another namespace, in a container)
        "plain_peak_gpu_mib": plain_memory.gpu_peak / 2**20 or None,
        "trainer_peak_gpu_mib": trainer_memory.gpu_peak / 2**20 or None,
        # at the trainer's peak: each role's processes, PSS and private MiB
        "trainer_parts": {
            name: {
                "processes": part["processes"],
                "pss_mib": part["pss"] / 2**20,
                "private_mib": part["private"] / 2**20,
            }
            for name, part in sorted(trainer_memory.parts.items())
        },
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--models", nargs="+", default=["sahajbert", "sahajbert-xl"], help="model presets")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["dp", "diloco"],
        default=["dp", "diloco"],
        help=f"dp: data parallel; diloco: --diloco_inner_steps {DILOCO_INNER_STEPS}",
    )
    parser.add_argument("--max_seq_length", type=int, default=128, help="tokens per example")
    parser.add_argument("--batch_size", type=int, default=4, help="examples per forward/backward pass")
    parser.add_argument("--passes_per_step", type=int, default=4, help="passes per optimizer (global) step")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps; the first is not measured")
    parser.add_argument("--threads", type=int, default=2, help="math threads of each process")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both compute")
    parser.add_argument(
        "--precision", choices=["fp32", "fp16", "bf16"], default="fp32", help="both compute in (fp16: CUDA only)"
    )
    parser.add_argument(
        "--throughput_from",
        choices=["unsampled", "sampled"],
        default="unsampled",
        help="samples/s from a second, unsampled run of each process, or from the sampled run (half the time)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one measured process may take")
    parser.add_argument("--output_json", type=Path, help="also write the rows to this file (a list of objects)")
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # the plain loop's own process
    parser.add_argument("--model", default="sahajbert", help=argparse.SUPPRESS)
    parser.add_argument("--return_large_frees", action="store_true", help=argparse.SUPPRESS)  # the plain loop's
    args = parser.parse_args(argv)
    if args.precision == "fp16" and args.device != "cuda":
        parser.error("--precision fp16 needs --device cuda")
    if args.plain:
        if args.return_large_frees:
            from sahajbert.memory import return_large_frees

            return_large_frees()
        plain_loop(args)
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            plain = measure_plain(args, model, Path(tmp))  # once per model, just before its trainers
            tuned, tuned_memory = measure_plain(args, model, Path(tmp), trainer_allocator=True)
            for mode in args.modes:
                row = measure(args, model, mode, Path(tmp), *plain)
                # the same plain loop with the trainer's allocator setting: what of each gap is the setting's
                row["plain_trainer_allocator_samples_per_s"] = tuned
                row["throughput_ratio_same_allocator"] = row["trainer_samples_per_s"] / tuned
                row["plain_trainer_allocator_peak_pss_mib"] = tuned_peak = tuned_memory.peak / 2**20
                row["memory_ratio_same_allocator"] = row["trainer_peak_pss_mib"] / tuned_peak
                row["throughput_from"] = args.throughput_from
                rows.append(row)
    print("command: python benchmarks/bench_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(
        f"\nseq {args.max_seq_length}, batch {args.batch_size} x {args.passes_per_step} passes per step, "
        f"{args.steps} steps (the first not measured), {args.threads} threads per process, "
        f"{args.device} {args.precision}; samples/s from the {args.throughput_from} run of each process\n"
    )
    print(
        "| model | mode | plain loop, samples/s | trainer alone, samples/s | ratio | plain loop, peak PSS MiB "
        "| trainer + children, peak PSS MiB | ratio | estimated peak MiB (error) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['mode']} | {r['plain_samples_per_s']:.3f} | {r['trainer_samples_per_s']:.3f} "
            f"| {r['throughput_ratio']:.2f} | {r['plain_peak_pss_mib']:.0f} | {r['trainer_peak_pss_mib']:.0f} "
            f"| {r['memory_ratio']:.2f} | {r['estimated_peak_pss_mib']:.0f} ({r['estimate_error']:+.0%}) |"
        )
    print("\nagainst the plain loop given the trainer's allocator setting (sahajbert.memory.return_large_frees)\n")
    print("| model | mode | plain loop, samples/s | trainer's ratio | plain loop, peak PSS MiB | trainer's ratio |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['mode']} | {r['plain_trainer_allocator_samples_per_s']:.3f} "
            f"| {r['throughput_ratio_same_allocator']:.2f} | {r['plain_trainer_allocator_peak_pss_mib']:.0f} "
            f"| {r['memory_ratio_same_allocator']:.2f} |"
        )
    print("\nthe trainer's processes at its peak: PSS MiB (private MiB)\n")
    print("| model | mode | main | forked by hivemind (DHT, averagers), torch_shm_manager | p2p daemon |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        cells = []
        for name in ("main", "forked", "p2pd"):
            part = r["trainer_parts"].get(name)
            cells.append(
                "-" if part is None else f"{part['pss_mib']:.0f} ({part['private_mib']:.0f}) x{part['processes']}"
            )
        print(f"| {r['model']} | {r['mode']} | " + " | ".join(cells) + " |")
    if args.output_json:
        args.output_json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
