"""hivemind's matchmaking with a peer's left-out peers refused as leaders and its DHT reads paced
(`GuardedMatchmaking`)."""

import asyncio
import logging
import math
import time
from math import isfinite

from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking, PotentialLeaders
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS

from sahajbert.hivemind_ext.averaging.control import RoundLedger

logger = logging.getLogger(__name__)

# the fewest seconds between two reads of a round's group key while this peer looks for a group. hivemind reads it
# again as soon as the last read has ended while this peer waits to lead (about 35 reads a second per averager on
# loopback, two averagers per trainer), and every read costs each DHT node on its path a lookup and a signature check:
# most of an idle trainer's CPU went to these reads and their answers. A group forms over a matchmaking time of
# seconds, so learning of a better leader up to this much later costs a round nothing measurable
LEADER_READ_SECONDS = 0.5


class PacedLeaders(PotentialLeaders):
    """hivemind's search for a leader, reading the group key at most every LEADER_READ_SECONDS."""

    async def _update_queue_periodically(self, key_manager: GroupKeyManager) -> None:
        """Follows hivemind 1.1.12's PotentialLeaders._update_queue_periodically (hivemind/averaging/matchmaking.py),
        with a pause before each read that comes sooner than LEADER_READ_SECONDS after the last."""
        slack = MAX_DHT_TIME_DISCREPANCY_SECONDS
        last_read = -math.inf
        while get_dht_time() < self.search_end_time:
            pause = min(last_read + LEADER_READ_SECONDS - time.monotonic(), self.search_end_time - get_dht_time())
            if pause > 0:
                await asyncio.sleep(pause)
            last_read = time.monotonic()
            new_peers = await key_manager.get_averagers(key_manager.current_key, only_active=True)
            self.max_assured_time = max(self.max_assured_time, get_dht_time() + self.min_matchmaking_time - slack)

            self.leader_queue.clear()
            for peer, peer_expiration_time in new_peers:
                if peer == self.peer_id or (peer, peer_expiration_time) in self.past_attempts:
                    continue
                self.leader_queue.store(peer, peer_expiration_time, peer_expiration_time)
                self.max_assured_time = max(self.max_assured_time, peer_expiration_time - slack)

            self.update_finished.set()

            await asyncio.wait(
                {asyncio.create_task(self.running.wait()), asyncio.create_task(self.update_triggered.wait())},
                return_when=asyncio.ALL_COMPLETED,
                timeout=self.search_end_time - get_dht_time() if isfinite(self.search_end_time) else None,
            )
            self.update_triggered.clear()


class GuardedMatchmaking(Matchmaking):
    """hivemind's matchmaking, with two changes. Installed for every averager (`hivemind.averaging.averager.
    Matchmaking`).

    - It asks no peer that its averager left out (`distrusted`) to lead its group: as a leader an averager already
      refuses such a peer (`GuardedAverager._admits`), but hivemind would still follow it (hivemind's own averagers
      have no such peers).
    - A client-mode peer offers to wait for its group until its round's deadline (`get_request_expiration_time`).
    - It reads the DHT for leaders at a pace (`PacedLeaders`).
    - It counts its matchmakings in the averager's `RoundLedger` (their seconds, the groups' sizes).
    """

    def __init__(self, *args, distrusted: set[PeerID] = frozenset(), ledger: RoundLedger | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.distrusted = distrusted
        self.ledger = ledger
        leaders = self.potential_leaders
        self.potential_leaders = PacedLeaders(leaders.peer_id, leaders.min_matchmaking_time, leaders.target_group_size)

    async def look_for_group(self, step):
        started, group = time.monotonic(), None
        try:
            group = await super().look_for_group(step)
            return group
        finally:
            if self.ledger is not None:
                self.ledger.matched(time.monotonic() - started, len(group.peer_ids) if group is not None else None)

    async def _request_join_group(self, leader: PeerID):
        if leader in self.distrusted:  # also a leader that an honest one's disbanded group redirects this peer to
            logger.debug(f"not joining the group of {leader}: it is left out of this peer's averaging")
            return None
        return await super()._request_join_group(leader)

    def get_request_expiration_time(self) -> float:
        """The time until which this peer, asking to join a group, waits for it to begin. hivemind's is the peer's
        own scheduled time, and a leader refuses a follower whose time comes before its own (BAD_EXPIRATION_TIME),
        after which the follower does not ask it again until it declares a new time: a peer that can lead then
        leads, but a client-mode peer cannot, so it would wait until its time had passed (DiLoCo trainers schedule
        their rounds from their own inner steps plus --diloco_wait: up to the whole wait per outer round). A
        client-mode peer waits for any group anyway, so it offers its round's deadline (the round fails then,
        grouped or not)."""
        expiration = super().get_request_expiration_time()
        if self.client_mode and self.step_control is not None and math.isfinite(self.step_control.deadline):
            return max(expiration, self.step_control.deadline)
        return expiration
