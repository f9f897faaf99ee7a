"""What the aux peer knows about the swarm: per-step history and per-peer contributions (no I/O here)."""

import hashlib
import math
from dataclasses import dataclass

from sahajbert.records import LocalMetrics, StepEntry


def peer_name(public_key: bytes) -> str:
    """A short, stable name for a peer whose record names no peer id: the first 8 hex digits of its key's SHA-256."""
    return hashlib.sha256(public_key).hexdigest()[:8]


@dataclass
class PeerStats:
    name: str  # the peer id as the peer's own log prints it (base58)
    step: int = 0
    samples_per_second: float = 0.0
    samples_contributed: int = 0  # as the peer counts them: its samples in global steps since it started
    status: str = "training"  # training | finished | stopped | departed
    last_seen: float = 0.0  # unix time of the last new record


@dataclass(frozen=True)
class FinalModel:
    step: int
    source: str  # the peer it was downloaded from
    checkpoint: str


class SwarmMonitor:
    """Feed it the validated records from the DHT; it keeps one history point per global step from the steps the
    trainers' records carry (each repeats its last metrics.RECENT_STEPS steps), whenever it reads them."""

    def __init__(self, run_id: str, max_history: int = 10_000):
        self.run_id, self.max_history = run_id, max_history
        self.entries: dict[tuple[str, int], StepEntry] = {}  # (peer, step) -> that peer's part in that step
        self.history: list[dict] = []  # one point per global step seen, oldest first
        self.peers: dict[str, PeerStats] = {}
        self.final: FinalModel | None = None

    def update(self, records: dict[bytes, LocalMetrics], now: float, live_peers: set[str] | None = None) -> list[dict]:
        """Record what peers report; return the history points of global steps not seen before, oldest first.
        `live_peers`: the peer ids (base58) that report training progress now; a training peer not among them has
        departed (None: unknown)."""
        known = {point["step"] for point in self.history}
        for key, record in records.items():
            name = record.peer_id or peer_name(key)
            stats = self.peers.setdefault(name, PeerStats(name))
            if (record.step, record.status, record.samples_contributed) != (
                stats.step,
                stats.status,
                stats.samples_contributed,
            ):
                stats.last_seen = now
            stats.step, stats.status = record.step, record.status
            stats.samples_per_second = record.samples_per_second
            stats.samples_contributed = max(stats.samples_contributed, record.samples_contributed)
            entries = record.recent or [_entry_of(record)]
            for entry in entries:
                self.entries[(name, entry.step)] = entry
        for stats in self.peers.values():
            if live_peers is not None and stats.status in ("training", "departed"):
                stats.status = "training" if stats.name in live_peers else "departed"
        self.history = _history(self.entries)[-self.max_history :]
        return [point for point in self.history if point["step"] not in known]

    @property
    def global_step(self) -> int:
        return max([point["step"] for point in self.history] + [p.step for p in self.peers.values()], default=0)

    def alive_peers(self) -> int:
        return sum(stats.status == "training" for stats in self.peers.values())

    def run_status(self) -> str:
        """One line on how the run stands: training, or ended (and where its final model is)."""
        if not self.peers:
            return "waiting for the trainers' first global step"
        if self.alive_peers() or not any(stats.status == "finished" for stats in self.peers.values()):
            return f"training: global step {self.global_step}"
        if self.final is not None:
            return f"run finished at step {self.final.step}; final model: {self.final.checkpoint}"
        return f"run finished at step {self.global_step}"

    def state(self, now: float) -> dict:
        """Everything the dashboard shows, as JSON-ready data."""
        latest = self.history[-1] if self.history else {}
        peers = sorted(self.peers.values(), key=lambda p: -p.samples_contributed)
        return {
            "run_id": self.run_id,
            "global_step": self.global_step,
            "alive_peers": self.alive_peers(),
            "loss": latest.get("loss"),
            "samples_per_second": latest.get("samples_per_second", 0.0),
            "run_status": self.run_status(),
            "final_model": None if self.final is None else self.final.__dict__,
            "history": self.history,
            "peers": [
                {
                    "peer": p.name,
                    "status": p.status,
                    "step": p.step,
                    "samples_contributed": p.samples_contributed,
                    "samples_per_second": p.samples_per_second,
                    "last_seen_seconds_ago": round(now - p.last_seen, 1),
                }
                for p in peers
            ],
        }


def _entry_of(record: LocalMetrics) -> StepEntry:
    """The step a record without its recent steps reports (a record of an older trainer)."""
    return StepEntry(
        step=record.step,
        loss=record.loss,
        mini_steps=record.mini_steps,
        samples=record.samples_accumulated,
        samples_per_second=record.samples_per_second,
    )


def _history(entries: dict[tuple[str, int], StepEntry]) -> list[dict]:
    """One point per global step: the mean loss per mini-step of the peers in it, their samples and samples/s, and
    how many peers took part."""
    steps: dict[int, list[StepEntry]] = {}
    for (_, step), entry in entries.items():
        steps.setdefault(step, []).append(entry)
    points = []
    for step in sorted(steps):
        parts = steps[step]
        mini_steps = sum(part.mini_steps for part in parts)
        loss = sum(part.loss for part in parts) / mini_steps if mini_steps else math.nan
        points.append(
            {
                "step": step,
                "loss": None if math.isnan(loss) else loss,
                "samples": sum(part.samples for part in parts),
                "samples_per_second": sum(part.samples_per_second for part in parts),
                "peers": len(parts),
            }
        )
    return points
