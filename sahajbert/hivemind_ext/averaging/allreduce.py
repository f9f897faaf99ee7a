"""One group's all-reduce, reduced by the project's robust rule and checked (`RobustAllReduceRunner`).

The rule itself (`policy.rules().aggregate`, which `install()` was given, with the averager's `aggregation`) is
the project's; this module feeds it each part's contributions and applies what it returns.
"""

import logging
import math

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, TensorPartReducer
from hivemind.p2p import PeerID

import sahajbert.hivemind_ext.policy as policy

logger = logging.getLogger(__name__)


class RobustAccumulator:
    """Takes the place of hivemind's accumulator tensor in its TensorPartReducer (`reducer.accumulator`): where
    hivemind adds each contribution to a sum (`add_`) and divides by the total weight once all have arrived
    (`div_`), this keeps the contributions and combines them with the rules' `aggregate` (`policy.rules()`)."""

    def __init__(self, reducer: "RobustTensorPartReducer"):
        self.reducer = reducer
        self.contributions: list[torch.Tensor] = []
        self.weights: list[float] = []
        self.senders: list[int] = []

    def add_(self, tensor: torch.Tensor, alpha: float = 1.0) -> "RobustAccumulator":
        self.contributions.append(tensor)
        self.weights.append(float(alpha))
        self.senders.append(getattr(tensor, "sahajbert_sender", -1))
        return self

    def div_(self, _total_weight: float) -> torch.Tensor:
        own = self.reducer.own_sender
        mine = self.senders.index(own) if own in self.senders else None
        # this peer's whole contribution shared out by the part's length: the pair rule's smallest own size
        own_scale = self.reducer.own_rms * math.sqrt(self.contributions[0].numel()) if self.contributions else 0.0
        combined = policy.rules().aggregate(
            self.contributions, self.weights, self.reducer.aggregation, own=mine, own_scale=own_scale
        )
        self.reducer.dropped.update(self.senders[i] for i in combined.dropped)
        self.reducer.outliers.update(self.senders[i] for i in combined.outliers)
        return combined.tensor


class RobustTensorPartReducer(TensorPartReducer):
    """hivemind's reducer of this peer's parts, with `RobustAccumulator` as the accumulator of each part (set up in
    `reset_accumulators`, which hivemind calls for every next part). Keeps each contribution of the current part
    until all have arrived: memory for one part times the group's size, instead of one part."""

    def __init__(self, part_shapes, num_senders: int, aggregation, own_sender: int | None, own_rms: float = 0.0):
        self.aggregation = aggregation
        self.own_sender = own_sender  # this peer's index among the senders (None: it sends nothing, an aux peer)
        self.own_rms = own_rms  # the root mean square of this peer's whole contribution (its parts to every reducer)
        self.dropped: set[int] = set()  # senders with a non-finite contribution, by index
        self.outliers: set[int] = set()  # senders with a contribution far out of the others' range, by index
        self.senders: set[int] = set()  # senders that sent this peer a part to reduce, by index
        self.rejected: set[int] = set()  # `dropped` of this round, kept after the runner has logged and cleared it
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = RobustAccumulator(self)

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight=1.0):
        # a part of another shape than this peer's own (hivemind would broadcast a 1-value part over the whole part,
        # and the robust rules cannot stack it) is taken as a non-finite one: dropped and logged
        if 0 <= part_index < self.num_parts and tensor_part.shape != self.part_shapes[part_index]:
            tensor_part = torch.full(self.part_shapes[part_index], float("nan"))
        tensor_part.sahajbert_sender = sender_index  # read by RobustAccumulator.add_, after hivemind's waits
        self.senders.add(sender_index)
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight=weight)


