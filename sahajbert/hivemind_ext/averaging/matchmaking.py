"""hivemind's matchmaking with a peer's left-out peers refused as leaders (`GuardedMatchmaking`)."""

import logging
import math

from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import PeerID

logger = logging.getLogger(__name__)


class GuardedMatchmaking(Matchmaking):
    """hivemind's matchmaking, with two changes. Installed for every averager (`hivemind.averaging.averager.
    Matchmaking`).

    - It asks no peer that its averager left out (`distrusted`) to lead its group: as a leader an averager already
      refuses such a peer (`GuardedAverager._admits`), but hivemind would still follow it (hivemind's own averagers
      have no such peers).
    - A client-mode peer offers to wait for its group until its round's deadline (`get_request_expiration_time`).
    """

    def __init__(self, *args, distrusted: set[PeerID] = frozenset(), **kwargs):
        super().__init__(*args, **kwargs)
        self.distrusted = distrusted

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
