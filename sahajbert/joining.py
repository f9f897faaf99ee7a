"""How a trainer joins a run: its own checkpoint, then the swarm's state if the swarm is ahead, or in a new run the
parameters of the trainer that started first; and, before a new run's first global step, the trainers still starting.
"""

import hashlib
import logging
import time
from pathlib import Path

import torch

from sahajbert import adaptive, records
from sahajbert.adaptive import Timing
from sahajbert.hivemind_ext.optim import accessors
from sahajbert.link_probe import LinkEstimate
from sahajbert.optim import restore_optimizer_state
from sahajbert.peer_context import PeerContext
from sahajbert.signals import StopRequest

# the trainer's lines keep the trainer's logger name, whichever of its parts says them: users filter on it
logger = logging.getLogger("sahajbert.trainer")


def parameters_digest(parameters: list[torch.Tensor]) -> str:
    """A digest of parameters' exact values (fp32 bytes, in order): equal digests, equal starting points."""
    digest = hashlib.sha256()
    for tensor in parameters:
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:32]


def start_priority(unix_time: float) -> float:
    """A state priority in (0, 0.5] at step 0 that is higher the earlier a peer started (hivemind sets the
    priority to the global step at every step after it, so it only orders peers of a new run). 2^24 s cycle:
    resolution below a millisecond next to step numbers up to 10^6 in a float64."""
    return 0.5 * (1 - (unix_time % 2**24) / 2**24)


