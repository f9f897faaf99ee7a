"""run_trainer.py --check: a checklist of what a volunteer's machine needs, each failure with its fix."""

import resource
import shutil
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from sahajbert.cli import UserError
from sahajbert.flags import PeerArguments

DISTRIBUTION = "sahajbert-collab"  # this project's name on pip: its metadata holds requirements.txt's ranges
WANTED_OPEN_FILES = (
    16_384  # hivemind keeps many sockets open; the common default of 1024 runs out ("too many open files")
)


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str
    fix: str = ""

    def line(self) -> str:
        mark = {"ok": "[ ok ]", "warn": "[warn]", "fail": "[FAIL]"}[self.status]
        return f"{mark} {self.name}: {self.detail}" + (f"\n       fix: {self.fix}" if self.fix else "")


def check_open_files() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < WANTED_OPEN_FILES:
        target = WANTED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(WANTED_OPEN_FILES, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft >= WANTED_OPEN_FILES:
        return Check("open-files limit", "ok", f"{soft} (raised for this process where it was lower)")
    return Check(
        "open-files limit",
        "fail",
        f"{soft}, hard limit {hard}",
        f"run `ulimit -n {WANTED_OPEN_FILES}` before starting (or raise the hard limit in limits.conf)",
    )


def check_versions(packages=("torch", "transformers", "hivemind", "datasets", "tokenizers")) -> Check:
    """Installed versions against the ranges this project declares (requirements.txt, the ones the tests run with)."""
    from packaging.requirements import Requirement

    try:
        declared = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return Check("versions", "fail", f"{DISTRIBUTION} is not installed", "pip install -e . (from the checkout)")
    wanted = {requirement.name.lower(): requirement for requirement in map(Requirement, declared)}
    problems, found = [], []
    for name in packages:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name} missing")
            continue
        found.append(f"{name} {version}")
        if name in wanted and not wanted[name].specifier.contains(version, prereleases=True):
            problems.append(f"{name} {version} not in {wanted[name].specifier}")
    if problems:
        return Check("versions", "fail", "; ".join(problems), "pip install -r requirements.txt")
    return Check("versions", "ok", ", ".join(found))


def checkpoint_bytes(model: str, tokenizer_size: int = 32_000) -> int:
    """Disk for one checkpoint: fp32 weights plus LAMB's two moments (3 copies of the parameters)."""
    from sahajbert.model import count_parameters, read_config

    config = read_config(model)
    config.vocab_size = max(config.vocab_size, tokenizer_size)
    return count_parameters(config) * 4 * 3


def check_disk(output_dir: str, model: str, keep: int) -> Check:
    folder = Path(output_dir).resolve()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    needed = checkpoint_bytes(model) * (keep + 1)  # +1: the new one is written before the oldest is removed
    detail = f"{free / 2**30:.1f} GiB free at {folder}, {needed / 2**30:.2f} GiB needed for {keep} checkpoints"
    if free < needed:
        return Check("disk space", "fail", detail, "free some space, lower --keep_checkpoints or change --output_dir")
    return Check("disk space", "ok", detail)


def check_memory(peer_args: PeerArguments) -> Check:
    """The trainer's estimated peak memory (sahajbert.memory) against what this machine has free now."""
    from sahajbert.devices import describe_device, trainer_precision
    from sahajbert.memory import check_fit, free_memory

    training_args = peer_args.training_args
    device = describe_device(training_args.device)
    precision = trainer_precision(device, training_args.precision, bool(peer_args.optimizer_args.diloco_inner_steps))
    host_free, device_free = free_memory(device)
    fit = check_fit(peer_args, device, precision, host_free, device_free)
    if fit.fits:
        return Check("memory", "ok", fit.line())
    # within the estimate's own error of what is free: it may fit, or be stopped by the system when it does not
    tight = fit.estimate.host_bytes <= fit.host_free and (
        device_free is None or fit.estimate.device_bytes <= device_free
    )
    return Check("memory", "warn" if tight else "fail", fit.line() + ("; tight" if tight else ""), fit.advice)


# what a volunteer behind NAT does for direct connections (faster, and no load on the relay)
FORWARD_PORT = (
    "forward a TCP port on your router to this machine, then pass --host_maddrs /ip4/0.0.0.0/tcp/PORT "
    "--announce_maddrs /ip4/YOUR_PUBLIC_IP/tcp/PORT"
)


