"""The averagers a peer runs: admission of callers, bounds on open requests, the robust all-reduce, checked
state downloads, and the peers left out or vouched for (`GuardedAverager` and its two hivemind classes).
"""

import asyncio
import logging
import math
import multiprocessing as mp
import random
import signal
import time
from dataclasses import replace
from functools import partial
from typing import AsyncIterator  # noqa: UP035 hivemind's servicer finds streaming RPCs by typing's _name

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.compression import CompressionBase, deserialize_torch_tensor
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import achain, aiter_with_timeout, anext, as_aiter, azip
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

import sahajbert.hivemind_ext.policy as policy
from sahajbert.hivemind_ext.averaging.allreduce import RobustAllReduceRunner
from sahajbert.hivemind_ext.averaging.control import RoundLedger
from sahajbert.hivemind_ext.refusals import RefusalLog

logger = logging.getLogger(__name__)


# seconds a part for a group this averager has not begun yet waits for it (without a chunk timeout), and between looks
PART_GROUP_WAIT, PART_GROUP_POLL = 30.0, 0.01


# seconds a stopping averager waits after its last served all-reduce stream has ended, for the p2p daemon to pass
# the last chunk on (the daemon stays up with the DHT, but the averager's end of the stream closes at its exit)
FLUSH_AFTER_SERVING = 0.5
# seconds a peer whose state was refused, cut short or timed out is not asked again by a download open to any peer
REFUSED_STATE_COOLDOWN = 120.0
STATE_SLACK_BYTES = 4096  # per tensor of a downloaded state: its serialized header, beyond 4 bytes per value
SERVING_WAIT_UNTIMED = 10.0  # seconds to wait for served streams when the averager has no chunk timeout


# Averaging requests this peer serves at once, from one peer and from all. An honest peer asks to join one group at a
# time, sends one stream per round to each reducer (two while a round ends as the next begins) and downloads one
# state at a time; a state upload (the whole model and its optimizer statistics, GBs for sahajbert-XL) takes this
# peer's upload link for minutes, so few run at once. Beyond that a request is answered as a busy peer would be.
MAX_REQUESTS_PER_PEER = {"join": 2, "part": 4, "state": 1}
MAX_REQUESTS = {"join": 256, "part": 256, "state": 4}
_REQUEST_NAMES = {"join": "request to join a group", "part": "all-reduce stream", "state": "state download"}
_refused_requests = RefusalLog()


class _OpenRequests:
    """Counts the requests of one kind that an averager is serving, per caller; refuses those over the bounds."""

    def __init__(self, kind: str) -> None:
        self.kind, self.total, self.by_peer = kind, 0, {}

    def enter(self, peer: PeerID) -> bool:
        own = self.by_peer.get(peer, 0)
        per_peer, total = MAX_REQUESTS_PER_PEER[self.kind], MAX_REQUESTS[self.kind]
        if own >= per_peer or self.total >= total:
            bound = f"{per_peer} from one peer" if own >= per_peer else f"{total} in all"
            _refused_requests.refused(
                f"refused a {_REQUEST_NAMES[self.kind]} from peer {peer}: this peer serves at most {bound} at once"
            )
            return False
        self.by_peer[peer], self.total = own + 1, self.total + 1
        return True

    def leave(self, peer: PeerID) -> None:
        self.total -= 1
        self.by_peer[peer] -= 1
        if not self.by_peer[peer]:
            del self.by_peer[peer]


class _LeftOut:
    """The peers one averager leaves out, as its own process sees them: those it was given, those it caught, and those
    the peer's other averager caught, which arrive through `inbox` (fed by `GuardedAverager.leave_out`). A peer that
    served implausible gradient averages is left out of the parameter rounds too, and the other way round. Asked only
    in the averager's process: asking drains the inbox."""

    def __init__(self, peers=()):
        self.peers: set[PeerID] = set(peers)
        self.inbox = mp.SimpleQueue()

    def __contains__(self, peer_id: PeerID) -> bool:
        while not self.inbox.empty():
            self.peers.add(PeerID(self.inbox.get()))
        return peer_id in self.peers

    def add(self, peer_id: PeerID) -> None:
        self.peers.add(peer_id)


