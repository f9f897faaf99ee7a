#!/usr/bin/env python
"""The swarm over a small "internet" of Linux network namespaces, with shaped links and churn (run as root).

One namespace per peer, each joined by a veth pair to a bridge in a hub namespace (nothing touches the host's own
interfaces; traffic stays inside these namespaces). Each peer's upload is shaped on its side of the veth and its
download on the hub side, with `tc` (tbf for bandwidth; netem for latency where the kernel has sch_netem). It runs
a first peer, N trainers (the last in client mode, as a firewalled volunteer) and optionally an aux peer that
assists averaging, kills one trainer and starts a new one every --churn_every seconds, and prints one table per run.
Everything it created (namespaces, veths, processes) is removed on exit, on Ctrl+C and on failure.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sahajbert.localswarm import PeerProcess, read_train_log, tiny_trainer_flags, wait_for  # noqa: E402

SUBNET = "10.77.{}.{}"  # private addresses that exist only inside this benchmark's namespaces


@dataclass(frozen=True)
class LinkProfile:
    down_mbit: float
    up_mbit: float
    one_way_ms: tuple[float, ...]  # per peer, cycled; RTT between peers a and b = 2 * (d_a + d_b)


PROFILES = {
    # volunteers at home: asymmetric links, 50-150 ms between peers
    "broadband": LinkProfile(100, 20, (12.5, 25.0, 37.5)),
    "slow": LinkProfile(20, 5, (25.0, 50.0)),
    "datacenter": LinkProfile(1000, 1000, (0.5,)),
}


def sh(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=check, capture_output=True, text=True)


def netem_available() -> bool:
    """sch_netem (latency) is a kernel module some kernels lack; tbf (bandwidth) is nearly always there."""
    probe = f"sbprobe{os.getpid()}"
    sh("ip", "netns", "add", probe)
    try:
        sh("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        return (
            sh(
                "ip",
                "netns",
                "exec",
                probe,
                "tc",
                "qdisc",
                "add",
                "dev",
                "p0",
                "root",
                "netem",
                "delay",
                "1ms",
                check=False,
            ).returncode
            == 0
        )
    finally:
        sh("ip", "netns", "del", probe, check=False)


class Network:
    """A hub namespace with a bridge, and one namespace per host joined to it by a shaped veth pair."""

    def __init__(self, tag: str, profile: LinkProfile, latency: bool):
        self.tag, self.profile, self.latency = tag, profile, latency
        self.hub = f"sb{tag}hub"
        self.hosts: list[str] = []
        sh("ip", "netns", "add", self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")

    def add_host(self, index: int, shaped: bool = True) -> tuple[str, str]:
        """Create host `index`; return (namespace, its IP address)."""
        ns, ip = f"sb{self.tag}h{index}", SUBNET.format(index // 250, index % 250 + 1)
        sh("ip", "netns", "add", ns)
        self.hosts.append(ns)
        sh("ip", "link", "add", f"sb{self.tag}x{index}", "type", "veth", "peer", "name", f"sb{self.tag}y{index}")
        sh("ip", "link", "set", f"sb{self.tag}x{index}", "netns", ns, "name", "eth0")
        sh("ip", "link", "set", f"sb{self.tag}y{index}", "netns", self.hub, "name", f"v{index}")
        sh("ip", "-n", self.hub, "link", "set", f"v{index}", "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{ip}/16", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        if shaped:
            delay = self.profile.one_way_ms[index % len(self.profile.one_way_ms)]
            self._shape(ns, "eth0", self.profile.up_mbit, delay)  # what this host sends: its upload
            self._shape(self.hub, f"v{index}", self.profile.down_mbit, delay)  # what it receives: its download
        return ns, ip

    def _shape(self, ns: str, device: str, mbit: float, delay_ms: float) -> None:
        if self.latency:
            qdisc = ["netem", "delay", f"{delay_ms}ms", "rate", f"{mbit}mbit", "limit", "10000"]
        else:  # burst: 10 ms worth of bytes (at least 32 KiB); a 200 ms queue at most
            qdisc = [
                "tbf",
                "rate",
                f"{mbit}mbit",
                "burst",
                str(max(32 * 1024, int(mbit * 1e6 / 8 * 0.01))),
                "latency",
                "200ms",
            ]
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", device, "root", *qdisc)

    def tx_bytes(self, ns: str) -> int:
        return int(sh("ip", "netns", "exec", ns, "cat", "/sys/class/net/eth0/statistics/tx_bytes").stdout)

    def teardown(self) -> None:
        for ns in [*self.hosts, self.hub]:  # deleting a namespace deletes its end of each veth pair
            sh("ip", "netns", "del", ns, check=False)


def trainer_args(args, run_id: str, initial_peers: list[str], ip: str, output_dir: Path, client: bool) -> list[str]:
    flags = ["--run_id", run_id, "--initial_peers", *initial_peers] + tiny_trainer_flags(
        host=ip,
        model=args.model,
        target_batch_size=args.target_batch_size,
        max_steps=args.max_steps,
        compression=args.compression,
        save_steps=args.max_steps,
        output_dir=output_dir,
        metadata_expiration=args.metadata_expiration,
    )
    if args.lockstep:  # no delayed updates: every peer waits for each all-reduce before its next step
        flags += ["--delay_optimizer_step", "false", "--delay_grad_averaging", "false"]
    return flags + (["--client_mode"] if client else [])


def ideal_bytes_per_step(parameters: int, peers: float, compression: str) -> float:
    """Butterfly all-reduce: each of N peers sends 2 (N - 1) / N of the payload, for gradients and parameters."""
    grad_bytes = {"none": 4, "fp16": 2, "8bit": 1, "adaptive": 1}[compression]
    state_bytes = 4 if compression == "none" else 2
    return 2 * (peers - 1) / peers * parameters * (grad_bytes + state_bytes) if peers > 1 else 0.0


def run_scenario(args, workdir: Path, tag: str) -> dict:
    profile = PROFILES[args.profile]
    latency = netem_available()
    net = Network(tag, profile, latency)
    run_id = f"net{tag}"
    processes: list[PeerProcess] = []
    trainers: dict[str, PeerProcess] = {}  # output dir name -> process
    kills: list[float] = []
    try:
        ns, ip = net.add_host(0, shaped=False)  # the organizer's first peer: a well-connected server
        first = PeerProcess(
            "run_first_peer.py",
            ["--run_id", run_id, "--host_maddrs", f"/ip4/{ip}/tcp/31337"],
            workdir / "first_peer.log",
            wrapper=["ip", "netns", "exec", ns],
        )
        processes.append(first)
        line = wait_for(
            lambda: next((x for x in first.output().splitlines() if "--initial_peers" in x), None),
            60,
            "the first peer",
        )
        initial_peers = [m for m in line.split("--initial_peers ", 1)[1].split() if ip in m]
        hosts = {}
        if args.aux:
            ns, ip = net.add_host(1)
            aux_flags = trainer_args(args, run_id, initial_peers, ip, workdir / "aux", False)
            aux_flags += ["--assist_in_averaging", "--refresh_period", "2", "--checkpoint_every", "1000"]
            processes.append(
                PeerProcess("run_aux_peer.py", aux_flags, workdir / "aux.log", wrapper=["ip", "netns", "exec", ns])
            )

        def start_trainer(index: int, client: bool) -> str:
            name = f"trainer{len(trainers)}"
            ns, ip = hosts[index]
            trainers[name] = PeerProcess(
                "run_trainer.py",
                trainer_args(args, run_id, initial_peers, ip, workdir / name, client),
                workdir / f"{name}.log",
                wrapper=["ip", "netns", "exec", ns],
            )
            return name

        for i in range(args.trainers):
            hosts[2 + i] = net.add_host(2 + i)
            # one firewalled volunteer (client mode) once there are 3 trainers: with 2, churn could leave it alone,
            # and a client-mode peer can neither host an all-reduce group nor serve the state to a newcomer
            start_trainer(2 + i, client=i == args.trainers - 1 and args.trainers >= 3)
        start_bytes = {ns: net.tx_bytes(ns) for ns, _ in hosts.values()}
        started, next_churn, churn_slot = time.time(), time.time() + args.churn_every, 0
        while any(p.running() for p in trainers.values()):
            if time.time() - started > args.timeout:
                raise TimeoutError(f"the scenario did not finish in {args.timeout} s")
            if args.churn_every and time.time() >= next_churn and len(kills) < args.churn_events:
                alive = [name for name, p in trainers.items() if p.running()]
                victim = alive[churn_slot % len(alive)]
                trainers[victim].kill()
                kills.append(time.time())
                name = start_trainer(2 + list(trainers).index(victim) % args.trainers, client=False)
                churn_slot += 1
                next_churn = time.time() + args.churn_every
                print(f"churn: killed {victim}, started {name} in its namespace", flush=True)
            time.sleep(1)
        sent = sum(net.tx_bytes(ns) - start_bytes[ns] for ns, _ in hosts.values())
        failed = [name for name, p in trainers.items() if p.process.returncode not in (0, -signal.SIGKILL)]
        if failed:
            raise RuntimeError(f"{failed} failed:\n" + trainers[failed[0]].output()[-3000:])
    finally:
        for p in [*trainers.values(), *processes]:
            p.stop(timeout=20)
        net.teardown()
    return summarize(args, workdir, trainers, kills, sent, latency)


def summarize(args, workdir: Path, trainers: dict, kills: list[float], sent_bytes: int, latency: bool) -> dict:
    logs = {name: read_train_log(workdir / name) for name in trainers}
    records = [r for log in logs.values() for r in log]
    steps = sorted({r["step"] for r in records})
    times = {s: min(r["time"] for r in records if r["step"] == s) for s in steps}
    duration = times[steps[-1]] - times[steps[0]]
    step_seconds = duration / max(1, len(steps) - 1)
    compute = sum(r.get("compute_seconds", 0.0) for r in records) / max(1, len(records))
    failed_rounds = sum(
        len(re.findall(r"Averaging (gradients )?failed with", (workdir / f"{n}.log").read_text())) for n in trainers
    )
    lost = 0
    for kill_time in kills:  # the step in progress at the kill: the victim's samples counted but never applied
        step = next((s for s in steps if times[s] > kill_time), None)
        if step is not None:
            applied = sum(r["samples"] for r in records if r["step"] == step)
            lost += max(0, args.target_batch_size - applied)
    peers = sum(r["peers"] for r in records) / max(1, len(records))
    parameters = {"tiny": 124_530}.get(args.model, 0)
    from safetensors.torch import load_file

    finals = [
        load_file(workdir / name / f"checkpoint-{args.max_steps}" / "model.safetensors")
        for name, log in logs.items()
        if log and log[-1]["step"] == args.max_steps
    ]
    difference = max((float((a[k] - b[k]).abs().max()) for a, b in zip(finals, finals[1:]) for k in a), default=0.0)
    return {
        "profile": args.profile,
        "latency_shaped": latency,
        "compression": args.compression,
        "aux": args.aux,
        "trainers": args.trainers,
        "churn_events": len(kills),
        "global_steps": steps[-1],
        "steps_per_minute": 60 * (len(steps) - 1) / duration if duration else 0.0,
        "seconds_per_step": step_seconds,
        "compute_seconds_per_step": compute,
        "bytes_per_peer_step": sent_bytes / max(1, len(records)),
        "ideal_bytes_per_peer_step": ideal_bytes_per_step(parameters, peers, args.compression),
        "failed_rounds": failed_rounds,
        "samples_lost_to_churn": lost,
        "steps_after_last_churn": sum(times[s] > kills[-1] for s in steps) if kills else len(steps),
        "peers_at_the_end": len(finals),
        "max_parameter_difference": difference,
    }


def print_table(result: dict) -> None:
    shaping = "tc tbf bandwidth" + (
        " + netem latency" if result["latency_shaped"] else "; latency NOT shaped (kernel has no sch_netem)"
    )
    print(
        f"\nprofile={result['profile']} ({shaping}), compression={result['compression']}, "
        f"aux={'assisting' if result['aux'] else 'none'}, trainers={result['trainers']}, "
        f"churn events={result['churn_events']}\n"
    )
    rows = [
        ("global steps", f"{result['global_steps']}"),
        ("global steps per minute", f"{result['steps_per_minute']:.2f}"),
        ("seconds per global step", f"{result['seconds_per_step']:.2f}"),
        ("  of which compute (forward/backward)", f"{result['compute_seconds_per_step']:.2f}"),
        ("  of which averaging and waiting", f"{result['seconds_per_step'] - result['compute_seconds_per_step']:.2f}"),
        ("bytes sent per peer per global step", f"{result['bytes_per_peer_step']:,.0f}"),
        ("ideal all-reduce bytes per peer per step", f"{result['ideal_bytes_per_peer_step']:,.0f}"),
        ("failed averaging rounds", f"{result['failed_rounds']}"),
        ("samples lost to churn", f"{result['samples_lost_to_churn']}"),
        ("global steps after the last churn event", f"{result['steps_after_last_churn']}"),
        (
            f"max parameter difference between the {result['peers_at_the_end']} final peers",
            f"{result['max_parameter_difference']:.2e}",
        ),
    ]
    print("| measurement | value |\n|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile", choices=sorted(PROFILES), default="broadband", help="link profile of every trainer"
    )
    parser.add_argument(
        "--compression", choices=["none", "fp16", "8bit"], default="fp16", help="averaging compression"
    )
    parser.add_argument("--aux", action="store_true", help="add an aux peer that assists averaging")
    parser.add_argument("--trainers", type=int, default=3, help="trainer peers (from 3 on, the last in client mode)")
    parser.add_argument("--churn_every", type=float, default=0.0, help="seconds between churn events (0: none)")
    parser.add_argument("--churn_events", type=int, default=1, help="most churn events in the run")
    parser.add_argument("--max_steps", type=int, default=12, help="global steps the run trains for")
    parser.add_argument("--target_batch_size", type=int, default=384, help="samples per global step")
    parser.add_argument("--model", default="tiny", help="model preset")
    parser.add_argument(
        "--metadata_expiration", type=float, default=15.0, help="seconds a progress report lives; short under churn"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the scenario is abandoned")
    parser.add_argument("--quick", action="store_true", help="the smallest scenario: 2 trainers, one churn event")
    parser.add_argument("--output_json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--lockstep", action="store_true", help="trainers without delayed updates (DPU off)")
    parser.add_argument("--keep_logs", default=None, help="copy every peer's log and train log to this folder")
    args = parser.parse_args(argv)
    if args.quick:
        args.trainers, args.max_steps, args.churn_every, args.churn_events = 2, 8, 20.0, 1
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print("error: netswarm.py needs root and iproute2 (ip, tc) to build network namespaces", file=sys.stderr)
        return 2
    tag = f"{os.getpid() % 10000}"

    def interrupted(signum, frame):
        raise KeyboardInterrupt  # unwinds through run_scenario's cleanup

    signal.signal(signal.SIGTERM, interrupted)
    with tempfile.TemporaryDirectory(prefix="netswarm-") as tmp:
        try:
            result = run_scenario(args, Path(tmp), tag)
        except KeyboardInterrupt:
            print("interrupted: namespaces and processes removed", file=sys.stderr)
            return 130
        finally:
            if args.keep_logs:
                shutil.copytree(
                    tmp, args.keep_logs, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "*.pt")
                )
    print_table(result)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
