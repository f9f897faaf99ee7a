"""A misbehaving peer for the robustness tests: run_trainer.py's own trainer, speaking the swarm's protocol, whose
contributions are corrupted. `python tests/attacker.py PLAN <run_trainer.py flags>`.

PLAN is [PEERS@] and comma-separated phases, each ATTACK:ROUNDS, with ROUNDS the gradient rounds that hivemind
reports this peer made with at least PEERS peers, this one included (default 1) (such a round does not prove that
every reducer got this peer's parts: a test that needs that uses a phase file, below). Honest until the swarm has
PEERS peers; the last phase lasts to the end. ATTACK is one of
  nan           gradients of NaN
  scaled        gradients x1e4
  sign_flipped  gradients x-1
  bad_reducer   the parts this peer reduces come back x1e4
  bad_final_reducer  honest until the final parameter round, whose parts this peer reduces come back x1e4
  honest        nothing wrong
and `+progress` on any phase: progress claims of 30 steps ahead, x100 samples and x100 throughput.
PLAN can also be [PEERS@]file:PATH: the phase is what PATH holds (ATTACK[+progress]), read at every pass, honest
while PATH does not exist: a test moves the attacker on once the honest peers' logs show the current attack reached
them.
It prints `attacker peer id <id>` first, and `attack <name> at step <n>` when a phase begins. It offers no state for
download.
"""

import logging
import re
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sahajbert import robust, trainer  # noqa: E402
from sahajbert.cli import Flags, parse_args, setup_logging  # noqa: E402
from sahajbert.flags import PeerArguments, TrainerScriptArguments  # noqa: E402
from sahajbert.signals import StopRequest  # noqa: E402

ATTACKS = ("nan", "scaled", "sign_flipped", "bad_reducer", "bad_final_reducer", "honest")


def parse_phase(name: str) -> tuple[str, bool]:
    attack, _, extra = name.partition("+")
    assert attack in ATTACKS and extra in ("", "progress"), name
    return attack, extra == "progress"


def parse_plan(plan: str) -> tuple[int, list[tuple[str, bool, int]] | Path]:
    peers, _, plan = plan.rpartition("@")
    if plan.startswith("file:"):
        return int(peers or 1), Path(plan.removeprefix("file:"))
    phases = []
    for phase in plan.split(","):
        name, _, rounds = phase.partition(":")
        phases.append((*parse_phase(name), int(rounds) if rounds else 10**9))
    return int(peers or 1), phases


