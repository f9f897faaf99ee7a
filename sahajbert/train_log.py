"""A trainer's history: one typed record per global step it saw, one JSON line each in `train_log.jsonl`.

The trainer writes it; the demo's summary, the tests and the benchmarks read it with `read_train_log`.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

LOG_FILE = "train_log.jsonl"


@dataclass(frozen=True)
class StepRecord:
    """What one trainer saw of one global step of the swarm."""

    step: int  # the global step just made
    loss: float  # this peer's mean loss per mini-step in that step
    mini_steps: int  # passes this peer computed toward it
    samples: int  # samples this peer contributed to it
    peers: int  # peers the progress tracker counted at that step
    samples_per_second: float  # this peer's throughput as hivemind measured it
    time: float  # unix time the step was recorded
    compute_seconds: float  # of this peer's time toward the step, forward and backward only
    failed_rounds: int = 0  # averaging rounds hivemind reported failed, since this peer started
    round_seconds: float | None = None  # the last gradient all-reduce: from the step that triggered it to its end
    bandwidth_mbit: float | None = None  # what this peer declared to the averagers (None: equal shares)
    # of this peer's time toward the step, in its own optimizer steps (DiLoCo's inner steps; 0 in synchronous
    # training, whose optimizer steps with the swarm's)
    optimizer_seconds: float = 0.0


class TrainLog:
    """Appends records to `output_dir/train_log.jsonl`, one line each, flushed at once (a crash keeps them)."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOG_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: StepRecord) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(record)) + "\n")


def read_train_log(output_dir: str | Path) -> list[StepRecord]:
    """A trainer's records, oldest first ([] if it wrote none)."""
    path = Path(output_dir) / LOG_FILE
    if not path.exists():
        return []
    return [StepRecord(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