class RobustAllReduceRunner(AllReduceRunner):
    """hivemind's all-reduce of one group, with three defences:

    - this peer reduces its parts with `RobustTensorPartReducer`;
    - each average another peer returns for this peer's parts is checked (the rules' `implausible`); an implausible one
      ends that exchange, and hivemind then keeps this peer's own values for the rest of that reducer's parts
      (`register_failed_reducer`), as for a reducer that timed out. The reducer is reported to `distrust`;
    - peers in `distrusted` are left out: their contributions are not awaited and their averages not asked for.
    """

    def __init__(
        self,
        *args,
        aggregation,
        distrusted: set[PeerID],
        distrust,
        vouch=lambda peers: None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.distrusted, self.distrust = distrusted, distrust
        self.vouch = vouch
        # the reducer hivemind made never runs: marked finished, it does not warn of 0% received when collected
        self.tensor_part_reducer.finished.set()
        container = self.tensor_part_container
        own = [part for parts in container._input_parts_by_peer for part, _ in parts]
        checked = aggregation.rule != "plain"  # plain: hivemind's all-reduce, no checks
        # this peer's whole contribution, which the checks and the pair rule measure its parts against
        self._own_norm = math.sqrt(sum(float(part.float().norm()) ** 2 for part in own)) if checked else 0.0
        self._own_size = max(1, sum(part.numel() for part in own))
        own_sender = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None
        self.tensor_part_reducer = RobustTensorPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            len(self.sender_peer_ids),
            aggregation,
            own_sender,
            own_rms=self._own_norm / math.sqrt(self._own_size) if own_sender is not None else 0.0,
        )
        for index, peer_id in enumerate(self.sender_peer_ids):
            if peer_id in distrusted and peer_id != self.peer_id:
                self.banned_senders.add(peer_id)
                self.active_senders.add(peer_id)  # not awaited: hivemind waits for every sender that is not active
                self.tensor_part_reducer.on_sender_failed(index)
        if len(self.active_senders) == len(self.sender_peer_ids):
            self.all_senders_started.set()
        if checked:
            self._register = container.register_processed_part
            container.register_processed_part = self._register_checked

    def _register_checked(self, peer_index: int, part_index: int, delta: torch.Tensor) -> None:
        peer_id = self.ordered_peer_ids[peer_index]
        own, _ = self.tensor_part_container._input_parts_by_peer[peer_index][part_index]
        # a peer whose own part is non-finite (its parameters went bad) cannot judge anyone: it rolls back instead
        rules = policy.rules()
        if peer_id != self.peer_id and rules.finite(own):
            scale = max(float(own.float().norm()), self._own_norm * math.sqrt(own.numel() / self._own_size))
            why = rules.implausible(delta, scale)
            if why is not None:
                self.distrust(
                    peer_id,
                    f"its average for a part of {self.group_id.hex()[:8]}'s round: {why}; this peer kept its own "
                    f"values for that peer's parts",
                )
                raise AllreduceException(f"{peer_id} returned an implausible average ({why})")
            self.vouch([peer_id])  # its average of this peer's part passed the checks
        self._register(peer_index, part_index, delta)

    async def _communicate_with_peer(self, peer_id: PeerID):
        if peer_id in self.distrusted and peer_id != self.peer_id:
            self.tensor_part_container.register_failed_reducer(self.ordered_peer_ids.index(peer_id))
            return
        try:
            await super()._communicate_with_peer(peer_id)
        except Exception as error:
            # hivemind says only how much came back ("received N% results") and logs why at debug level: a user
            # reading a partial round needs the reducer and the reason (an implausible average says so already)
            if peer_id != self.peer_id and peer_id not in self.distrusted:
                logger.info(
                    f"no average came back from {peer_id} for its parts of an averaging round of {self._prefix} "
                    f"({error!r}); this peer kept its own values there"
                )
            raise

    def finalize(self, *, cancel: bool = False, exception: BaseException | None = None):
        reducer = self.tensor_part_reducer
        reducer.rejected |= reducer.dropped
        for what, senders in (
            ("non-finite or misshapen", reducer.dropped),
            ("outlying", reducer.outliers - reducer.dropped),
        ):
            for index in sorted(i for i in senders if 0 <= i < len(self.sender_peer_ids)):
                action = "bounded" if what == "outlying" else "dropped"
                logger.warning(
                    f"{action} the {what} contribution of {self.sender_peer_ids[index]} to this peer's part of an "
                    f"averaging round of {self._prefix}"
                )
            senders.clear()
        super().finalize(cancel=cancel, exception=exception)