def check_reachability(reach) -> Check:
    """How other peers reach this one (sahajbert.swarm.reachability), with what to do about it."""
    name = "reachable from outside"
    if reach.kind == "client":
        return Check(name, "ok", "client mode: no incoming connections needed (this peer serves nobody)")
    if reach.kind == "public":
        return Check(name, "ok", f"public address {reach.address} (not dialed back)")
    if reach.kind == "relayed":
        return Check(
            name,
            "ok",
            f"behind NAT, reachable through the relay {reach.address.split('/p2p-circuit')[0]}: this peer averages "
            "and serves the state like any other, its traffic passing through that relay",
            f"optional, for direct connections: {FORWARD_PORT}",
        )
    if reach.kind == "unreachable":
        return Check(
            name,
            "warn",
            "behind NAT and not reachable through a relay: others cannot connect to it (a trainer then joins in "
            "client mode by itself, and serves nobody)",
            f"leave --auto_relay on (the default) with a first peer of this version, which relays; or {FORWARD_PORT}",
        )
    return Check(
        name,
        "warn",
        "only private or loopback addresses, and no public relay to test against",
        f"fine on one network; across the internet add --client_mode, or {FORWARD_PORT}",
    )


# an invite-only run: what a volunteer without a valid invite does
INVITE_FIX = "pass --invite NAME:SECRET exactly as the organizer sent it (ask them for one if you have none)"


def run_checks(peer_args: PeerArguments) -> list[Check]:
    """All checks, in the order a volunteer would fix them."""
    swarm_args, training_args = peer_args.swarm_args, peer_args.training_args
    import hivemind

    from sahajbert.access import InviteRequired
    from sahajbert.swarm import (
        UNREACHABLE_FIX,
        admission,
        build_dht,
        quiet_hivemind,
        reachability,
        validate_initial_peers,
    )

    quiet_hivemind(swarm_args.verbose)  # the checklist is the output: hivemind's INFO lines only with --verbose

    checks = [
        check_versions(),
        check_open_files(),
        check_disk(training_args.output_dir, peer_args.model_args.model, training_args.keep_checkpoints),
        check_memory(peer_args),
    ]
    try:
        validate_initial_peers(swarm_args.initial_peers)
    except UserError as e:
        return checks + [Check("initial peers", "fail", str(e), "copy the line that run_first_peer.py printed")]
    started = time.monotonic()
    try:
        local = hivemind.DHT(start=True, host_maddrs=swarm_args.host_maddrs, client_mode=True)
        local.shutdown()
        checks.append(Check("p2pd starts", "ok", f"libp2p daemon up in {time.monotonic() - started:.1f} s"))
    except Exception as e:
        return checks + [
            Check(
                "p2pd starts",
                "fail",
                f"{type(e).__name__}: {e}",
                "reinstall hivemind (pip install --force-reinstall hivemind); it ships p2pd",
            )
        ]
    if not swarm_args.initial_peers:
        return checks + [
            Check(
                "initial peers", "fail", "none given", "pass --initial_peers with the line run_first_peer.py printed"
            )
        ]
    started = time.monotonic()
    try:
        swarm_args, membership = admission(swarm_args)
    except UserError as e:
        return checks + [Check("invite", "fail", str(e), INVITE_FIX)]
    if membership is not None:
        checks.append(Check("invite", "ok", f"'{membership.invite.name}' accepted by the organizer's peer"))
    try:
        dht = build_dht(swarm_args, authorizer=membership.authorizer if membership is not None else None)
    except InviteRequired as e:
        return checks + [Check("invite", "fail", str(e), INVITE_FIX)]
    except UserError as e:
        detail = str(e).split(f". {UNREACHABLE_FIX}")[0]  # the fix has its own line
        return checks + [Check("initial peers answer", "fail", detail, UNREACHABLE_FIX)]
    try:
        checks.append(Check("initial peers answer", "ok", f"joined in {time.monotonic() - started:.1f} s"))
        checks.append(check_reachability(reachability(dht, swarm_args)))
    finally:
        dht.shutdown()
    return checks