class Attacker(trainer.TrainerPeer):
    progress_attack = False

    def __init__(self, peer_args, phases, with_peers: int):
        self.phases, self.with_peers = phases, with_peers
        super().__init__(peer_args)
        # it offers no state for download (a peer may, as a client does): its own NaN gradients come back to it as NaN
        # (hivemind adds the average's difference to its own part), so its state is non-finite until it rolls back,
        # and an honest peer that downloaded it then would leave it out (rightly: that check is test_robust's) before
        # the later attacks reach anyone, as in a CI run
        self.optimizer.state_averager.allow_state_sharing = False
        print(f"attacker peer id {self.dht.peer_id}", flush=True)
        self.announced = None
        self.among_others = False
        self.full_rounds = FullRounds(with_peers)
        # first of the optimizer logger's filters: the trainer's RoundMonitor drops INFO lines without --verbose
        logging.getLogger("hivemind.optim.optimizer").filters.insert(0, self.full_rounds)
        self.dht.store = partial(inflating_store, self.dht.store)

    def run(self, stop):
        """Train once the swarm has `with_peers` peers (this one included): a lie made alone reaches nobody."""
        deadline = time.monotonic() + 300
        while self.peers_reporting() < self.with_peers and time.monotonic() < deadline and not stop:
            time.sleep(0.5)
        return super().run(stop)

    def peers_reporting(self) -> int:
        """This peer and the others with a progress record in the DHT (hivemind's tracker refreshes its own count
        only now and then, and reports this peer only once it has samples)."""
        found = self.dht.get(f"{self.args.swarm_args.run_id}_progress", latest=True)
        records = found.value if found is not None and isinstance(found.value, dict) else {}
        own = self.dht.peer_id.to_bytes()
        # a peer that stopped leaves a record of None
        values = [getattr(record, "value", None) or {} for record in records.values()]
        return 1 + sum(1 for value in values if value.get("peer_id") != own)

    def phase(self) -> tuple[str, bool]:
        """The phase now: what the phase file holds, or each planned phase for its number of gradient rounds."""
        if not self.among_others:
            if self.peers_reporting() < self.with_peers:
                return "honest", False  # not yet among the others: a lie now would reach nobody
            self.among_others = True
        if isinstance(self.phases, Path):
            return parse_phase(self.phases.read_text().strip()) if self.phases.exists() else ("honest", False)
        done, end = self.full_rounds.count, 0
        for attack, progress, rounds in self.phases:
            end += rounds
            if done < end:
                return attack, progress
        return self.phases[-1][:2]

    def _forward_backward(self):
        loss = super()._forward_backward()
        attack, progress = self.phase()
        if (attack, progress) != self.announced:
            self.announced = (attack, progress)
            print(f"attack {attack}{'+progress' if progress else ''} at step {self.optimizer.local_epoch}", flush=True)
        if attack == "bad_reducer" and LIE_FILE is not None:
            LIE_FILE.touch()
        Attacker.progress_attack = progress
        if loss is not None:
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is None:
                        continue
                    if attack == "nan":
                        p.grad.fill_(float("nan"))
                    elif attack == "scaled":
                        p.grad.mul_(1e4)
                    elif attack == "sign_flipped":
                        p.grad.neg_()
        return loss

    def _finish(self, stopped):
        if self.phase()[0] == "bad_final_reducer" and LIE_FILE is not None:
            LIE_FILE.touch()
        return super()._finish(stopped)


class FullRounds(logging.Filter):
    """Counts this peer's gradient rounds with at least `peers` peers, from hivemind's "Averaged gradients with N
    peers" line (the size of its group; hivemind reports that even when some parts did not reach their reducers)."""

    DONE = re.compile(r"^Averaged gradients with (\d+) peers$")

    def __init__(self, peers: int):
        super().__init__()
        self.peers, self.count = peers, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if (match := self.DONE.match(record.getMessage())) and int(match.group(1)) >= self.peers:
            self.count += 1
            print(f"attacker: gradient round {self.count} with {match.group(1)} peers", flush=True)
        return True


# the reducer runs in this peer's averager processes, forked before any phase begins: they read the switch from a
# file that this process creates when a bad_reducer phase begins
LIE_FILE: Path | None = None
_aggregate = robust.aggregate


def lying_aggregate(contributions, weights, how, own=None, own_scale=0.0):
    combined = _aggregate(contributions, weights, how, own, own_scale)
    if LIE_FILE is not None and LIE_FILE.exists():
        combined.tensor = combined.tensor * 1e4
    return combined


def inflating_store(store, *args, **kwargs):
    """The DHT's store, with this peer's progress record inflated while a +progress phase runs."""
    value = kwargs.get("value")
    if Attacker.progress_attack and str(kwargs.get("key", "")).endswith("_progress") and isinstance(value, dict):
        kwargs["value"] = dict(
            value,
            epoch=value["epoch"] + 30,
            samples_accumulated=value["samples_accumulated"] * 100,
            samples_per_second=value["samples_per_second"] * 100,
        )
    return store(*args, **kwargs)


def main() -> int:
    setup_logging()
    global LIE_FILE
    with_peers, phases = parse_plan(sys.argv[1])
    flags = Flags((PeerArguments, TrainerScriptArguments), description="a misbehaving trainer")
    peer_args, _ = parse_args(flags, sys.argv[2:])
    LIE_FILE = Path(peer_args.training_args.output_dir) / "lie"
    LIE_FILE.parent.mkdir(parents=True, exist_ok=True)
    robust.aggregate = lying_aggregate
    with StopRequest("stopping") as stop, Attacker(peer_args, phases, with_peers) as peer:
        peer.run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
