"""Does this peer's DHT show it the same swarm the other trainers see? A DHT can split: peers whose lookups reach
different nodes read different progress records, and each part counts its own samples and steps apart from the
other (learning-at-home/hivemind#624). Every trainer's metrics record says which global step it is at and how many
peers it sees (sahajbert.records.LocalMetrics: `step`, `peers_seen`). A trainer reads the others' records now and
then and compares them with its own view; a disagreement that lasts SPLIT_READS reads in a row is said in one
warning line, with what to do. A part that no record of the other part reaches cannot be seen from inside it: a
clean cut looks like peers that left."""

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

from sahajbert import records

logger = logging.getLogger("sahajbert.trainer")

READ_SECONDS = 60.0  # between two reads of the trainers' records (each a DHT read of every trainer's record)
SPLIT_READS = 3  # reads in a row that must disagree before the warning: a peer that joined or stepped since is seen
# by the others within a read or two
STEP_SLACK = 2  # global steps a trainer's record may differ from this peer's step by (records are published after
# each step, read later)
PEERS_SLACK = 2  # and peers its view may differ by, or PEERS_SHARE of the larger view, whichever is more
PEERS_SHARE = 0.25


@dataclass(frozen=True)
class View:
    """What one trainer sees of the swarm: the global step it is at and how many peers report progress to it."""

    step: int
    peers: int

    def disagrees_with(self, other: "View", step_before: int | None = None) -> bool:
        """Does `other` show another swarm than this view? `step_before`: this peer's step when the read of `other`
        began (the peer may have stepped while it ran)."""
        lowest = min(self.step, self.step if step_before is None else step_before)
        if not lowest - STEP_SLACK <= other.step <= self.step + STEP_SLACK:
            return True
        return abs(self.peers - other.peers) > max(PEERS_SLACK, PEERS_SHARE * max(self.peers, other.peers))


def split_warning(mine: View, theirs: list[View], reads: int) -> str:
    """The one line a peer logs when `theirs` (the views that disagree with its own) did so for `reads` reads."""
    steps = sorted(view.step for view in theirs)
    peers = sorted(view.peers for view in theirs)

    def span(values: list[int]) -> str:
        return str(values[0]) if values[0] == values[-1] else f"{values[0]}-{values[-1]}"

    return (
        f"the swarm may have split: this peer sees {mine.peers} peer(s) at global step {mine.step}, while "
        f"{len(theirs)} other trainer(s), stepping, see {span(peers)} peer(s) at step {span(steps)} "
        f"({reads} reads in a row): parts of the DHT that do not find each other train apart. If this peer is in "
        f"the smaller part, restart it with --initial_peers naming a peer of the other part (docs/volunteers.md)"
    )


class SplitWatch:
    """Compares this peer's view with the other trainers' records, one read every `read_seconds`; `observe` holds
    the rule, `poll` reads the DHT without blocking the training loop.

    A view's peers are the most this peer saw report progress over the last two reads' spans (`peers_seen`, also
    what its record says): a single read of the progress records may come back without some of them (a DHT node that
    did not answer in time; 5 of 8 peers right after a step in a loaded 8-peer run), and only lowers the count."""

    def __init__(self, dht, run_id: str, public_key: bytes, read_seconds: float = READ_SECONDS):
        self.dht, self.run_id, self.public_key = dht, run_id, public_key
        self.read_seconds = read_seconds
        self._read: Future | None = None
        self._step_at_read: int | None = None  # this peer's step when the read in flight began
        self._next_read = time.monotonic() + read_seconds
        self._peers_now, self._peers_before = 0, 0  # the most peers seen since the last read began, and before it
        self._last_steps: dict[bytes, int] = {}  # each trainer's step at the previous read
        self._streaks: dict[bytes, int] = {}  # each trainer's reads in a row that disagreed with this peer's view
        self._told = False
        self.reads = 0  # reads compared so far

    def saw(self, peers: int) -> None:
        """This peer's progress tracker counts `peers` peers now."""
        self._peers_now = max(self._peers_now, peers)

    @property
    def peers_seen(self) -> int:
        return max(self._peers_now, self._peers_before)

    def poll(self, step: int) -> str | None:
        """Start a read when one is due; compare it with this peer's view at `step` once it has come back. The
        warning it logged, if any."""
        if self._read is None:
            if time.monotonic() >= self._next_read:
                self._read, self._step_at_read = records.fetch_later(self.dht, self.run_id), step
                self._next_read = time.monotonic() + self.read_seconds
                self._peers_before, self._peers_now = self._peers_now, 0
            return None
        if not self._read.done():
            return None
        read, self._read = self._read, None
        try:
            found = records.metrics_of(read.result())
        except Exception as e:  # a read that failed is no evidence either way: the next one is due as usual
            logger.debug(f"reading the trainers' records failed: {e!r}")
            return None
        self.reads += 1
        others = {
            key: View(record.step, record.peers_seen)
            for key, record in found.items()
            if key != self.public_key and record.status == "training" and record.peers_seen > 0
        }
        warning = self.observe(View(step, self.peers_seen), others, self._step_at_read)
        if warning:
            logger.warning(warning)
        return warning

    def observe(self, mine: View, others: dict[bytes, View], step_before: int | None = None) -> str | None:
        """One read of the other trainers' views. Only trainers that stepped since the previous read count (a record
        whose step stands still may be a peer gone or waiting), each on its own: the warning once a trainer's view
        disagreed with `mine` in SPLIT_READS reads in a row, and again only after a read where none did.
        `step_before`: this peer's step when the read began."""
        streaks = {}
        for key, view in others.items():
            stepped = key in self._last_steps and self._last_steps[key] != view.step
            if stepped and mine.disagrees_with(view, step_before):
                streaks[key] = self._streaks.get(key, 0) + 1
        self._last_steps = {key: view.step for key, view in others.items()}
        self._streaks = streaks
        if not streaks:
            self._told = False
            return None
        split = [others[key] for key, reads in streaks.items() if reads >= SPLIT_READS]
        if not split or self._told:
            return None
        self._told = True
        return split_warning(mine, split, SPLIT_READS)