class Joining:
    """A trainer's way into the run, from its start until it holds the swarm's state: `state_missing` while the
    swarm is ahead and no peer could share its state (a download is tried again after every global step)."""

    def __init__(
        self,
        context: PeerContext,
        timing: Timing,
        link: LinkEstimate | None,
    ):
        self.optimizer, self.dht, self.public_key = context.optimizer, context.dht, context.public_key
        peer_args = context.peer_args
        self.run_id, self.max_steps = peer_args.swarm_args.run_id, peer_args.training_args.max_steps
        self.timing, self.link = timing, link
        # at step 0, the peer that started first is every newcomer's donor: all start from its parameters
        self.start_priority = start_priority(time.time())
        accessors.set_state_priority(self.optimizer, self.start_priority)
        self.state_missing = False

    def join(self, resume_from: Path | None) -> None:
        """Take this peer's own checkpoint (`resume_from`, if any), then catch up with the swarm."""
        if resume_from is not None:
            restore_optimizer_state(self.optimizer, resume_from)
        self.state_missing = self._catch_up_with_swarm()

    def retry_download(self) -> None:
        """After a global step: download the swarm's state if no peer could share it so far."""
        if self.state_missing and self.download_state():
            self.state_missing = False
            logger.info(f"downloaded the swarm's state at global step {self.optimizer.local_epoch}")

    def _catch_up_with_swarm(self, timeout: float = 30.0) -> bool:
        """Download the swarm's state now if it is ahead (instead of on the first step, silently).

        Ahead means: trainers report a later global step, or an aux peer announces a state to rescue the run from.
        Returns True if the swarm is ahead and no peer could share its state, so that the loop retries.
        """
        accessors.wait_for_swarm_progress(self.optimizer, timeout)
        swarm_step = max(
            accessors.position(self.optimizer).swarm_step,
            records.fetch_announced_step(self.dht, self.run_id),
        )
        if self.optimizer.local_epoch >= swarm_step and self._check_unbacked_claim():
            return False
        if self.optimizer.local_epoch == swarm_step == 0:
            self._start_from_first_peer()
            return False
        if self.optimizer.local_epoch >= swarm_step:
            return False
        logger.info(f"the swarm is at step {swarm_step}: downloading its state from peers")
        if self.download_state():
            logger.info(f"joined at global step {self.optimizer.local_epoch}")
            return False
        logger.warning(
            f"no peer could share the swarm's state (client-mode peers cannot serve it): training from step "
            f"{self.optimizer.local_epoch} with this peer's own optimizer state and retrying after every global step"
        )
        return True

    def _check_unbacked_claim(self) -> bool:
        """A peer alone in the run's records at a later step (a trainer that ran alone before this one came, or a
        peer that only claims to be there): ask that peer for its state, checked as any download is. Taken, this
        peer joins at its step (True), and its claims count from then on; else this peer trains on where it is."""
        claims = accessors.unbacked_claims(self.optimizer)
        if not claims:
            return False
        peer, step = max(claims.items(), key=lambda claim: claim[1])
        max_steps = self.max_steps
        if max_steps is not None and step >= max_steps:
            logger.warning(
                f"peer {peer} alone claims global step {step}, at or past this run's last ({max_steps}): a run's end "
                f"is never taken from one peer; training on from step {self.optimizer.local_epoch}"
            )
            return False
        # one step more than claimed: a trainer alone may have stepped since the claim was read
        if accessors.take_state_of(self.optimizer, peer, step + 1, self.timing.load_state_timeout):
            accessors.state_taken(self.optimizer)
            logger.info(f"joined at global step {self.optimizer.local_epoch}, from the state of peer {peer}")
            return True
        logger.warning(
            f"peer {peer} alone claims global step {step}, and its state was not usable: training on from step "
            f"{self.optimizer.local_epoch} with the peers this one can check"
        )
        return False

    def wait_for_starting_trainers(self, stop: StopRequest) -> None:
        """Before a new run's first global step: trainers that started with this one but still download its
        parameters would otherwise find the run ended or far ahead; wait for them, within the join wait."""
        deadline = time.monotonic() + self.timing.join_wait
        logged = False
        while not stop and time.monotonic() < deadline:
            starting = accessors.starting_peers(self.optimizer)
            if not starting:
                return
            if not logged:
                logger.info(
                    f"waiting up to {self.timing.join_wait:.0f} s for {len(starting)} trainer(s) still starting, "
                    "before the run's first global step"
                )
                logged = True
            time.sleep(1.0)

    def _start_from_first_peer(self) -> None:
        """A new run: every trainer starts from the parameters of the one that started first (the highest state
        priority at step 0), so that trainers with different --seed values train one model, not two. A trainer
        whose own parameters are the first one's (the same --seed, the default) has nothing to download: at the
        real model sizes that download takes minutes on a volunteer's link (56.9 MB for sahajBERT's preset)."""
        run_id = self.run_id
        own_digest = parameters_digest(accessors.master_parameters(self.optimizer))
        if not records.declare_start(self.dht, run_id, self.public_key, self.dht.peer_id.to_base58(), own_digest):
            logger.warning("could not declare this trainer's initial parameters: trainers after it will download them")
        # the others' declarations reach the DHT within a few round trips of their start
        round_trip = self.link.round_trip_s if self.link is not None else adaptive.FALLBACK_LINK.round_trip_s
        time.sleep(max(2.0, 10 * round_trip))
        own = accessors.own_state_priority(self.optimizer)
        earlier = {peer: p for peer, p in accessors.state_priorities(self.optimizer).items() if own < p < 1.0}
        if not earlier:
            return
        first = max(earlier, key=earlier.get)
        if records.fetch_starts(self.dht, run_id).get(first.to_base58()) == own_digest:
            logger.info(
                "the run is at step 0 and another trainer started first, from the same parameters as this one: "
                "nothing to download"
            )
            return
        logger.info("the run is at step 0 and another trainer started first: starting from its parameters")
        if self.download_state():
            logger.info("downloaded the first trainer's parameters")
        # hivemind set this peer's priority to its step (0): declare the start priority again, which tells the
        # others that this trainer is starting until it reports progress
        accessors.set_state_priority(self.optimizer, self.start_priority)

    @torch.no_grad()
    def download_state(self) -> bool:
        """hivemind's load_state_from_peers, and whether it really brought a state.

        When no peer answers, hivemind still moves a peer that is one step behind to the swarm's step (to tolerate
        a lagging peer), and a newcomer would then train with its own fresh optimizer statistics. A state that
        arrived changes the parameters: the swarm is at least one step past this peer's.
        """
        before = [p.detach().clone() for p in accessors.master_parameters(self.optimizer)]
        self.optimizer.load_state_from_peers()
        return any(not torch.equal(a, p) for a, p in zip(before, accessors.master_parameters(self.optimizer)))
