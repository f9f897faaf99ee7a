#!/usr/bin/env python
"""Many peers on one machine: what grows with the swarm, in data-parallel and DiLoCo mode.

Each peer is a trainer of this project (sahajbert.trainer.TrainerPeer: its own DHT, averagers and p2p daemon, in its
own process, its own step logic) whose forward and backward pass is a declared compute time (--pass_seconds, slept)
giving a gradient of a real model's size (--payload: a preset's parameter count, or a number), so that tens of peers
fit 2 cores: what is measured is the swarm's protocol, not the model's arithmetic. The simulated loss is half the
mean square of the parameters (every peer pulls them toward 0, each with its own noise): its gradient is the
parameters, so the peers' models are real tensors that the swarm must keep in agreement.

For every N in --peers and every mode in --modes: a first peer and N such trainers on loopback (equal bandwidth
shares: --no_measure_link), a global step of N x --passes_per_step passes (DiLoCo: --passes_per_step inner steps per
outer step), --steps global steps. Measured over the steps after the first --warmup_steps: seconds per global step
beyond compute, matchmaking and all-reduce seconds per round, the group sizes formed, the share of live peers whose
samples each step included, failed rounds, DHT requests and bytes each peer answered per step, peak RSS (each peer's
process tree: trainer, DHT and averager processes, p2p daemon) and CPU per peer, and whether the final parameters
agree. One table row per run; JSON with --output_json.

    python benchmarks/scale.py --peers 4 8 16 32 --modes data-parallel diloco --output_json scale.json
"""

import argparse
import json
import math
import os
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from plan_run import hold_out

from sahajbert.localswarm import PeerProcess, checkpoints_agree, start_first_peer, stop_on_signals

REPO = Path(__file__).resolve().parents[1]  # the first peer's script

MODEL_FILE = "model.safetensors"
SCALE_LOG = "scale_log.jsonl"  # per peer, one line per global step: its DHT's and averagers' counters
TENSOR_VALUES = 2**20  # the payload model's parameters come in tensors of at most this many values
PROBE_VALUES = 16  # parameters each peer records per step, for the models' spread
SAMPLES_PER_PASS = 8  # --per_device_train_batch_size of every simulated trainer (one pass, no accumulation)
COMPRESSION = "fp16"  # the trainers' --compression (their default)
MODES = ("data-parallel", "diloco")


# ---- one peer: a trainer whose pass is a declared compute time ----


@dataclass
class SimulationArguments:
    """What replaces the model's arithmetic in a simulated trainer (benchmarks/scale.py peer ...)."""

    pass_seconds: float = field(default=1.0, metadata={"help": "seconds one forward and backward pass takes (slept)"})
    payload: str = field(
        default="tiny", metadata={"help": "parameters averaged: a model preset's count (tiny, sahajbert, ...) or N"}
    )


def payload_parameters(payload: str) -> int:
    """A preset's parameter count (with the bundled sample's vocabulary, as the peers run it), or a plain number."""
    if payload.isdigit():
        return int(payload)
    from sahajbert.model import count_parameters, load_config
    from sahajbert.samples import SAMPLE_NAME
    from sahajbert.tokenization import load_tokenizer

    return count_parameters(load_config(payload, load_tokenizer(SAMPLE_NAME)))


class PayloadModel(torch.nn.Module):
    """`parameters` values in tensors of at most TENSOR_VALUES, the same on every peer of a run (`seed`)."""

    def __init__(self, parameters: int, seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        sizes = [TENSOR_VALUES] * (parameters // TENSOR_VALUES) + [parameters % TENSOR_VALUES]
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(size, generator=generator) * 0.02) for size in sizes if size]
        )

    def save_pretrained(self, path) -> None:
        """As a transformers model saves itself: model.safetensors (what sahajbert.checkpoints writes and reads)."""
        from safetensors.torch import save_file

        save_file({name: value.contiguous() for name, value in self.state_dict().items()}, Path(path) / MODEL_FILE)


