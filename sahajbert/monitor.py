"""What the aux peer knows about the swarm: per-step history and per-peer contributions (no I/O here)."""

import hashlib
import math
from dataclasses import asdict, dataclass, field

from sahajbert.metrics import LocalMetrics, SwarmSummary, aggregate


def peer_name(public_key: bytes) -> str:
    """A short, stable name for a peer in tables: the first 8 hex digits of its public key's SHA-256."""
    return hashlib.sha256(public_key).hexdigest()[:8]


@dataclass
class PeerStats:
    name: str
    step: int = 0
    samples_per_second: float = 0.0
    samples_contributed: int = 0  # summed over the distinct global steps this peer reported
    last_seen: float = 0.0  # unix time of the last new record
    _counted_steps: set = field(default_factory=set, repr=False)


class SwarmMonitor:
    """Feed it the validated records from the DHT; it tells when a new global step was reported."""

    def __init__(self, run_id: str, max_history: int = 10_000):
        self.run_id, self.max_history = run_id, max_history
        self.history: list[dict] = []  # one entry per global step seen, oldest first
        self.peers: dict[str, PeerStats] = {}
        self.latest: SwarmSummary | None = None

    def update(self, records: dict[bytes, LocalMetrics], now: float) -> SwarmSummary | None:
        """Record what peers report; return the swarm summary if it is for a step not seen before."""
        for key, record in records.items():
            stats = self.peers.setdefault(peer_name(key), PeerStats(peer_name(key)))
            if record.step not in stats._counted_steps:
                stats._counted_steps.add(record.step)
                stats.samples_contributed += record.samples_accumulated
                stats.last_seen = now
            stats.step, stats.samples_per_second = record.step, record.samples_per_second
        summary = aggregate(list(records.values()))
        if summary is None or (self.latest is not None and summary.step <= self.latest.step):
            return None
        self.latest = summary
        entry = asdict(summary)
        entry["loss"] = None if math.isnan(summary.loss) else summary.loss
        self.history = (self.history + [{**entry, "time": now}])[-self.max_history :]
        return summary

    def state(self, now: float) -> dict:
        """Everything the dashboard shows, as JSON-ready data."""
        latest = asdict(self.latest) if self.latest else {}
        if latest and math.isnan(latest["loss"]):
            latest["loss"] = None
        peers = sorted(self.peers.values(), key=lambda p: -p.samples_contributed)
        return {
            "run_id": self.run_id,
            "global_step": latest.get("step", 0),
            "alive_peers": latest.get("alive_peers", 0),
            "loss": latest.get("loss"),
            "samples_per_second": latest.get("samples_per_second", 0.0),
            "history": self.history,
            "peers": [
                {
                    "peer": p.name,
                    "step": p.step,
                    "samples_contributed": p.samples_contributed,
                    "samples_per_second": p.samples_per_second,
                    "last_seen_seconds_ago": round(now - p.last_seen, 1),
                }
                for p in peers
            ],
        }