class GuardedAverager:
    """Averaging RPCs only for callers that `gate` admits (sahajbert.access.Gate); mixed into hivemind's averagers.

    It also stops gracefully: hivemind ends a peer's own all-reduce once its own averaged parts have arrived, while
    it may still be sending the parts it reduced to slower groupmates; an averager that exits then (a trainer that
    stops after the final round) gives them partial results. `_shutdown` first waits, at most one chunk timeout
    (a groupmate gives up after that anyway), until no served all-reduce stream is left.

    hivemind's averaging messages carry no token: the caller's libp2p peer id (`context.remote_id`, authenticated by
    the transport) is what is checked. Handlers keep hivemind's names (`_get_handle_name` of the hivemind class), so
    a plain hivemind averager reaches these guarded handlers too, and peers of this code find each other. Each
    class collects its own handlers (`_rpc_handlers` / `_stub_type` are cached per class, and inherited if unset).
    """

    gate = None  # None: an open run, every caller is served
    # the rules' pair factor for what it averages: gradients (see the rules' `aggregate` on groups of two)
    pair_factor_name = "PAIR_FACTOR"
    _rpc_handlers = None
    _stub_type = None
    _hivemind_class: type

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """hivemind's, with the calling process's SIGINT handler kept: hivemind sets SIGINT to ignored in the caller so
        that the averager's process it forks ignores it (its owner stops it), and never restores it, so the owner
        (a trainer, the aux peer) would ignore Ctrl+C from then on."""
        handler = signal.getsignal(signal.SIGINT)
        try:
            super().run_in_background(await_ready, timeout)
        finally:
            if handler is not None:  # None: a handler installed outside Python, which cannot be put back from here
                signal.signal(signal.SIGINT, handler)

    def __init__(self, *args, gate=None, aggregation=None, distrusted=(), **kwargs):
        rules = policy.rules()
        aggregation = rules.Aggregation() if aggregation is None else aggregation
        # set before hivemind starts the averager's process, which gets a copy of them
        self.gate = gate
        self.aggregation = replace(aggregation, pair_factor=getattr(rules, self.pair_factor_name))
        self._serving = 0  # all-reduce streams this averager is answering (counted in its own process)
        self._open = {kind: _OpenRequests(kind) for kind in MAX_REQUESTS}  # likewise, in its process
        # peers left out: `distrusted` from the start, then reducers caught returning implausible averages and peers
        # that served a refused state (added in its process), and those the peer's other averager left out
        self._distrusted = _LeftOut(distrusted)
        # each peer left out in the averager's process is also sent here, for this peer's progress tracker and its
        # other averager
        self._left_out_channel = mp.SimpleQueue()
        self._left_out_seen: set[bytes] = {peer.to_bytes() for peer in self._distrusted.peers}
        # peers this one can vouch for (a round with them came back whole and kept their contributions, or their
        # state was taken after its checks): their progress counts alone (the rules' `plausible_progress`). Sent
        # from the averager's process like those left out
        self._vouched_channel = mp.SimpleQueue()
        self._vouched_sent: set[PeerID] = set()  # in the averager's process
        self._vouched_seen: set[bytes] = set()
        # peers whose state was refused, skipped or timed out, and until when (time.monotonic(), in the averager's
        # process) they are passed over by a download that may take any peer's state
        self._cooling: dict[PeerID, float] = {}
        self._state_template = None  # what a downloaded state must match (the rules' StateTemplate)
        self._state_source: str | None = None  # the one peer (base58) to download it from; None: any
        # counted in its process, read in the one that made it
        self._partial_rounds = mp.Value("i", 0)  # rounds in which some averaged part did not come back
        self._states_downloaded = mp.Value("i", 0)
        self.ledger = RoundLedger()  # its matchmakings and all-reduces
        super().__init__(*args, **kwargs)

    @property
    def matchmaking_kwargs(self) -> dict:
        return self._matchmaking_kwargs

    @matchmaking_kwargs.setter
    def matchmaking_kwargs(self, kwargs: dict) -> None:
        # hivemind builds its Matchmaking (ours: GuardedMatchmaking) from these, in the averager's process
        self._matchmaking_kwargs = {**kwargs, "distrusted": self._distrusted, "ledger": self.ledger}

    def _distrust(self, peer_id: PeerID, why: str) -> None:
        if peer_id not in self._distrusted:
            self._distrusted.add(peer_id)
            self._left_out_channel.put(peer_id.to_bytes())
            logger.warning(f"peer {peer_id} is left out of this peer's averaging from now on: {why}")

    def _vouch(self, peers) -> None:
        for peer_id in peers:
            if peer_id != self.peer_id and peer_id not in self._distrusted and peer_id not in self._vouched_sent:
                self._vouched_sent.add(peer_id)
                self._vouched_channel.put(peer_id.to_bytes())

    async def _vouch_for_senders(self, runner: "RobustAllReduceRunner") -> None:
        """Once this peer has reduced its parts of a round: vouch for the senders whose contributions it kept."""
        reducer = runner.tensor_part_reducer
        try:
            await asyncio.wait_for(reducer.finished.wait(), timeout=self._allreduce_timeout or SERVING_WAIT_UNTIMED)
        except asyncio.TimeoutError:
            return
        kept = reducer.senders - reducer.rejected - reducer.dropped
        self._vouch(runner.sender_peer_ids[i] for i in kept if 0 <= i < len(runner.sender_peer_ids))

    def vouched_peers(self) -> set[bytes]:
        """The peers (as bytes) this averager can vouch for so far, read in the process that made it."""
        while not self._vouched_channel.empty():
            self._vouched_seen.add(self._vouched_channel.get())
        return self._vouched_seen

    def left_out_peers(self) -> set[bytes]:
        """The peers (as bytes) this averager has left out so far, read in the process that made it."""
        while not self._left_out_channel.empty():
            self._left_out_seen.add(self._left_out_channel.get())
        return self._left_out_seen

    def leave_out(self, peers: set[bytes]) -> None:
        """Leave out `peers` (left out by this peer's other averager) from now on; from the process that made it."""
        for peer in peers - self.left_out_peers():
            self._left_out_seen.add(peer)
            self._distrusted.inbox.put(peer)

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id: bytes | None = None, **kwargs):
        """Follows hivemind 1.1.12's DecentralizedAverager._run_allreduce_inplace_ (hivemind/averaging/averager.py),
        with RobustAllReduceRunner in place of AllReduceRunner: run the group's
        all-reduce and add each averaged delta to the local tensors as it arrives. The state is declared again for
        download once the round is done: hivemind's signal after every tensor made one DHT store per tensor, ~100
        in a DiLoCo trainer's final round."""
        group_id = group_info.group_id if group_id is None else group_id
        started = time.monotonic()
        runner = RobustAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            aggregation=self.aggregation,
            distrusted=self._distrusted,
            distrust=self._distrust,
            vouch=self._vouch,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        runner.vouching = asyncio.create_task(self._vouch_for_senders(runner))  # referenced while the round runs
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("an auxiliary peer receives no averages")
            return
        async for tensor, delta in azip(as_aiter(*tensors), runner):
            tensor.add_(delta, alpha=self._averaging_alpha)
            self.last_updated = get_dht_time()
        if runner.tensor_part_container.failed_size:  # hivemind kept this peer's own values for those parts
            with self._partial_rounds.get_lock():
                self._partial_rounds.value += 1
        self.ledger.reduced(time.monotonic() - started)
        self._state_updated.set()

    @property
    def partial_rounds(self) -> int:
        """Rounds so far in which some averaged part did not come back (hivemind's "received N% results")."""
        return self._partial_rounds.value

    @property
    def states_downloaded(self) -> int:
        """Training states downloaded and taken so far."""
        return self._states_downloaded.value

    @property
    def serving_wait(self) -> float:
        """Seconds `_shutdown` may wait for served streams to end; its process is given this much more to stop."""
        return self.next_chunk_timeout if self.next_chunk_timeout is not None else SERVING_WAIT_UNTIMED

    def shutdown(self) -> None:
        self.shutdown_timeout += self.serving_wait  # hivemind joins the process for shutdown_timeout, then kills it
        super().shutdown()

    async def _shutdown(self, timeout: float | None) -> None:
        deadline = time.monotonic() + self.serving_wait
        if self._serving:
            while self._serving and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(FLUSH_AFTER_SERVING)
        await super()._shutdown(timeout)

    def set_target_group_size(self, size: int | None) -> None:
        """The group size at which a leader starts its all-reduce at once, without waiting out its matchmaking time
        (`Matchmaking.target_group_size`, in the averager's process). Not waited for: the averager starts a task per
        message in the order sent, and this one sets the size before it first yields, so a step asked for next finds
        it; waiting for an answer would cost an inter-process round trip per outer step."""
        self._outer_pipe.send(("_set_target_group_size", [], dict(size=size)))

    async def _set_target_group_size(self, size: int | None) -> None:
        self._matchmaking.target_group_size = size

    def set_compression(self, codec: CompressionBase) -> None:
        """The codec this averager's rounds send from now on (`allreduce_kwargs["compression"]`, read in the
        averager's process as a round begins its all-reduce), and the state it serves (`state_compression`). Sent
        like `set_target_group_size`: a step asked for next finds it."""
        self.allreduce_kwargs["compression"] = self.state_compression = codec
        self._outer_pipe.send(("_set_compression", [], dict(codec=codec)))

    async def _set_compression(self, codec: CompressionBase) -> None:
        self.allreduce_kwargs["compression"] = self.state_compression = codec

    async def _expect_state(self, template, future: MPFuture, source: str | None = None) -> None:
        self._state_template, self._state_source = template, source
        future.set_result(None)

    async def _load_state_from_peers(self, future: MPFuture, timeout: float | None = None) -> None:
        """Follows hivemind 1.1.12's DecentralizedAverager._load_state_from_peers (hivemind/averaging/averager.py):
        hivemind's download of the training state (from the peer that declares the highest priority first), with
        each state checked against `_state_template` before it is taken: a peer that serves a corrupted one
        (the rules' `state_problem`) is left out from then on, and one whose step is out of range
        (`step_out_of_range`) or whose stream ended early (`state_cut_short`) skipped; the next peer
        is tried. `timeout` bounds each chunk
        (hivemind's own reading of it)."""
        chunk_timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        template = self._state_template
        rules = policy.rules()
        try:
            key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
            found = await asyncio.get_running_loop().run_in_executor(None, partial(self.dht.get, key, latest=True))
            sources = found.value if found is not None and isinstance(found.value, dict) else {}
            ranked = sorted(
                (
                    (float(info.value), random.random(), peer)
                    for peer, info in sources.items()
                    # any peer can write here: a subkey that is no peer id (hivemind's loop would fail on it) or a
                    # priority that is no number is passed over
                    if isinstance(peer, bytes)
                    and isinstance(info, ValueWithExpiration)
                    and isinstance(info.value, int | float)
                ),
                reverse=True,
            )
            now = time.monotonic()
            for _, _, peer_bytes in ranked:
                peer = PeerID(peer_bytes)
                if peer == self.peer_id or peer in self._distrusted:
                    continue
                if self._state_source is not None and peer.to_base58() != self._state_source:
                    continue
                if self._state_source is None and self._cooling.get(peer, 0.0) > now:
                    continue  # its state failed lately: not asked again until its cool-down ends
                try:
                    state = await self._download_state_from(peer, chunk_timeout, template)
                except Exception as e:
                    self._cool_down(peer, f"could not download the training state from peer {peer}: {e!r}")
                    continue
                if state is None:
                    continue  # that peer does not share its state
                if template is not None and (
                    why := rules.step_out_of_range(state[0], template) or rules.state_cut_short(state[1], template)
                ):
                    self._cool_down(peer, f"skipped the training state of peer {peer}: {why}; trying the next peer")
                    continue
                problem = rules.state_problem(*state, template) if template is not None else None
                if problem is not None:
                    self._distrust(peer, f"the training state it served was refused ({problem})")
                    continue
                logger.info(f"downloaded the training state from peer {peer}")
                with self._states_downloaded.get_lock():
                    self._states_downloaded.value += 1
                if template is not None:
                    self._vouch([peer])  # its state passed every check: its step is the state's
                future.set_result(state)
                return
        finally:
            if not future.done():
                future.set_result(None)

    def _cool_down(self, peer: PeerID, why: str) -> None:
        """Pass `peer` over for REFUSED_STATE_COOLDOWN seconds; `why` is logged once per cool-down."""
        if self._cooling.get(peer, 0.0) <= time.monotonic():
            logger.warning(f"{why} (not asked again for {REFUSED_STATE_COOLDOWN:.0f} s)")
        self._cooling[peer] = time.monotonic() + REFUSED_STATE_COOLDOWN

    async def _download_state_from(self, peer: PeerID, chunk_timeout: float, template):
        """The download loop of hivemind 1.1.12's DecentralizedAverager._load_state_from_peers, for one peer: its
        (metadata, tensors), or None if it shares nothing. With a template, a stream larger than the
        state it describes (4 bytes per value, plus STATE_SLACK_BYTES per tensor) is cut off as corrupted."""
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        limit = None if template is None else sum(4 * math.prod(s) + STATE_SLACK_BYTES for s in template.shapes)
        metadata, tensors, parts, received = None, [], [], 0
        async for message in aiter_with_timeout(stream, timeout=chunk_timeout):
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            received += len(message.tensor_part.buffer)
            if limit is not None and received > limit:
                raise ValueError(f"it sent over {limit} bytes, more than this peer's state holds")
            if message.tensor_part.dtype and parts:  # a new tensor begins: the previous one is complete
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return (metadata, tensors) if metadata else None

    @classmethod
    def _get_handle_name(cls, namespace, method_name: str) -> str:
        return cls._hivemind_class._get_handle_name(namespace, method_name)

    async def _admits(self, context) -> bool:
        if context.remote_id in self._distrusted:
            return False
        if self.gate is None:
            return True

        def read():
            # from a worker thread: an MPFuture made in this process's event loop outlives it when the averager
            # stops mid-read, and then fails to wake the closed loop ("Event loop is closed" at exit)
            return asyncio.get_running_loop().run_in_executor(None, partial(self.dht.get, self.gate.key, latest=True))

        return await self.gate.admits(context.remote_id, read)

    async def _served(self, kind: str, context: P2PContext, answer: AsyncIterator, busy=None) -> AsyncIterator:
        """hivemind's `answer` to an admitted caller, within this averager's bounds on open requests of `kind`
        (MAX_REQUESTS_PER_PEER, MAX_REQUESTS); `busy` (if any) when over them."""
        if not self._open[kind].enter(context.remote_id):
            if busy is not None:
                yield busy
            return
        try:
            async for message in answer:
                yield message
        finally:
            self._open[kind].leave(context.remote_id)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not await self._admits(context):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        busy = averaging_pb2.MessageFromLeader(code=averaging_pb2.GROUP_IS_FULL)
        async for message in self._served("join", context, super().rpc_join_group(request, context), busy):
            yield message

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        refused = averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        if not await self._admits(context):
            yield refused
            return
        self._serving += 1
        try:
            async for message in self._served("part", context, self._part_for_own_group(stream, context), refused):
                yield message
        finally:
            self._serving -= 1

    async def _part_for_own_group(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's answer to a part, once the part's own group has begun here (at most `next_chunk_timeout`
        seconds, after which hivemind answers as before). A groupmate that begins first sends its parts before this
        peer has begun the group; hivemind holds them only until its `_pending_groups_registered` event is set, and
        the end of any other round of this averager sets it: a round that ended meanwhile made it refuse them
        (BAD_GROUP_ID) and the group average half the parts."""
        first = await anext(stream)
        deadline = time.monotonic() + (self.next_chunk_timeout or PART_GROUP_WAIT)
        while first.group_id not in self._running_groups and time.monotonic() < deadline:
            await asyncio.sleep(PART_GROUP_POLL)
        async for message in super().rpc_aggregate_part(achain(as_aiter(first), stream), context):
            yield message

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        # refused: what hivemind answers when it does not share its state, and the caller tries the next peer
        if not await self._admits(context):
            return
        async for message in self._served("state", context, super().rpc_download_state(request, context)):
            yield message


class GuardedGradientAverager(GuardedAverager, GradientAverager):
    _hivemind_class = GradientAverager


class GuardedStateAverager(GuardedAverager, TrainingStateAverager):
    _hivemind_class = TrainingStateAverager
    pair_factor_name = "PARAMETER_PAIR_FACTOR"
    state_step_ceiling: int | None = None  # the highest step a downloaded state may have (set by GuardedOptimizer)
    # DiLoCo with overlap: the model's parameters when its outer round was sent; set while that round's outer step is
    # applied, so that the model keeps the inner progress it made since (see DiLoCoOptimizer)
    progress_since: list[torch.Tensor] | None = None
    # the parameters (indices into main_parameters) an outer step applies, None: all (Streaming DiLoCo's fragments)
    apply_only: set[int] | None = None

    @torch.no_grad()
    def _apply_optimizer_parameters_(self):
        """Extends hivemind 1.1.12's TrainingStateAverager._apply_optimizer_parameters_ (hivemind/optim/
        state_averager.py), which it calls without `progress_since`. hivemind copies the outer (offloaded) parameters
        into the model; with `progress_since`, the model moves by as much as the outer step moved them from where the
        round was sent: new outer + (model - sent); with `apply_only`, only those parameters do."""
        if self.progress_since is None and self.apply_only is None:
            return super()._apply_optimizer_parameters_()
        offloaded = [param for group in self.optimizer.param_groups for param in group["params"]]
        for index, (model_param, outer_param) in enumerate(zip(self.main_parameters, offloaded, strict=True)):
            if self.apply_only is not None and index not in self.apply_only:
                continue  # another fragment's: its inner progress stays in the model until its own round
            if self.progress_since is None:
                model_param.copy_(outer_param.to(model_param.device))
            else:
                model_param.add_(outer_param.to(model_param.device) - self.progress_since[index])

    def state_template(self):
        """This peer's own state as it would serve it (`get_current_state`), for checking a downloaded one."""
        metadata, tensors, _ = self.get_current_state()
        groups = self.optimizer.param_groups
        rules = policy.rules()
        return rules.StateTemplate(
            shapes=[tuple(tensor.shape) for tensor in tensors],
            optimizer_metadata=metadata["optimizer_metadata"],
            keys=list(rules.flat_keys(self.optimizer.state_dict())),
            max_lr=max(float(group.get("initial_lr", group["lr"])) for group in groups),
            min_step=self.local_epoch,
            max_step=self.state_step_ceiling,
        )

    def load_state_from_peers(self, source: str | None = None, **kwargs):
        """hivemind's, checked against this peer's own state; from peer `source` (base58) alone if given."""
        future = MPFuture()
        request = dict(template=self.state_template(), future=future, source=source)
        self._outer_pipe.send(("_expect_state", [], request))
        future.result()
        return super().load_state_from_peers(**kwargs)