class DeclaredCompute:
    """sahajbert.compute.Compute whose pass sleeps its declared seconds and gives the gradient of half the mean square
    of the parameters, scaled per pass by this peer's noise (1 + 0.2 x a standard normal): honest peers that differ."""

    scaler = None

    def __init__(self, model, pass_seconds: float, seed: int):
        self.parameters = list(model.parameters())
        self.pass_seconds = pass_seconds
        self.generator = torch.Generator().manual_seed(seed)

    def backward(self, batch, scale: float):
        time.sleep(self.pass_seconds * scale)
        noise = 1.0 + 0.2 * float(torch.randn(1, generator=self.generator))
        squares, count = 0.0, 0
        with torch.no_grad():
            for parameter in self.parameters:
                gradient = parameter.detach() * (noise * scale)
                parameter.grad = gradient if parameter.grad is None else parameter.grad.add_(gradient)
                squares += float(parameter.detach().square().sum())
                count += parameter.numel()
        return torch.tensor(0.5 * squares / count * scale)

    def finish_pass(self) -> None:
        pass

    def push_parameters(self) -> None:
        pass

    def finish(self) -> None:
        pass


class NoBatches:
    """The trainer's batch stream, for a pass that reads none."""

    def get(self, stop=None) -> dict:
        return {}

    def close(self) -> None:
        pass


