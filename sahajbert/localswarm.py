"""Peers as local processes on 127.0.0.1: the demo swarm, the benchmarks and the integration tests use this.

Callers name the repository's scripts by path (the package does not know where a checkout keeps them).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from sahajbert.samples import SAMPLE_FILES, SAMPLE_NAME

LOOPBACK = ["--host_maddrs", "/ip4/127.0.0.1/tcp/0"]


def tiny_trainer_flags(host: str = "127.0.0.1", **overrides) -> list[str]:
    """Trainer flags for the tiny ALBERT on the bundled sample, for demos, benchmarks and tests on CPUs.

    It learns visibly within a few global steps. A global step (384 samples) takes a few seconds on 2 cores. The
    averaging timing is the trainer's own automatic one (sahajbert.adaptive), as a volunteer gets it. `overrides`
    replace flags by name (max_steps=5 -> --max_steps 5).
    """
    flags = {
        "model": "tiny",
        "tokenizer_path": SAMPLE_NAME,
        "max_seq_length": 64,
        "per_device_train_batch_size": 8,
        "target_batch_size": 384,
        # LAMB as the references ran it takes small early steps (its bias correction scales the step size): at 0.1 the
        # tiny model's loss falls from 8.29 to 8.03 in 10 steps of 384 samples (0.02 gave 8.22)
        "learning_rate": 0.1,
        "warmup_steps": 1,
        "total_steps": 200,
        "log_every_seconds": 5,
        "shuffle_buffer": 200,
        "host_maddrs": f"/ip4/{host}/tcp/0",
        **overrides,
    }
    return [item for name, value in flags.items() for item in (f"--{name}", str(value))] + [
        "--data_files",
        *SAMPLE_FILES,
    ]


def stop_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt in a harness that starts peers, so its `finally` stops them. A shell
    starts a background job with SIGINT ignored (nohup ... &), which Python inherits: without this, Ctrl+C or kill
    would leave the peers running. Later signals are ignored while the peers stop (tens of seconds at most)."""

    def stop(signum, frame):
        for ignored in (signal.SIGINT, signal.SIGTERM):  # a second signal would cut the peers' stops short
            signal.signal(ignored, signal.SIG_IGN)
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)


def peer_env() -> dict:
    """Offline, unbuffered, one math thread per peer (several peers share the machine's cores)."""
    return {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


class PeerProcess:
    """One of this repository's scripts running as its own process, output captured to `log_path`."""

    def __init__(
        self,
        script: str | Path,
        args: list[str],
        log_path: Path,
        python: str = sys.executable,
        wrapper: list[str] = (),
    ):
        """`script`: the script's path; `wrapper` prefixes the command, e.g. ["ip", "netns", "exec", "ns1"] to run
        the peer in a namespace. The peer runs in the caller's working directory."""
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        # its own session: the peer and everything it starts (hivemind's processes, p2pd) form one process group
        self.process = subprocess.Popen(
            [*wrapper, python, str(script), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=peer_env(),
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def running(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(
                f"{self.log_path.name} did not exit in {timeout:.0f} s:\n{self.output()[-3000:]}"
            ) from e

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """SIGKILL the whole peer at once, as a crash or a closed laptop would (its process group included)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(10)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGINT (a clean stop), then SIGKILL for the whole process group if it does not exit in time."""
        if self.running():
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        try:  # whatever a crashed peer left in its group (p2pd, averagers)
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


def wait_for(condition, timeout: float, what: str, interval: float = 0.5):
    """Poll `condition` until it returns something truthy; TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def start_first_peer(
    script: str | Path, log_dir: Path, run_id: str, extra: list[str] = ()
) -> tuple[PeerProcess, list[str]]:
    """Start `script` (run_first_peer.py) on loopback, with `extra` flags, and return it with the multiaddrs others
    join through."""
    peer = PeerProcess(script, ["--run_id", run_id, *LOOPBACK, *extra], Path(log_dir) / "first_peer.log")

    def address():
        for line in peer.output().splitlines():
            if "--initial_peers " in line:
                return [word for word in line.split("--initial_peers ", 1)[1].split() if word.startswith("/")]
        if not peer.running():
            raise RuntimeError(f"the first peer exited:\n{peer.output()[-3000:]}")
        return None

    return peer, wait_for(address, 60, "the first peer's --initial_peers line")


# fp16-compressed averaging keeps peers this close: |a - b| <= atol + rtol * |b| for every entry
AGREEMENT_ATOL, AGREEMENT_RTOL = 2e-3, 1e-2


def checkpoints_agree(checkpoints: list[Path]) -> tuple[bool, float]:
    """Do these checkpoints hold the same parameters within fp16 averaging tolerance? (agree, max difference)"""
    from safetensors.torch import load_file

    finals = [load_file(Path(checkpoint) / "model.safetensors") for checkpoint in checkpoints]
    pairs = [(a[k], b[k]) for a, b in zip(finals, finals[1:]) for k in a]
    difference = max((float((a - b).abs().max()) for a, b in pairs), default=0.0)
    agree = all(bool(((a - b).abs() <= AGREEMENT_ATOL + AGREEMENT_RTOL * b.abs()).all()) for a, b in pairs)
    return agree, difference
