#!/usr/bin/env python
"""The swarm over a small "internet" of Linux network namespaces, with shaped links and churn (run as root).

One namespace per peer, each joined by a veth pair to a hub namespace (nothing touches the host's own interfaces;
traffic stays inside these namespaces). Each peer's upload is shaped on its side of the veth and its download on the
hub side with `tc`: netem for latency and bandwidth where the kernel has sch_netem; elsewhere tbf for bandwidth and,
for latency, benchmarks/delayswitch.py, a userspace switch in the hub that holds each frame for the link latency
(it needs ethtool, to switch the veths' offloads off). The round trip between peers is measured and printed. It runs
a first peer, N trainers (the last in client mode, as a firewalled volunteer) and optionally an aux peer that
assists averaging, starts a new trainer and, once it has joined, kills an old one every --churn_every seconds (or
every --churn_every_steps global steps of the swarm), and prints one table per run. The peers use their automatic
timing and measured bandwidth unless timing flags are given; `--heterogeneous` gives the trainers different links and
`--balance compare` runs the equal split and bandwidth balancing one after the other, side by side.
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

from sahajbert.adaptive import payload_bytes, state_download_bytes
from sahajbert.checkpoints import list_checkpoints
from sahajbert.flags import LocalTrainingArguments
from sahajbert.localswarm import (
    AGREEMENT_ATOL,
    AGREEMENT_RTOL,
    PeerProcess,
    checkpoints_agree,
    tiny_trainer_flags,
    wait_for,
)
from sahajbert.train_log import read_train_log

REPO = Path(__file__).resolve().parents[1]  # the scripts each namespace runs
HERE = Path(__file__).resolve().parent

SUBNET = "10.77.{}.{}"  # private addresses that exist only inside this benchmark's namespaces
# --nat: the "internet" between the routers gets public-looking addresses (they too exist only inside these
# namespaces): libp2p builds relay addresses and asks AutoNAT to dial back only for public addresses
PUBLIC_SUBNET = "31.77.{}.{}"


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
# --heterogeneous: trainer i gets profile i (cycled): one fast peer and two slower ones, each below the delay
# switch's forwarding ceiling (measured and printed every run)
HETEROGENEOUS = (
    LinkProfile(200, 200, (12.5,)),
    LinkProfile(100, 20, (25.0,)),
    LinkProfile(20, 5, (37.5,)),
)


# the forwarding-ceiling probe: the server prints the Mbit/s it received over the later 2/3 of the transfer
THROUGHPUT_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5201)); s.listen(1)
c, _ = s.accept(); marks = []
while True:
    data = c.recv(1 << 16)
    if not data:
        break
    marks.append((time.perf_counter(), len(data)))
start, end = marks[0][0], marks[-1][0]
later = [(t, n) for t, n in marks if t >= start + (end - start) / 3]
print(sum(n for _, n in later[1:]) * 8 / 1e6 / max(1e-9, later[-1][0] - later[0][0]))
"""
THROUGHPUT_CLIENT = """
import socket, time
s = socket.create_connection(("{ip}", 5201), timeout=5); payload = bytes(1 << 16); end = time.time() + {seconds}
while time.time() < end:
    s.sendall(payload)
s.close()
"""


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
    """A hub namespace and one namespace per host, joined to it by a shaped veth pair.

    `latency`: "netem" (the kernel delays frames; the hub is a bridge) or "switch" (the hub runs delayswitch.py).
    """

    def __init__(self, tag: str, profile: LinkProfile, latency: str, log_dir: Path, subnet: str = SUBNET):
        self.tag, self.profile, self.latency, self.log_dir, self.subnet = tag, profile, latency, log_dir, subnet
        self.hub = f"sb{tag}hub"
        self.hosts: list[str] = []
        self.ports: dict[str, float] = {}  # hub-side port -> its one-way latency in ms
        self.links: dict[str, LinkProfile] = {}  # shaped host namespace -> its link
        self.switch: PeerProcess | None = None
        sh("ip", "netns", "add", self.hub)
        if latency == "netem":
            sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.hub, "link", "set", "br0", "up")

    def add_host(self, index: int, shaped: bool = True, profile: LinkProfile | None = None) -> tuple[str, str]:
        """Create host `index` (on `profile`, default the network's); return (namespace, its IP address)."""
        profile = profile or self.profile
        ns, ip = f"sb{self.tag}h{index}", self.subnet.format(index // 250, index % 250 + 1)
        sh("ip", "netns", "add", ns)
        self.hosts.append(ns)
        sh("ip", "link", "add", f"sb{self.tag}x{index}", "type", "veth", "peer", "name", f"sb{self.tag}y{index}")
        sh("ip", "link", "set", f"sb{self.tag}x{index}", "netns", ns, "name", "eth0")
        sh("ip", "link", "set", f"sb{self.tag}y{index}", "netns", self.hub, "name", f"v{index}")
        if self.latency == "netem":
            sh("ip", "-n", self.hub, "link", "set", f"v{index}", "master", "br0")
        else:  # the switch reads and writes plain frames: no segmentation super-frames, no unfinished checksums
            for where, device in ((ns, "eth0"), (self.hub, f"v{index}")):
                sh("ip", "netns", "exec", where, "ethtool", "-K", device, "tso", "off", "gso", "off", "tx", "off")
        sh("ip", "-n", self.hub, "link", "set", f"v{index}", "up")
        sh("ip", "-n", ns, "addr", "add", f"{ip}/16", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        delay = profile.one_way_ms[index % len(profile.one_way_ms)] if shaped else 0.0
        self.ports[f"v{index}"] = delay
        if shaped:
            self._shape(ns, "eth0", profile.up_mbit, delay)  # what this host sends: its upload
            self._shape(self.hub, f"v{index}", profile.down_mbit, delay)  # what it receives: its download
            self.links[ns] = profile
        return ns, ip

    def add_nat_host(self, index: int, profile: LinkProfile | None = None) -> tuple[str, str, str, str]:
        """A volunteer at home: host `index` becomes its router (the shaped link, the public address), and the
        peer runs in a namespace behind it, on a private address that the router masquerades. Only replies to
        connections from inside come in, as with a home router.

        Return (peer namespace, private IP, router namespace, public IP)."""
        router, public_ip = self.add_host(index, profile=profile)
        ns, ip, gateway = f"sb{self.tag}n{index}", f"192.168.{index % 250}.2", f"192.168.{index % 250}.1"
        sh("ip", "netns", "add", ns)
        self.hosts.append(ns)
        sh("ip", "link", "add", f"sb{self.tag}l{index}", "type", "veth", "peer", "name", f"sb{self.tag}m{index}")
        sh("ip", "link", "set", f"sb{self.tag}l{index}", "netns", ns, "name", "eth0")
        sh("ip", "link", "set", f"sb{self.tag}m{index}", "netns", router, "name", "lan0")
        sh("ip", "-n", router, "addr", "add", f"{gateway}/24", "dev", "lan0")
        sh("ip", "-n", router, "link", "set", "lan0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", gateway)
        inside = ["ip", "netns", "exec", router]
        sh(*inside, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        sh(*inside, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE")
        sh(*inside, "iptables", "-A", "FORWARD", "-i", "lan0", "-j", "ACCEPT")
        sh(*inside, "iptables", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        sh(*inside, "iptables", "-P", "FORWARD", "DROP")
        self.links[ns] = self.links[router]
        return ns, ip, router, public_ip

    def start(self) -> None:
        """With the userspace switch: start it on every port (all hosts exist by now)."""
        if self.latency != "switch":
            return
        ports = [item for port, ms in self.ports.items() for item in ("--port", f"{port}:{ms}")]
        ports += ["--network", self.hub]
        self.switch = PeerProcess(
            REPO / "benchmarks" / "delayswitch.py",
            ports,
            self.log_dir / "delayswitch.log",
            wrapper=["ip", "netns", "exec", self.hub],
        )
        wait_for(lambda: "delay switch up" in self.switch.output() or not self.switch.running(), 30, "the switch")
        if not self.switch.running():
            raise RuntimeError(f"the delay switch failed:\n{self.switch.output()[-2000:]}")

    def round_trip_ms(self, from_ns: str, to_ip: str, tries: int = 5) -> float:
        """Shortest time of a TCP connect to a closed port (SYN out, RST back: one round trip), in ms: the links' own
        delay; a busy machine only adds to some tries."""
        probe = (
            "import socket, time\n"
            "times = []\n"
            f"for _ in range({tries + 1}):\n"
            "    s = socket.socket(); start = time.perf_counter()\n"
            f"    try: s.connect(('{to_ip}', 9))\n"
            "    except OSError: pass\n"
            "    times.append(time.perf_counter() - start); s.close()\n"
            "print(min(times[1:]) * 1000)"  # the first try also resolves the MAC address (ARP)
        )
        return float(sh("ip", "netns", "exec", from_ns, sys.executable, "-c", probe).stdout)

    def throughput_mbit(self, from_ns: str, to_ns: str, to_ip: str, seconds: float = 3.0) -> float:
        """TCP throughput from one host to another, over the later two thirds of a `seconds` transfer (Mbit/s)."""
        server = subprocess.Popen(
            ["ip", "netns", "exec", to_ns, sys.executable, "-c", THROUGHPUT_SERVER, to_ip],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            client = THROUGHPUT_CLIENT.format(ip=to_ip, seconds=seconds)
            for _ in range(50):  # the server needs a moment to listen
                if sh("ip", "netns", "exec", from_ns, sys.executable, "-c", client, check=False).returncode == 0:
                    break
                time.sleep(0.1)
            return float(server.communicate(timeout=seconds + 30)[0])
        finally:
            server.kill()

    def _shape(self, ns: str, device: str, mbit: float, delay_ms: float) -> None:
        if self.latency == "netem":
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
        if self.switch is not None:
            self.switch.stop(timeout=5)
        for ns in [*self.hosts, self.hub]:  # deleting a namespace deletes its end of each veth pair
            sh("ip", "netns", "del", ns, check=False)


TRAINING = re.compile(r"samples toward the next step|global step \d")  # a trainer's log once it trains
# a newcomer's log once it has the swarm's state (or trains with it): a churn event's victim dies after this
JOINED = re.compile(r"joined at global step|global step \d+ \|")
STANDBY_STEPS = 2  # global steps before a churn event at which its replacement starts (--churn_every_steps)
# timing flags passed on to every peer only when given: by default each peer plans its own (sahajbert.adaptive)
TIMING_FLAGS = ("averaging_timeout", "next_chunk_timeout", "matchmaking_time", "final_averaging_window")


def trainer_args(args, run_id: str, initial_peers: list[str], ip: str, output_dir: Path, client: bool) -> list[str]:
    timing = {name: getattr(args, name) for name in TIMING_FLAGS if getattr(args, name) is not None}
    if args.model not in ("tiny", "tiny-xl"):  # the tiny preset's learning rate diverges at the real sizes
        timing["learning_rate"] = LocalTrainingArguments.learning_rate
    if args.balance == "equal":  # every peer declares the same bandwidth: hivemind splits the all-reduce equally
        timing["bandwidth"] = 100
    flags = ["--run_id", run_id, "--initial_peers", *initial_peers] + tiny_trainer_flags(
        host=ip,
        model=args.model,
        target_batch_size=args.target_batch_size,
        per_device_train_batch_size=args.per_device_train_batch_size,
        max_steps=args.max_steps,
        compression=args.compression,
        save_steps=args.max_steps,
        output_dir=output_dir,
        metadata_expiration=args.metadata_expiration,
        **timing,
    )
    if args.lockstep:  # no delayed updates: every peer waits for each all-reduce before its next step
        flags += ["--delay_optimizer_step", "false", "--delay_grad_averaging", "false"]
    for name in ("learning_rate", "total_steps"):
        if getattr(args, name) is not None:
            flags += [f"--{name}", str(getattr(args, name))]
    if args.diloco_inner_steps:  # an outer step after every trainer's H inner steps (int8 pseudo-gradients)
        flags += ["--diloco_inner_steps", str(args.diloco_inner_steps)]
        if args.diloco_overlap:  # the round averages behind the next inner steps
            flags += ["--diloco_overlap"]
        flags += ["--pseudo_gradient_compression", args.pseudo_gradient_compression]
        flags += ["--diloco_fragments", str(args.diloco_fragments)]
        flags += ["--outer_lr", str(args.outer_lr)] if args.outer_lr is not None else []
    return flags + (["--client_mode"] if client else [])


def ideal_bytes_per_step(parameters: int, peers: float, compression: str, diloco: bool = False) -> float:
    """Butterfly all-reduce: each of N peers sends 2 (N - 1) / N of the payload, for gradients and parameters
    (DiLoCo: its 8-bit pseudo-gradients only, once per outer step)."""
    gradient_bytes, state_bytes = payload_bytes(parameters, "8bit" if diloco else compression)
    payload = gradient_bytes if diloco else gradient_bytes + state_bytes
    return 2 * (peers - 1) / peers * payload if peers > 1 else 0.0


def final_round_bytes(parameters: int, final_round: list, compression: str) -> float:
    """The final parameter round's butterfly volume per peer (parameters only), for the peers that took part."""
    peers = max((int(found[-1]) for found in final_round if found), default=0)
    _, state_bytes = payload_bytes(parameters, compression)
    return 2 * (peers - 1) / peers * state_bytes if peers > 1 else 0.0


def model_parameters(preset: str) -> int:
    """The preset's parameter count, from its config (the bundled sample tokenizer's vocabulary, as the peers use)."""
    from sahajbert.model import count_parameters, load_config
    from sahajbert.samples import SAMPLE_NAME
    from sahajbert.tokenization import load_tokenizer

    return count_parameters(load_config(preset, load_tokenizer(SAMPLE_NAME)))


def run_scenario(args, workdir: Path, tag: str) -> dict:
    profile = PROFILES[args.profile]
    latency = args.latency_by
    net = Network(tag, profile, latency, workdir, subnet=PUBLIC_SUBNET if args.nat else SUBNET)
    run_id = f"net{tag}"
    processes: list[PeerProcess] = []
    trainers: dict[str, PeerProcess] = {}  # output dir name -> process
    kills: list[float] = []
    try:
        first_host = net.add_host(0, shaped=False)  # the organizer's first peer: a well-connected server
        aux_host = net.add_host(1) if args.aux else None
        # a replacement after churn is another volunteer: its own namespace and address, made before the switch starts
        joiners = args.churn_events if args.churn_every or args.churn_every_steps else 0
        # host -> (namespace the trainer runs in, its address); a NAT'd host's router is what others can reach
        hosts: dict[int, tuple[str, str]] = {}
        routers: dict[int, tuple[str, str]] = {}
        for i in range(args.trainers + joiners):
            if behind_nat(args, i):
                ns, ip, router, public_ip = net.add_nat_host(2 + i, profile=trainer_profile(args, i))
                hosts[2 + i], routers[2 + i] = (ns, ip), (router, public_ip)
            else:
                hosts[2 + i] = routers[2 + i] = net.add_host(2 + i, profile=trainer_profile(args, i))
        # --nat: a volunteer with a public address of its own, for the reachability check
        public_host = net.add_host(249, shaped=False) if args.nat else None
        # an unshaped host beside the first peer's, to measure what the hub itself forwards
        ceiling_host = net.add_host(250, shaped=False) if latency == "switch" else None
        net.start()
        # measured, not assumed: the round trip between the first two trainers' namespaces
        rtt_ms = net.round_trip_ms(routers[2][0], routers[3][1]) if len(hosts) > 1 else 0.0
        print(f"round trip between trainer hosts: {rtt_ms:.1f} ms", flush=True)
        ceiling = net.throughput_mbit(ceiling_host[0], first_host[0], first_host[1]) if ceiling_host else None
        if ceiling is not None:
            print(f"the delay switch forwards up to {ceiling:.0f} Mbit/s (unshaped TCP through the hub)", flush=True)
            too_fast = sorted(
                {max(p.up_mbit, p.down_mbit) for p in net.links.values() if max(p.up_mbit, p.down_mbit) > ceiling}
            )
            if too_fast:
                print(f"warning: links of {too_fast} Mbit/s exceed the switch's ceiling: they run slower", flush=True)
        ns, ip = first_host
        first = PeerProcess(
            REPO / "run_first_peer.py",
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
        if args.aux:
            ns, ip = aux_host
            aux_flags = trainer_args(args, run_id, initial_peers, ip, workdir / "aux", False)
            aux_flags += ["--assist_in_averaging", "--refresh_period", "2", "--checkpoint_every", "1000"]
            processes.append(
                PeerProcess(
                    REPO / "run_aux_peer.py", aux_flags, workdir / "aux.log", wrapper=["ip", "netns", "exec", ns]
                )
            )

        # run_trainer.py --check as a volunteer would, in each situation: its reachability line
        checks = {}
        if args.nat:
            nat_hosts = [hosts[i] for i in sorted(hosts) if hosts[i] != routers[i]]
            situations = {"public address": (public_host, []), "behind NAT": (nat_hosts[0], [])}
            if len(nat_hosts) > 1:
                situations["behind NAT, --no_auto_relay"] = (nat_hosts[1], ["--no_auto_relay"])
            running = {
                situation: PeerProcess(
                    REPO / "run_trainer.py",
                    ["--check", "--run_id", run_id, "--initial_peers", *initial_peers, *flags]
                    + tiny_trainer_flags(host=host[1], output_dir=workdir / "check"),
                    workdir / f"check {situation}.log",
                    wrapper=["ip", "netns", "exec", host[0]],
                )
                for situation, (host, flags) in situations.items()
            }
            for situation, check in running.items():
                wait_for(lambda check=check: not check.running(), 120, f"run_trainer.py --check ({situation})")
                line = re.search(r"^\[.*\] reachable from outside: .*$", check.output(), re.MULTILINE)
                checks[situation] = line.group(0) if line else check.output()[-500:]
                print(f"--check {situation}: {checks[situation]}", flush=True)

        started_at: dict[str, float] = {}
        held: dict[str, tuple[PeerProcess, Path]] = {}  # replacements started ahead, waiting for their release
        host_of: dict[str, str] = {}
        nat_of: dict[str, bool] = {}
        client_of: dict[str, bool] = {}
        port_of: dict[str, str] = {}  # the hub-side port of the trainer's link (its router's, behind NAT)

        def start_trainer(index: int, client: bool, newcomer: bool = False, go: Path | None = None) -> str:
            """Start the trainer of host `index`; with `go`, held (imports done) until that file exists: its start
            counts from its release (`release`)."""
            name = f"trainer{len(trainers) + len(held)}"
            ns, ip = hosts[index]
            started_at[name], host_of[name], nat_of[name] = time.time(), ns, hosts[index] != routers[index]
            client_of[name], port_of[name] = client, f"v{index}"
            # a volunteer at home whose NAT no relay takes: it must fall back to client mode by itself
            no_relay = ["--no_auto_relay"] if newcomer and args.newcomer_without_relay else []
            script_args = trainer_args(args, run_id, initial_peers, ip, workdir / name, client) + no_relay
            script, script_args = (
                (REPO / "run_trainer.py", script_args)
                if go is None
                else (HERE / "held_start.py", [str(go), str(REPO / "run_trainer.py"), *script_args])
            )
            process = PeerProcess(script, script_args, workdir / f"{name}.log", wrapper=["ip", "netns", "exec", ns])
            if go is None:
                trainers[name] = process
            else:
                held[name] = (process, go)
            return name

        def release(name: str) -> str:
            """A held trainer starts (a churn replacement): from now on it is one of the run's trainers."""
            process, go = held.pop(name)
            go.touch()
            started_at[name], trainers[name] = time.time(), process
            return name

        for i in range(args.trainers):
            # one firewalled volunteer (client mode) once there are 3 trainers: with 2, churn could leave it alone,
            # and a client-mode peer can neither host an all-reduce group nor serve the state to a newcomer
            last = i == args.trainers - 1 and args.trainers >= 3
            start_trainer(2 + i, client=last and not args.heterogeneous and not args.nat)
        # the byte counters start once every trainer trains: before that, link probes and a download of the first
        # trainer's parameters are the traffic of starting, not of averaging
        start_bytes = None
        # and once more when the swarm's last step is logged: what the trainers sent in training, before the final
        # parameter round (a fixed cost of a run: parameters and optimizer state, once)
        before_final = None
        step_seen, bytes_seen, max_round_bytes = -1, {}, 0.0
        started, next_churn, churn_slot, standby = time.time(), time.time() + args.churn_every, 0, None
        next_churn_step = args.churn_every_steps
        while any(p.running() for p in trainers.values()):
            if time.time() - started > args.timeout:
                raise TimeoutError(f"the scenario did not finish in {args.timeout} s")
            swarm_step = max((r.step for name in trainers for r in read_train_log(workdir / name)[-1:]), default=0)
            if start_bytes is None and all(TRAINING.search(p.output()) for p in trainers.values()):
                start_bytes = {ns: net.tx_bytes(ns) for ns, _ in [*hosts.values(), first_host]}
            if start_bytes is not None and before_final is None and swarm_step > step_seen:
                # each trainer's bytes per global step since the last step change this poll saw (a step's round,
                # and the DHT's chatter meanwhile): the largest is the run's max_round_bytes
                now = {ns: net.tx_bytes(ns) for ns, _ in hosts.values()}
                if step_seen >= 0:
                    steps_between = swarm_step - step_seen
                    per_step = max((now[ns] - bytes_seen[ns]) / steps_between for ns in now)
                    max_round_bytes = max(max_round_bytes, per_step)
                step_seen, bytes_seen = swarm_step, now
            if start_bytes is not None and before_final is None and swarm_step >= args.max_steps:
                before_final = sum(net.tx_bytes(ns) - start_bytes[ns] for ns, _ in hosts.values())
            due = (args.churn_every and time.time() >= next_churn) or (
                args.churn_every_steps and swarm_step >= next_churn_step
            )
            # each replacement is released STANDBY_STEPS global steps before its churn event (or at it, for churn in
            # seconds), and the victim dies once the replacement has joined (at the latest STANDBY_STEPS + 1 steps
            # before the run's last): how long a start takes on a busy machine must not decide whether the
            # replacement meets the survivors before the run ends
            standby_due = args.churn_every_steps and swarm_step >= next_churn_step - STANDBY_STEPS
            # the next replacement is started ahead, held until its release, so that its imports are done by then
            if joiners and not held and standby is None and len(kills) < args.churn_events:
                index = 2 + args.trainers + len(kills)
                start_trainer(index, client=False, newcomer=True, go=workdir / f"go{index}")
            if (due or standby_due) and standby is None and held:
                standby = release(next(iter(held)))
            joined = standby is not None and JOINED.search(trainers[standby].output())
            if due and standby is not None and (joined or swarm_step >= args.max_steps - STANDBY_STEPS - 1):
                alive = [name for name, p in trainers.items() if p.running() and name != standby]
                victim = alive[churn_slot % len(alive)]
                trainers[victim].kill()
                kills.append(time.time())
                churn_slot += 1
                next_churn = time.time() + args.churn_every
                next_churn_step = swarm_step + args.churn_every_steps
                print(f"churn: killed {victim}, started {standby} on a new host", flush=True)
                standby = None
            time.sleep(1)
        start_bytes = start_bytes or {ns: net.tx_bytes(ns) for ns, _ in [*hosts.values(), first_host]}
        sent_by_host = {ns: net.tx_bytes(ns) - start_bytes[ns] for ns, _ in hosts.values()}
        sent = sum(sent_by_host.values())
        before_final = sent if before_final is None else before_final
        # what the first peer sent meanwhile: the DHT's traffic, and with NAT'd trainers, everything it relayed
        first_peer_sent = net.tx_bytes(first_host[0]) - start_bytes[first_host[0]]
        failed = [name for name, p in trainers.items() if p.process.returncode not in (0, -signal.SIGKILL)]
        if failed:
            raise RuntimeError(f"{failed} failed:\n" + trainers[failed[0]].output()[-3000:])
    finally:
        for p in [*trainers.values(), *(process for process, _ in held.values()), *processes]:
            p.stop(timeout=20)
        net.teardown()
    network = {
        "latency_by": latency,
        "round_trip_ms": rtt_ms,
        "switch_ceiling_mbit": ceiling,
        "sent_by_trainer": {name: sent_by_host[host_of[name]] for name in trainers},
        "link_of_trainer": {name: net.links[host_of[name]] for name in trainers},
        "started_at": started_at,
        "first_peer_sent": first_peer_sent,
        "sent_before_final_round": before_final,
        "max_round_bytes": max_round_bytes,
        "hub": net.hub,
        "reachability_checks": checks,
        "nat": nat_of,
        "client": client_of,
        "one_way_ms": {name: net.ports[port_of[name]] for name in trainers},
    }
    return summarize(args, workdir, trainers, kills, sent, network)


def behind_nat(args, index: int) -> bool:
    """--nat N: the last N of the first trainers, and every replacement after churn (a volunteer at home)."""
    return bool(args.nat) and index >= args.trainers - args.nat


def trainer_profile(args, index: int) -> LinkProfile:
    return HETEROGENEOUS[index % len(HETEROGENEOUS)] if args.heterogeneous else PROFILES[args.profile]


def summarize(args, workdir: Path, trainers: dict, kills: list[float], sent_bytes: int, network: dict) -> dict:
    latency, rtt_ms = network["latency_by"], network["round_trip_ms"]
    logs = {name: read_train_log(workdir / name) for name in trainers}
    records = [r for log in logs.values() for r in log]
    steps = sorted({r.step for r in records})
    times = {s: min(r.time for r in records if r.step == s) for s in steps}
    duration = times[steps[-1]] - times[steps[0]]
    step_seconds = duration / max(1, len(steps) - 1)
    compute = sum(r.compute_seconds for r in records) / max(1, len(records))
    # each failure as the trainer logged it (sahajbert.round_log.RoundMonitor), killed trainers' included
    failed_rounds = sum(
        len(re.findall(r"averaging round failed \(", (workdir / f"{n}.log").read_text())) for n in trainers
    )
    lost = 0
    for kill_time in kills:  # the step in progress at the kill: the victim's samples counted but never applied
        step = next((s for s in steps if times[s] > kill_time), None)
        if step is not None:
            applied = sum(r.samples for r in records if r.step == step)
            lost += max(0, args.target_batch_size - applied)
    peers = sum(r.peers for r in records) / max(1, len(records))
    parameters = model_parameters(args.model)
    # compute utilization: each trainer's forward/backward seconds over the wall seconds its records span; training
    # utilization adds the trainer's own optimizer steps (DiLoCo's inner steps), the rest of its local work
    utilization, training = [], []
    for log in logs.values():
        if len(log) >= 2:
            wall = log[-1].time - log[0].time
            utilization.append(sum(r.compute_seconds for r in log[1:]) / wall if wall > 0 else 0.0)
            local = sum(r.compute_seconds + r.optimizer_seconds for r in log[1:])
            training.append(local / wall if wall > 0 else 0.0)
    round_times = [r.round_seconds for r in records if r.round_seconds is not None]
    samples = sum(r.samples for r in records)
    links = network["link_of_trainer"]
    bandwidth = {
        name: {
            "declared_mbit": next((r.bandwidth_mbit for r in reversed(log) if r.bandwidth_mbit is not None), None),
            "shaped_mbit": min(links[name].up_mbit, links[name].down_mbit),
            "sent_bytes": network["sent_by_trainer"][name],
        }
        for name, log in logs.items()
    }
    # a newcomer (started after the first global step): seconds from its start to its first contributed step
    newcomers = []
    state_bytes = state_download_bytes(parameters, args.compression)
    for name, log in logs.items():
        contributed = [r for r in log if r.samples > 0]
        if name in network["started_at"] and steps and network["started_at"][name] > times[steps[0]] and contributed:
            link = links[name]
            serving_up = min(links[other].up_mbit for other in links if other != name)
            bound = 2 * state_bytes * 8 / (min(serving_up, link.down_mbit) * 1e6) + 10
            newcomers.append(
                {"trainer": name, "seconds": contributed[0].time - network["started_at"][name], "bound": bound}
            )
    # each state download after the start, and whether every peer that could have served it was behind NAT (the
    # first peer holds no state; hivemind logs the serving peer only in its averager's own process)
    state_downloads = []
    for name in trainers:
        text = (workdir / f"{name}.log").read_text()
        for _ in re.findall(r"joined at global step \d+|downloaded the swarm's state at global step \d+", text):
            others = [other for other in trainers if other != name and not args.aux]
            state_downloads.append(
                {"trainer": name, "servers_behind_nat": bool(others) and all(network["nat"][o] for o in others)}
            )
    # every trainer that finished cleanly, by its latest checkpoint (written after the final parameter round)
    finishers = [name for name, p in trainers.items() if p.process.returncode == 0]
    final_round = [
        re.findall(r"final parameters averaged by (\d+) peers", (workdir / f"{n}.log").read_text()) for n in finishers
    ]
    finals, final_steps = [], []
    for name in finishers:
        saved = list_checkpoints(workdir / name)
        if saved:
            step, checkpoint = saved[-1]
            finals.append(checkpoint)
            final_steps.append(step)
    agree, difference = checkpoints_agree(finals)
    # what benchmarks/plan_run.py needs to predict this run: each trainer's compute rate and link
    trainer_links = {
        name: {
            "up_mbit": links[name].up_mbit,
            "down_mbit": links[name].down_mbit,
            "one_way_ms": network["one_way_ms"][name],
            "client": network["client"][name],
            "samples_per_compute_second": sum(r.samples for r in log) / max(1e-9, sum(r.compute_seconds for r in log)),
        }
        for name, log in logs.items()
        if log
    }
    return {
        "network": network["hub"],
        "target_batch_size": args.target_batch_size,
        "lockstep": args.lockstep,
        "trainer_links": trainer_links,
        "model": args.model,
        "parameters": parameters,
        "balance": args.balance,
        "heterogeneous": args.heterogeneous,
        "switch_ceiling_mbit": network["switch_ceiling_mbit"],
        "compute_utilization": sum(utilization) / len(utilization) if utilization else 0.0,
        "training_utilization": sum(training) / len(training) if training else 0.0,
        "bytes_per_sample": sent_bytes / max(1, samples),
        # the same in training: up to the swarm's last step (polled each second), without the final round
        "bytes_per_sample_training": network["sent_before_final_round"] / max(1, samples),
        # the most bytes one trainer sent per global step between two step changes the poll saw (each second): with
        # a round per step, its largest round, plus the DHT's chatter of that step
        "max_round_bytes": network["max_round_bytes"],
        "seconds_per_round": sum(round_times) / len(round_times) if round_times else None,
        "bandwidth": bandwidth,
        "newcomers": newcomers,
        "nat": network["nat"],
        "state_downloads": state_downloads,
        "reachability_checks": network["reachability_checks"],
        "first_peer_bytes_per_step": network["first_peer_sent"] / max(1, len(steps)),
        "profile": args.profile,
        "latency_by": latency,
        "round_trip_ms": rtt_ms,
        "compression": args.compression,
        "aux": args.aux,
        "trainers": args.trainers,
        "churn_events": len(kills),
        "global_steps": steps[-1],
        "steps_per_minute": 60 * (len(steps) - 1) / duration if duration else 0.0,
        "seconds_per_step": step_seconds,
        "compute_seconds_per_step": compute,
        # bytes counted from the moment every trainer trained, over every record (the final round included)
        "bytes_per_peer_step": sent_bytes / max(1, len(records)),
        # the butterfly volume of every step's two rounds, plus the final parameter round spread over the steps
        "ideal_bytes_per_peer_step": ideal_bytes_per_step(
            parameters, peers, args.compression, diloco=args.diloco_inner_steps > 0
        )
        + final_round_bytes(parameters, final_round, args.compression) / max(1, len(steps)),
        "failed_rounds": failed_rounds,
        "samples_lost_to_churn": lost,
        "steps_after_last_churn": sum(times[s] > kills[-1] for s in steps) if kills else len(steps),
        "peers_at_the_end": len(finals),
        "final_steps": sorted(final_steps),  # the step labels of their final checkpoints
        # peers in the final parameter round, as each finisher saw it (0: it found nobody)
        "final_round_peers": sorted(int(found[-1]) if found else 0 for found in final_round),
        "max_parameter_difference": difference,
        "parameters_agree": agree,
        "diloco_inner_steps": args.diloco_inner_steps,
        "diloco_overlap": args.diloco_overlap,
        "pseudo_gradient_compression": args.pseudo_gradient_compression,
        "diloco_fragments": args.diloco_fragments,
        # the swarm's loss by the samples it had trained: each global step's mean loss over its peers' passes
        "curve": loss_curve(records),
    }


def loss_curve(records) -> list[dict]:
    """Per global step: the samples the swarm had trained by its end, and the mean loss of its passes."""
    curve, total = [], 0
    for step in sorted({r.step for r in records}):
        at = [r for r in records if r.step == step]
        total += sum(r.samples for r in at)
        passes = sum(r.mini_steps for r in at)
        if passes:
            curve.append({"step": step, "samples": total, "loss": sum(r.loss * r.mini_steps for r in at) / passes})
    return curve


def print_table(result: dict) -> None:
    shaping = {
        "netem": "tc netem: latency and bandwidth",
        "switch": "tc tbf bandwidth, latency by delayswitch.py (this kernel has no sch_netem)",
    }[result["latency_by"]]
    print(
        f"\nprofile={result['profile']} ({shaping}), compression={result['compression']}, "
        f"aux={'assisting' if result['aux'] else 'none'}, trainers={result['trainers']}, "
        f"churn events={result['churn_events']}, behind NAT={sum(result['nat'].values())}\n"
    )
    ceiling = result["switch_ceiling_mbit"]
    rows = [
        ("model (parameters)", f"{result['model']} ({result['parameters']:,})"),
        ("bandwidth balance", result["balance"] + (" (heterogeneous links)" if result["heterogeneous"] else "")),
        ("delay switch forwarding ceiling (measured)", f"{ceiling:.0f} Mbit/s" if ceiling else "n/a (kernel bridge)"),
        ("round trip between trainers (measured)", f"{result['round_trip_ms']:.1f} ms"),
        ("global steps", f"{result['global_steps']}"),
        ("global steps per minute", f"{result['steps_per_minute']:.2f}"),
        ("seconds per global step", f"{result['seconds_per_step']:.2f}"),
        ("  of which compute (forward/backward)", f"{result['compute_seconds_per_step']:.2f}"),
        ("  of which averaging and waiting", f"{result['seconds_per_step'] - result['compute_seconds_per_step']:.2f}"),
        ("compute utilization (compute / wall seconds per trainer)", f"{result['compute_utilization']:.1%}"),
        ("  with the trainer's own optimizer steps (DiLoCo's inner steps)", f"{result['training_utilization']:.1%}"),
        (
            "seconds per gradient all-reduce round",
            f"{result['seconds_per_round']:.2f}" if result["seconds_per_round"] is not None else "none finished",
        ),
        ("bytes sent per peer per global step", f"{result['bytes_per_peer_step']:,.0f}"),
        ("ideal all-reduce bytes per peer per step", f"{result['ideal_bytes_per_peer_step']:,.0f}"),
        ("bytes sent by all trainers per sample trained", f"{result['bytes_per_sample']:,.0f}"),
        ("  up to the last step (without the final parameter round)", f"{result['bytes_per_sample_training']:,.0f}"),
        ("most bytes one trainer sent in one global step's round", f"{result['max_round_bytes']:,.0f}"),
        ("failed averaging rounds", f"{result['failed_rounds']}"),
        ("samples lost to churn", f"{result['samples_lost_to_churn']}"),
        ("global steps after the last churn event", f"{result['steps_after_last_churn']}"),
        ("final peers (their last step labels)", f"{result['peers_at_the_end']} ({result['final_steps']})"),
        ("peers in the final parameter round, per finisher", f"{result['final_round_peers']}"),
        ("max parameter difference between the final peers", f"{result['max_parameter_difference']:.2e}"),
        (
            f"parameters agree (atol {AGREEMENT_ATOL:g}, rtol {AGREEMENT_RTOL:g})",
            "yes" if result["parameters_agree"] else "NO",
        ),
    ]
    for name, b in result["bandwidth"].items():
        declared = f"{b['declared_mbit']:.1f}" if b["declared_mbit"] is not None else "none"
        rows.append(
            (
                f"{name}: declared / shaped Mbit/s, bytes sent",
                f"{declared} / {b['shaped_mbit']:g}, {b['sent_bytes']:,}",
            )
        )
    if any(result["nat"].values()):
        rows.append(("trainers behind NAT", ", ".join(name for name, nat in result["nat"].items() if nat)))
        rows.append(
            (
                "first peer's bytes sent per global step (DHT, and all it relayed)",
                f"{result['first_peer_bytes_per_step']:,.0f}",
            )
        )
    for situation, line in result["reachability_checks"].items():
        rows.append((f"run_trainer.py --check, {situation}", line.replace("|", "/")))
    for download in result["state_downloads"]:
        served_by = "a peer behind NAT (no other holds the state)" if download["servers_behind_nat"] else "a peer"
        rows.append((f"{download['trainer']}: state downloaded from", served_by))
    for newcomer in result["newcomers"]:
        rows.append(
            (
                f"{newcomer['trainer']} (newcomer): seconds to its first contribution (bound)",
                f"{newcomer['seconds']:.1f} ({newcomer['bound']:.1f})",
            )
        )
    print("| measurement | value |\n|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value} |")


def print_comparison(results: list[dict]) -> None:
    """--balance compare: the equal split and bandwidth balancing side by side."""
    print("\n| measurement | " + " | ".join(f"balance={r['balance']}" for r in results) + " |")
    print("|---|" + "---:|" * len(results))
    keys = (
        ("seconds per gradient all-reduce round", "seconds_per_round", "{:.2f}"),
        ("seconds per global step", "seconds_per_step", "{:.2f}"),
        ("compute utilization", "compute_utilization", "{:.1%}"),
        ("failed averaging rounds", "failed_rounds", "{}"),
        ("bytes sent per sample", "bytes_per_sample", "{:,.0f}"),
    )
    for title, key, form in keys:
        cells = [form.format(r[key]) if r[key] is not None else "n/a" for r in results]
        print(f"| {title} | " + " | ".join(cells) + " |")
    for name in results[0]["bandwidth"]:
        cells = [f"{r['bandwidth'][name]['sent_bytes']:,}" for r in results]
        shaped = results[0]["bandwidth"][name]["shaped_mbit"]
        print(f"| {name} ({shaped:g} Mbit/s) bytes sent | " + " | ".join(cells) + " |")
    if len(results) == 2 and all(r["seconds_per_round"] for r in results):
        speedup = results[0]["seconds_per_round"] / results[1]["seconds_per_round"]
        print(f"\nbandwidth balancing: {speedup:.2f}x faster rounds than the equal split")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--profile", choices=sorted(PROFILES), default="broadband", help="link profile of every trainer"
    )
    parser.add_argument(
        "--compression", choices=["none", "fp16", "8bit"], default="fp16", help="averaging compression"
    )
    parser.add_argument("--aux", action="store_true", help="add an aux peer that assists averaging")
    parser.add_argument("--trainers", type=int, default=3, help="trainer peers (from 3 on, the last in client mode)")
    parser.add_argument("--churn_every", type=float, default=0.0, help="seconds between churn events (0: none)")
    parser.add_argument(
        "--churn_every_steps",
        type=int,
        default=0,
        help="global steps of the swarm between churn events (0: none); unlike seconds, the same on any machine",
    )
    parser.add_argument("--churn_events", type=int, default=1, help="most churn events in the run")
    parser.add_argument("--max_steps", type=int, default=12, help="global steps the run trains for")
    parser.add_argument("--target_batch_size", type=int, default=384, help="samples per global step")
    parser.add_argument("--model", default="tiny", help="model preset")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8, help="samples per pass of every trainer")
    parser.add_argument(
        "--diloco_inner_steps",
        type=int,
        default=0,
        help="DiLoCo: inner steps per outer step (0: synchronous data parallelism, the default)",
    )
    parser.add_argument(
        "--diloco_overlap", action="store_true", help="DiLoCo: every trainer's --diloco_overlap (background rounds)"
    )
    parser.add_argument(
        "--pseudo_gradient_compression",
        default="8bit",
        choices=["8bit", "sparse"],
        help="DiLoCo: every trainer's --pseudo_gradient_compression (sparse: SparseLoCo's top-k with error feedback)",
    )
    parser.add_argument(
        "--diloco_fragments", type=int, default=1, help="DiLoCo: every trainer's --diloco_fragments (needs sparse)"
    )
    parser.add_argument("--outer_lr", type=float, default=None, help="DiLoCo: every trainer's --outer_lr")
    parser.add_argument("--learning_rate", type=float, default=None, help="every trainer's --learning_rate")
    parser.add_argument("--total_steps", type=int, default=None, help="every trainer's --total_steps (schedule)")
    parser.add_argument(
        "--metadata_expiration", type=float, default=15.0, help="seconds a progress report lives; short under churn"
    )
    for name in TIMING_FLAGS:  # the trainers' automatic timing unless given (sahajbert.adaptive)
        parser.add_argument(f"--{name}", type=float, default=None, help=f"every peer's --{name} (default: automatic)")
    parser.add_argument(
        "--heterogeneous",
        action="store_true",
        help="trainer links 200/200, 100/20 and 20/5 Mbit/s (cycled) instead of one --profile; no client-mode peer",
    )
    parser.add_argument(
        "--balance",
        choices=["bandwidth", "equal", "compare"],
        default="bandwidth",
        help="bandwidth: each peer declares its measured bandwidth (the default); equal: all declare 100 Mbit/s "
        "(the references); compare: run both, one after the other, and print them side by side",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the scenario is abandoned")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the smallest scenario: 2 trainers, one churn event at the swarm's step 3 of 8",
    )
    parser.add_argument("--output_json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--lockstep", action="store_true", help="trainers without delayed updates (DPU off)")
    parser.add_argument(
        "--nat",
        type=int,
        default=0,
        help="put the last N trainers, and every replacement after churn, behind NAT routers (iptables "
        "masquerade: only replies come in); they reach each other through the first peer's relay",
    )
    parser.add_argument(
        "--newcomer_without_relay",
        action="store_true",
        help="replacements after churn start with --no_auto_relay: behind NAT (--nat) they fall back to client mode",
    )
    parser.add_argument("--keep_logs", default=None, help="copy every peer's log and train log to this folder")
    args = parser.parse_args(argv)
    if args.quick:
        # churn at the swarm's step 3 of 8: global steps after it, whatever the machine's speed
        args.trainers, args.max_steps, args.churn_every_steps, args.churn_events = 2, 8, 3, 1
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print("error: netswarm.py needs root and iproute2 (ip, tc) to build network namespaces", file=sys.stderr)
        return 2
    args.latency_by = "netem" if netem_available() else "switch"
    if args.nat and not shutil.which("iptables"):
        print("error: --nat needs iptables for its NAT routers: apt-get install iptables", file=sys.stderr)
        return 2
    if not 0 <= args.nat <= args.trainers:
        print(f"error: --nat {args.nat}: between 0 and --trainers ({args.trainers})", file=sys.stderr)
        return 2
    if args.latency_by == "switch" and not shutil.which("ethtool"):
        print("error: no sch_netem here; the latency switch needs ethtool: apt-get install ethtool", file=sys.stderr)
        return 2
    tag = f"{os.getpid() % 10000}"

    def interrupted(signum, frame):
        raise KeyboardInterrupt  # unwinds through run_scenario's cleanup

    signal.signal(signal.SIGTERM, interrupted)
    results = []
    for balance in ("equal", "bandwidth") if args.balance == "compare" else (args.balance,):
        with tempfile.TemporaryDirectory(prefix="netswarm-") as tmp:
            try:
                results.append(run_scenario(argparse.Namespace(**{**vars(args), "balance": balance}), Path(tmp), tag))
            except KeyboardInterrupt:
                print("interrupted: namespaces and processes removed", file=sys.stderr)
                return 130
            except (TimeoutError, RuntimeError) as e:  # a hung or failed peer: its log tail is in the message
                print(f"error: {e} (namespaces and processes removed)", file=sys.stderr)
                return 1
            finally:
                if args.keep_logs:
                    shutil.copytree(
                        tmp,
                        Path(args.keep_logs) / balance if args.balance == "compare" else args.keep_logs,
                        dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.safetensors", "*.pt"),
                    )
        print_table(results[-1])
    if len(results) > 1:
        print_comparison(results)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results if len(results) > 1 else results[0], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