def probe(tensor: torch.Tensor) -> list[float]:
    """PROBE_VALUES values spread over `tensor`."""
    return tensor.detach()[:: max(1, len(tensor) // PROBE_VALUES)].tolist()


def simulated_trainer_class():
    """TrainerPeer with the declared compute and payload model (built on first use: the import is heavy)."""
    from sahajbert import hivemind_ext
    from sahajbert.stream import peer_seed
    from sahajbert.trainer import TrainerPeer

    class SimulatedTrainer(TrainerPeer):
        simulation: SimulationArguments

        def _build_model(self, resume_from, device_info):
            return PayloadModel(payload_parameters(self.simulation.payload), self.args.training_args.seed)

        def _build_compute(self, device_info, precision):
            seed = peer_seed(self.args.training_args.seed, self.public_key)
            return DeclaredCompute(self.model, self.simulation.pass_seconds, seed)

        def _build_batches(self, device_info, forward_batch):
            return NoBatches()

        def _after_global_step(self) -> None:
            super()._after_global_step()
            requests, request_bytes = hivemind_ext.requests_served(self.dht)
            line = {
                "step": self.optimizer.local_epoch,
                "time": time.time(),
                "dht_requests": requests,
                "dht_bytes": request_bytes,
                "rounds": hivemind_ext.round_ledgers(self.optimizer),
                # a few of this peer's parameters: how far apart the peers' models are after each step
                "probe": probe(self.model.weights[0]),
            }
            with open(self.output_dir / SCALE_LOG, "a") as f:
                f.write(json.dumps(line) + "\n")

    return SimulatedTrainer


def peer_main(argv: list[str]) -> int:
    """`scale.py peer <trainer flags> --pass_seconds S --payload P`: one simulated trainer until --max_steps."""
    from sahajbert.cli import Flags, parse_args, setup_logging
    from sahajbert.flags import PeerArguments
    from sahajbert.signals import StopRequest

    setup_logging()
    flags = Flags((PeerArguments, SimulationArguments), description="a simulated trainer of benchmarks/scale.py")
    peer_args, simulation = parse_args(flags, argv)
    trainer_class = simulated_trainer_class()
    trainer_class.simulation = simulation
    with StopRequest("stopping after the current pass") as stop, trainer_class(peer_args) as peer:
        result = peer.run(stop)
    print(f"trainer stopped at global step {result.final_step}", flush=True)
    return 0


# ---- a swarm of N simulated trainers ----


def trainer_flags(args, mode: str, peers: int, run_id: str, initial_peers: list[str], output_dir: Path) -> list[str]:
    from sahajbert.localswarm import tiny_trainer_flags

    passes = peers * args.passes_per_step  # a global step: every peer's passes_per_step passes (DiLoCo: inner steps)
    flags = tiny_trainer_flags(
        target_batch_size=passes * SAMPLES_PER_PASS,
        per_device_train_batch_size=SAMPLES_PER_PASS,
        max_steps=args.steps,
        save_steps=args.steps,
        output_dir=output_dir,
        total_steps=max(args.steps, 10),
        learning_rate=args.learning_rate,
    )
    flags += ["--run_id", run_id, "--initial_peers", *initial_peers, "--no_measure_link"]
    flags += ["--pass_seconds", str(args.pass_seconds), "--payload", str(args.payload)]
    if args.target_group_size:
        flags += ["--target_group_size", str(args.target_group_size)]
    if mode == "diloco":
        flags += ["--diloco_inner_steps", str(args.passes_per_step)]
    return flags


def proportional_bytes(pid: int) -> int:
    """A process's proportional set size (its own pages, plus its share of those it shares: forks, libraries)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_usage(process: psutil.Process) -> tuple[int, int, dict[int, float]]:
    """(resident bytes, proportional bytes, {pid: CPU seconds}) of a process and all its descendants (hivemind's DHT
    and averager processes, forked from it, and the p2p daemon). RSS counts the pages a fork shares with its parent
    once per process; PSS divides them among the processes that share them. CPU is kept per process: a sum over the
    tree falls when a member exits between two samples, and a window's CPU must be the time its members ran."""
    rss, pss, cpu = 0, 0, {}
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0, {}
    for member in members:
        try:
            rss += member.memory_info().rss
            times = member.cpu_times()
            cpu[member.pid] = times.user + times.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        pss += proportional_bytes(member.pid)
    return rss, pss, cpu


def cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the processes seen in `after` ran since `before` (a process new since then ran all of its own;
    one that exited in between is not counted, so the window's CPU is a lower bound, never negative)."""
    return sum(max(0.0, seconds - before.get(pid, 0.0)) for pid, seconds in after.items())


def run_swarm(args, mode: str, peers: int, workdir: Path) -> dict:
    run_id = f"scale{peers}{mode[0]}"
    first_peer, initial_peers = start_first_peer(REPO / "run_first_peer.py", workdir, run_id)
    trainers: dict[str, PeerProcess] = {}
    samples: dict[str, list[tuple]] = {}  # name -> [(unix time, tree RSS, tree PSS, {pid: CPU seconds})]
    try:
        for index in range(peers):
            name = f"peer{index}"
            flags = trainer_flags(args, mode, peers, run_id, initial_peers, workdir / name)
            trainers[name] = PeerProcess(Path(__file__), ["peer", *flags], workdir / f"{name}.log")
            samples[name] = []
        deadline = time.monotonic() + args.timeout
        while any(t.running() for t in trainers.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"N={peers} {mode}: not done in {args.timeout:.0f} s")
            for name, trainer in trainers.items():
                if trainer.running():
                    samples[name].append((time.time(), *tree_usage(psutil.Process(trainer.process.pid))))
            time.sleep(args.sample_every)
        failed = [name for name, t in trainers.items() if t.process.returncode != 0]
        if failed:
            raise RuntimeError(
                f"N={peers} {mode}: {failed[0]} exited {trainers[failed[0]].process.returncode}:\n"
                + trainers[failed[0]].output()[-3000:]
            )
    finally:  # every peer asked to stop at once, then waited for: one at a time, 32 stops would take minutes
        for trainer in trainers.values():
            if trainer.running():
                trainer.process.send_signal(signal.SIGINT)
        for trainer in trainers.values():
            trainer.stop()
        first_peer.stop()
    return summarize(args, mode, peers, workdir, samples)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def summarize(args, mode: str, peers: int, workdir: Path, samples: dict) -> dict:
    from sahajbert.checkpoints import list_checkpoints
    from sahajbert.train_log import read_train_log

    names = sorted(samples)
    logs = {name: read_train_log(workdir / name) for name in names}
    ledgers = {name: {line["step"]: line for line in read_jsonl(workdir / name / SCALE_LOG)} for name in names}
    steps = sorted({r.step for log in logs.values() for r in log})
    first = steps[0] + args.warmup_steps  # the steady state: from this step's end on
    window = [s for s in steps if s > first]
    if not window:
        raise RuntimeError(f"N={peers} {mode}: {len(steps)} global steps, none after the warm-up")
    times = {s: min(r.time for log in logs.values() for r in log if r.step == s) for s in steps}
    seconds_per_step = (times[window[-1]] - times[first]) / len(window)
    records = [r for log in logs.values() for r in log if r.step in window]
    # each peer's share of the window's wall time spent in its passes, over its own records (each record holds the
    # compute since that peer's record before): a step's samples also come from passes made before it began
    utilization = []
    for log in logs.values():
        own = [r for r in log if first <= r.step <= window[-1]]
        if len(own) >= 2 and own[-1].time > own[0].time:
            utilization.append(sum(r.compute_seconds for r in own[1:]) / (own[-1].time - own[0].time))
    compute = seconds_per_step * min(1.0, sum(utilization) / len(utilization)) if utilization else 0.0
    # each step's share of the live peers (none leave here) whose samples it included
    share = sum(sum(1 for r in records if r.step == s and r.samples > 0) / peers for s in window) / len(window)

    def change(name: str, key) -> float | None:
        """What one peer's counter grew by over the window (None: the peer has no line at its ends)."""
        lines = ledgers[name]
        if first not in lines or window[-1] not in lines:
            return None
        return key(lines[window[-1]]) - key(lines[first])

    def per_peer_step(key) -> float | None:
        changes = [c for c in (change(name, key) for name in names) if c is not None]
        return sum(changes) / len(changes) / len(window) if changes else None

    def per_round(kind: str, total: str, count: str) -> float | None:
        totals = [change(n, lambda line: line["rounds"].get(kind, {}).get(total, 0.0)) for n in names]
        counts = [change(n, lambda line: line["rounds"].get(kind, {}).get(count, 0.0)) for n in names]
        done = sum(c for c in counts if c)
        return sum(t for t in totals if t) / done if done else None

    # the models' spread after each step of the window: the largest difference of a probed parameter between two
    # peers, relative to the probed parameters' mean magnitude
    spreads = []
    for step in window:
        probes = [lines[step]["probe"] for lines in ledgers.values() if step in lines and "probe" in lines[step]]
        if len(probes) >= 2:
            columns = list(zip(*probes))
            scale = sum(abs(v) for column in columns for v in column) / (len(columns) * len(probes))
            spreads.append(max(max(c) - min(c) for c in columns) / scale if scale else 0.0)
    failed = sum(
        max(0, log[-1].failed_rounds - next((r.failed_rounds for r in log if r.step == first), 0))
        for log in logs.values()
        if log
    )
    rss = [max(s[1] for s in samples[name]) / 2**20 for name in names if samples[name]]
    pss = [max(s[2] for s in samples[name]) / 2**20 for name in names if samples[name]]
    cpu = []
    for name in names:  # over the samples that bracket the window (it may be shorter than --sample_every)
        taken = samples[name]
        start = next((i for i in range(len(taken) - 1, -1, -1) if taken[i][0] <= times[first]), 0)
        end = next((i for i in range(len(taken)) if taken[i][0] >= times[window[-1]]), len(taken) - 1)
        if end > start:
            cpu.append(cpu_between(taken[start][3], taken[end][3]) / (taken[end][0] - taken[start][0]))
    finals = [list_checkpoints(workdir / name)[-1][1] for name in names if list_checkpoints(workdir / name)]
    agree, difference = checkpoints_agree(finals) if len(finals) == peers else (False, math.inf)
    largest = max(
        (
            line["rounds"].get("gradients", {}).get("largest_group", 0)
            for name in names
            for line in ledgers[name].values()
        ),
        default=0,
    )
    return {
        "peers": peers,
        "mode": mode,
        "payload_parameters": payload_parameters(args.payload),
        "pass_seconds": args.pass_seconds,
        "passes_per_step": args.passes_per_step,
        "target_group_size": args.target_group_size,
        # what benchmarks/plan_run.py needs to predict this run
        "samples_per_pass": SAMPLES_PER_PASS,
        "target_batch_size": peers * args.passes_per_step * SAMPLES_PER_PASS,
        "compression": COMPRESSION,
        "global_steps": len(steps),
        "steps_measured": len(window),
        "seconds_per_step": seconds_per_step,
        # the seconds of a step its peers computed (each peer's utilization over the window), and the rest
        "compute_seconds_per_step": compute,
        # samples per global step: above the target when peers go on computing while a round runs
        "samples_per_step": sum(r.samples for r in records) / len(window),
        "seconds_beyond_compute": seconds_per_step - compute,
        "share_of_peers_per_step": share,
        "failed_rounds": failed,
        "matchmaking_seconds_per_round": per_round("gradients", "matchmaking_seconds", "matchmakings"),
        "allreduce_seconds_per_round": per_round("gradients", "allreduce_seconds", "allreduces"),
        "mean_group_size": per_round("gradients", "group_peers", "groups"),
        "largest_group": largest,
        "parameter_round_seconds": per_round("parameters", "allreduce_seconds", "allreduces"),
        "dht_requests_per_peer_step": per_peer_step(lambda line: line["dht_requests"]),
        "dht_bytes_per_peer_step": per_peer_step(lambda line: line["dht_bytes"]),
        "peak_rss_mib_per_peer": sum(rss) / len(rss) if rss else None,
        "max_peak_rss_mib": max(rss) if rss else None,
        "peak_pss_mib_per_peer": sum(pss) / len(pss) if pss else None,
        "cpu_cores_per_peer": sum(cpu) / len(cpu) if cpu else None,
        "parameter_spread_per_step": sum(spreads) / len(spreads) if spreads else None,
        "max_parameter_spread": max(spreads) if spreads else None,
        "parameters_agree": agree,
        "max_parameter_difference": difference,
    }


COLUMNS = (
    ("N", "peers", "{}"),
    ("mode", "mode", "{}"),
    ("s/step", "seconds_per_step", "{:.2f}"),
    ("compute", "compute_seconds_per_step", "{:.2f}"),
    ("beyond", "seconds_beyond_compute", "{:.2f}"),
    ("share", "share_of_peers_per_step", "{:.0%}"),
    ("failed", "failed_rounds", "{}"),
    ("match s", "matchmaking_seconds_per_round", "{:.2f}"),
    ("reduce s", "allreduce_seconds_per_round", "{:.2f}"),
    ("group", "mean_group_size", "{:.1f}"),
    ("DHT req/step", "dht_requests_per_peer_step", "{:.0f}"),
    ("DHT KB/step", "dht_bytes_per_peer_step", "{:.1f}"),
    ("RSS MiB", "peak_rss_mib_per_peer", "{:.0f}"),
    ("PSS MiB", "peak_pss_mib_per_peer", "{:.0f}"),
    ("cores", "cpu_cores_per_peer", "{:.3f}"),
    ("spread", "parameter_spread_per_step", "{:.1e}"),
    ("agree", "parameters_agree", "{}"),
)


def print_table(results: list[dict], command: str) -> None:
    print(f"\n$ {command}")
    print("| " + " | ".join(title for title, _, _ in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for result in results:
        cells = []
        for _, key, form in COLUMNS:
            value = result[key]
            if key == "dht_bytes_per_peer_step" and value is not None:
                value /= 1e3
            cells.append("-" if value is None else form.format(value))
        print("| " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["peer"]:
        return peer_main(argv[1:])
    stop_on_signals()  # a signal stops the peers this started
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 8], help="swarm sizes, one run each")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="one run per size each")
    parser.add_argument("--payload", default="tiny", help="parameters averaged: a preset (tiny, sahajbert) or N")
    parser.add_argument("--pass_seconds", type=float, default=1.0, help="declared seconds of one pass")
    parser.add_argument("--passes_per_step", type=int, default=4, help="each peer's passes per global step")
    parser.add_argument("--steps", type=int, default=8, help="global steps of each run")
    parser.add_argument("--warmup_steps", type=int, default=2, help="steps left out of the measurement")
    parser.add_argument("--target_group_size", type=int, default=None, help="every peer's --target_group_size")
    parser.add_argument("--learning_rate", type=float, default=0.05, help="every peer's --learning_rate")
    parser.add_argument("--sample_every", type=float, default=2.0, help="seconds between memory and CPU samples")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a run is abandoned")
    parser.add_argument("--keep_logs", default=None, help="copy every run's logs to this folder")
    parser.add_argument("--output_json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup_steps + 1:
        parser.error(f"--steps {args.steps}: more than --warmup_steps + 1 ({args.warmup_steps + 1}) to measure any")
    results = []
    for peers in args.peers:
        for mode in args.modes:
            with tempfile.TemporaryDirectory(prefix=f"scale{peers}-") as tmp:
                try:
                    results.append(run_swarm(args, mode, peers, Path(tmp)))
                except (TimeoutError, RuntimeError, KeyboardInterrupt) as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 1
                finally:
                    if args.keep_logs:
                        keep = Path(args.keep_logs) / f"{peers}-{mode}"
                        keep.mkdir(parents=True, exist_ok=True)
                        for log in [*Path(tmp).glob("*.log"), *Path(tmp).glob("*/*.jsonl")]:
                            name = log.name if log.suffix == ".log" else f"{log.parent.name}.{log.name}"
                            (keep / name).write_text(log.read_text(errors="replace"))
            print(json.dumps(results[-1]), flush=True)
    print_table(results, "python benchmarks/scale.py " + shlex.join(argv))
    # the planner's protocol term fitted on the smaller swarms, checked on the largest (benchmarks/plan_run.py)
    planner = hold_out(results)
    for check in planner:
        print(
            f"planner, {check['mode']}: fitted on N = {check['fitted_on_peers']}, predicts "
            f"{check['predicted_seconds_per_step']:.2f} s per step at N = {check['held_out_peers']}, measured "
            f"{check['measured_seconds_per_step']:.2f} ({check['error']:+.1%})"
        )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"runs": results, "planner": planner}, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
