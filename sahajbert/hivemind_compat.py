"""Every use of hivemind beyond its documented API, in one place; checked against hivemind 1.1.12.

hivemind.Optimizer documents its constructor, `step()`, `zero_grad()`, `local_epoch`, `is_synchronized_with_peers()`,
`load_state_from_peers()`, `state_dict()`/`load_state_dict()`, `opt` and `shutdown()`. A trainer and the aux peer
also need what only its internals show: the swarm's progress as its ProgressTracker sees it, the master parameters
and the background rounds of its TrainingStateAverager, and the averager's matchmaking for the final parameter
round. Each function says what it relies on. After a hivemind upgrade, check these functions and nothing else:
`tests/test_stopping.py` runs them against stand-ins shaped like these internals.
"""

import asyncio
import contextlib
import copy
import heapq
import logging
import math
import multiprocessing as mp
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import AsyncIterator  # noqa: UP035 hivemind's servicer finds streaming RPCs by typing's _name

import hivemind
import numpy as np
import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.averaging.partition import AllreduceException, TensorPartReducer
from hivemind.compression import CompressionBase, NoCompression, deserialize_torch_tensor
from hivemind.compression import serialization as _serialization
from hivemind.compression.quantization import Quantile8BitQuantization, Quantization, Uniform8BitQuantization
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import GlobalTrainingProgress, ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import achain, aiter_with_timeout, anext, as_aiter, azip, enter_asynchronously
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import TimedStorage, ValueWithExpiration

from sahajbert import robust
from sahajbert.arguments import MAX_RECORD_LIFETIME
from sahajbert.signals import StopNow

logger = logging.getLogger(__name__)

CHECKED_VERSION = "1.1.12"


class _FixedExtract(Quantization):
    """hivemind 1.1.12's 8-bit decoders read their codebook size with `int()` of a one-element numpy array, which
    numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted"): every 8-bit part a peer received failed to
    decode, and its all-reduce went on without it. The same layout, read with `[0]`."""

    def extract(self, serialized_tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        quantized = torch.from_numpy(quantized.astype(np.int64)).reshape(tuple(serialized_tensor.size))
        codebook = torch.from_numpy(codebook.copy()).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)


class Uniform8Bit(_FixedExtract, Uniform8BitQuantization):
    """hivemind's uniform 8-bit codec (256 buckets over +-3 sigma around the mean, each decoded as the mean of the
    values in it), same wire format. Encoded without `torch.quantize_per_tensor`, which torch deprecates, and with
    each bucket's mean taken over the values themselves: hivemind's, when allowed to work in place, averaged the
    centered values and decoded them without the mean."""

    def quantize(self, tensor: torch.Tensor, allow_inplace: bool = False) -> tuple[np.ndarray, np.ndarray]:
        assert torch.is_floating_point(tensor)
        values = tensor.detach().to(torch.float32).flatten()
        centered = values - values.mean()
        sigma = centered.norm() / math.sqrt(max(1, centered.numel() - 1))
        scale = max(float(self.RANGE_IN_SIGMAS * sigma / self.n_bins), torch.finfo(torch.float32).tiny)
        buckets = torch.clamp(torch.round(centered / scale) + self.n_bins // 2, 0, self.n_bins - 1).to(torch.uint8)
        sums = torch.zeros(self.n_bins).scatter_add_(0, buckets.long(), values)
        counts = torch.bincount(buckets.long(), minlength=self.n_bins).clamp_min(1)
        return buckets.numpy().astype(self.indices_dtype), (sums / counts).numpy().astype(self.codebook_dtype)


class Quantile8Bit(_FixedExtract, Quantile8BitQuantization):
    pass


# hivemind decodes every received tensor with the codec registered under its type's name
# (`serialization._BASE_COMPRESSION_TYPES`): the fixed ones replace the two 8-bit codecs there
_serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"] = Uniform8Bit()
_serialization._BASE_COMPRESSION_TYPES["QUANTILE_8BIT"] = Quantile8Bit()

# bytes: the most one message of a p2p stream may declare. hivemind's own are at most an all-reduce part (2^19 bytes,
# DEFAULT_PART_SIZE_BYTES) or a state chunk (2^16 bytes), plus a header; its reader (P2P.receive_raw_data) waits
# for whatever length a peer's 8-byte header declares and holds every byte of it, so one stream could fill a peer's
# memory. Unary requests go through the p2p daemon, which bounds them (4 MiB, DEFAULT_MAX_MSG_SIZE).
MAX_STREAM_MESSAGE_BYTES = 8 * 2**20
# seconds a part for a group this averager has not begun yet waits for it (without a chunk timeout), and between looks
PART_GROUP_WAIT, PART_GROUP_POLL = 30.0, 0.01
SCHEDULE_MARGIN = 1.0  # seconds a round scheduled ahead starts before its timeout ends (hivemind asserts it does)
REFUSED_LOG_EVERY = 10.0  # seconds between two lines about refused input of one kind: a flood must not flood the log


class _RefusalLog:
    """Counts what a bound refused, and logs it at most once a REFUSED_LOG_EVERY, with the count so far."""

    def __init__(self) -> None:
        self.count, self.logged_at = 0, -math.inf

    def refused(self, line: str) -> None:
        self.count, now = self.count + 1, time.monotonic()
        if now - self.logged_at >= REFUSED_LOG_EVERY:
            self.logged_at = now
            logger.warning(f"{line}; {self.count} such so far")


_refused_messages = _RefusalLog()


async def _bounded_receive_raw_data(reader: asyncio.StreamReader) -> bytes:
    """hivemind's P2P.receive_raw_data, refusing a message declared larger than MAX_STREAM_MESSAGE_BYTES before any
    of it is read: the stream is then closed as if its sender had left (hivemind's reader ends quietly on that)."""
    header = await reader.readexactly(hivemind.p2p.P2P.HEADER_LEN)
    length = int.from_bytes(header, hivemind.p2p.P2P.BYTEORDER)
    if length > MAX_STREAM_MESSAGE_BYTES:
        _refused_messages.refused(
            f"closed a p2p stream whose message declared {length} bytes (the bound is {MAX_STREAM_MESSAGE_BYTES})"
        )
        raise asyncio.IncompleteReadError(partial=b"", expected=length)
    return await reader.readexactly(length)


hivemind.p2p.P2P.receive_raw_data = staticmethod(_bounded_receive_raw_data)

# The DHT records this peer holds for others. hivemind's DHTProtocol keeps every record a peer asks it to store until
# the expiration that peer chose, with no bound on their number or lifetime, and queues a heap entry for each store
# even of a record it already holds. Ours refuses a record that would not fit these bounds, and keeps the heap in
# proportion to the records. The swarm's own records are a few per peer (progress, metrics, state and group
# declarations, invite tokens), each under 1 KiB and renewed within minutes.
MAX_RECORD_BYTES = 4 * 2**10  # one value, or one subkey's value, with its signature
MAX_STORED_RECORDS = 10_000  # values and subkeys' values together, per storage (this peer's records and its cache)
RECOUNT_EVERY = 1.0  # seconds between two counts of a full storage's records (some may have expired)
_refused_records = _RefusalLog()


def _refuse_record(why: str) -> bool:
    _refused_records.refused(f"refused to store a DHT record: {why}")
    return False


def _compact(storage: TimedStorage) -> None:
    """Drop the heap entries of replaced records (hivemind drops them only once they expire)."""
    if len(storage.expiration_heap) > 2 * len(storage.data) + 64:
        storage.expiration_heap = [storage.key_to_heap[key] for key in storage.data]
        heapq.heapify(storage.expiration_heap)


class BoundedLocalStorage(DHTLocalStorage):
    """hivemind's DHTLocalStorage within MAX_RECORD_BYTES, MAX_RECORD_LIFETIME and MAX_STORED_RECORDS: a record
    over them is refused (the storing peer's store_ok says so), one already held can always be renewed. Installed
    for every DHT node this process or its children start (`hivemind.dht.protocol.DHTLocalStorage`)."""

    def __init__(self, maxsize: int | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(maxsize)
        # an upper estimate of records(), recounted (O(keys)) only when it reaches the bound, at most once a
        # RECOUNT_EVERY (of `clock`'s seconds): a flood costs no more than storing it
        self._estimate, self._counted_at, self._clock = 0, -math.inf, clock

    def records(self) -> int:
        """Values and subkeys' values held, the expired ones dropped first (hivemind drops them only when asked)."""
        self._remove_outdated()
        count = 0
        for item in self.data.values():
            if isinstance(item.value, DictionaryDHTValue):
                item.value._remove_outdated()
                count += len(item.value.data)
            else:
                count += 1
        return count

    def _has_room(self) -> bool:
        now = self._clock()
        if self._estimate >= MAX_STORED_RECORDS and now - self._counted_at >= RECOUNT_EVERY:
            self._estimate, self._counted_at = self.records(), now
        return self._estimate < MAX_STORED_RECORDS

    def _admits(self, value, expiration_time: float, new_record: bool) -> bool:
        if isinstance(value, bytes) and len(value) > MAX_RECORD_BYTES:
            return _refuse_record(f"{len(value)} bytes (the bound is {MAX_RECORD_BYTES})")
        if expiration_time > get_dht_time() + MAX_RECORD_LIFETIME:
            kept = expiration_time - get_dht_time()
            return _refuse_record(f"it would be kept {kept:.0f} s (the bound is {MAX_RECORD_LIFETIME:.0f})")
        if new_record:
            if not self._has_room():
                return _refuse_record(f"this peer holds {MAX_STORED_RECORDS} records already")
            self._estimate += 1
        return True

    def store(self, key, value, expiration_time, subkey=None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        if not self._admits(value, expiration_time, new_record=key not in self.data):
            return False
        stored = super().store(key, value, expiration_time)
        _compact(self)
        return stored

    def store_subkey(self, key, subkey, value, expiration_time) -> bool:
        held = self.data.get(key)
        new_record = not (
            held is not None and isinstance(held.value, DictionaryDHTValue) and subkey in held.value.data
        )
        if not self._admits(value, expiration_time, new_record):
            return False
        stored = super().store_subkey(key, subkey, value, expiration_time)
        held = self.data.get(key)
        if held is not None and isinstance(held.value, DictionaryDHTValue):
            _compact(held.value)
        _compact(self)
        return stored


hivemind.dht.protocol.DHTLocalStorage = BoundedLocalStorage

# The DHT requests this peer answers for one caller. hivemind's DHTProtocol answers every request at once, whatever
# its number of keys and however often it comes: a find for K keys builds K results with up to bucket_size (20)
# neighbours each (one 4 MiB request of 32-byte keys: about 120,000 keys and a response of hundreds of MB, built
# before the p2p daemon refuses to send it), and each request with a sender's node info starts a ping task. An
# honest peer's get or store names a few keys (a progress record, a matchmaking key, a state declaration), but
# hivemind's matchmaking polls its group key while it looks for a group: measured in tests/test_aux_peer.py's swarm
# (two trainers, an aux peer refreshing every second), one trainer sent one node up to 529 finds in 5 s (106 a
# second), most 5-second windows 10-300. The rate bound is 5x that peak. Beyond it a request is refused as a failed
# call (the caller's DHT then counts this peer as unresponsive to it).
MAX_DHT_KEYS_PER_REQUEST = 256
DHT_REQUESTS_PER_SECOND = 500.0  # per calling peer, the rate its allowance refills at
DHT_REQUEST_BURST = 2500  # per calling peer: its allowance when full (5 s at the rate)
# callers whose allowance is remembered; beyond, those whose allowance has refilled are forgotten, and while all are
# active a new caller is refused (a swarm has tens of peers: so many callers at once are one flood of identities)
MAX_DHT_CALLERS_TRACKED = 10_000
_refused_dht_keys, _refused_dht_rate = _RefusalLog(), _RefusalLog()


class DHTRequestRefused(Exception):
    """A DHT request over a bound: the p2p layer answers the caller with this error (nothing is logged per request)."""


class _Allowance:
    """A token bucket per calling peer: DHT_REQUEST_BURST requests at once, DHT_REQUESTS_PER_SECOND after that."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.tokens: dict[PeerID, tuple[float, float]] = {}  # peer -> (tokens, when counted: the clock's seconds)

    def take(self, peer: PeerID) -> bool:
        now = self.clock()
        tokens, counted = self.tokens.get(peer, (DHT_REQUEST_BURST, now))
        tokens = min(DHT_REQUEST_BURST, tokens + (now - counted) * DHT_REQUESTS_PER_SECOND)
        if len(self.tokens) >= MAX_DHT_CALLERS_TRACKED and peer not in self.tokens:
            self._forget_idle(now)
            if len(self.tokens) >= MAX_DHT_CALLERS_TRACKED:  # that many callers active at once: a flood of identities
                return False
        if tokens < 1:
            self.tokens[peer] = (tokens, now)
            return False
        self.tokens[peer] = (tokens - 1, now)
        return True

    def _forget_idle(self, now: float) -> None:
        """Drop the callers whose allowance has refilled: remembering them or not gives the same answer."""
        refill = DHT_REQUEST_BURST / DHT_REQUESTS_PER_SECOND
        self.tokens = {peer: value for peer, value in self.tokens.items() if now - value[1] < refill}


class BoundedDHTProtocol(DHTProtocol):
    """hivemind's DHTProtocol within MAX_DHT_KEYS_PER_REQUEST and each caller's request allowance (`_Allowance`).
    Installed for every DHT node this process or its children start (`hivemind.dht.node.DHTProtocol`); it serves
    under hivemind's handler names, so it answers and calls plain hivemind peers as before."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._allowance = _Allowance()

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return DHTProtocol._get_handle_name(namespace, method_name)

    def _admit(self, context: P2PContext, keys: int) -> None:
        if keys > MAX_DHT_KEYS_PER_REQUEST:
            _refused_dht_keys.refused(
                f"refused a DHT request for {keys} keys from peer {context.remote_id} (the bound is "
                f"{MAX_DHT_KEYS_PER_REQUEST})"
            )
            raise DHTRequestRefused(f"more than {MAX_DHT_KEYS_PER_REQUEST} keys")
        if not self._allowance.take(context.remote_id):
            _refused_dht_rate.refused(
                f"refused a DHT request from peer {context.remote_id}: over {DHT_REQUESTS_PER_SECOND:.0f} requests "
                f"per second (after a burst of {DHT_REQUEST_BURST})"
            )
            raise DHTRequestRefused("too many requests")

    async def rpc_ping(self, request: dht_pb2.PingRequest, context: P2PContext) -> dht_pb2.PingResponse:
        # hivemind's rpc_find and rpc_store ping on their caller's behalf, in a task of their own: that ping was
        # admitted with its request (raising in it would only log an unretrieved task exception)
        if context.handle_name.endswith(".rpc_ping"):
            self._admit(context, keys=0)
        return await super().rpc_ping(request, context)

    async def rpc_store(self, request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
        self._admit(context, keys=len(request.keys))
        return await super().rpc_store(request, context)

    async def rpc_find(self, request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
        self._admit(context, keys=len(request.keys))
        return await super().rpc_find(request, context)


hivemind.dht.node.DHTProtocol = BoundedDHTProtocol

# an `average_state_every` that no global step number is a multiple of: no parameter round at the coming steps
NO_STATE_AVERAGING = 2**62


@dataclass(frozen=True)
class SwarmPosition:
    """Where this peer and the swarm stand, as hivemind's progress tracker sees them."""

    local_step: int  # this peer's global step (hivemind's local_epoch)
    swarm_step: int  # the highest global step any peer reports (tracker.global_epoch)
    peers: int  # peers reporting progress now
    samples_accumulated: int  # the swarm's samples toward the next global step
    target_batch_size: int
    # this peer was matched in advance into the coming gradient all-reduce, which waits for its part
    gradient_round_waiting: bool
    # hivemind pre-scheduled that all-reduce and is still matching it: a group may yet form around this peer
    gradient_round_matching: bool
    # hivemind's estimate of the seconds until the swarm reaches the next global step (every peer's reported pace);
    # None before this peer has measured its own pace
    seconds_to_next_step: float | None = None


def position(optimizer: hivemind.Optimizer) -> SwarmPosition:
    """Read the swarm's progress: `tracker.global_epoch`, `tracker.global_progress` (num_peers,
    samples_accumulated, target_batch_size) and `optimizer.scheduled_grads` (a StepControl that hivemind
    pre-schedules for the next gradient round; its `stage` is AWAITING_TRIGGER once the group is formed)."""
    progress = optimizer.tracker.global_progress
    scheduled = optimizer.scheduled_grads
    return SwarmPosition(
        local_step=optimizer.local_epoch,
        swarm_step=optimizer.tracker.global_epoch,
        peers=progress.num_peers,
        samples_accumulated=progress.samples_accumulated,
        target_batch_size=progress.target_batch_size,
        gradient_round_waiting=scheduled is not None
        and not scheduled.done()
        and scheduled.stage == AveragingStage.AWAITING_TRIGGER,
        gradient_round_matching=_matching(scheduled),
        seconds_to_next_step=_seconds_until(progress.eta_next_epoch),
    )


def _seconds_until(dht_time: float) -> float | None:
    left = dht_time - get_dht_time()
    return left if 0 <= left < math.inf else None


def gradient_rounds_in_background(optimizer: hivemind.Optimizer) -> bool:
    """`delay_grad_averaging`: a step is announced (`tracker.update_epoch`) as its gradient round starts, not after."""
    return bool(optimizer.delay_grad_averaging)


MATCHING_STAGES = (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
SETTLE_POLL = 0.1  # seconds between looks at a round's stage


def _succeeded(control: StepControl) -> bool:
    """The round ended with its group's result (not cancelled, failed, or still running)."""
    return control.done() and not control.cancelled() and control.exception() is None


def _matching(scheduled: StepControl | None) -> bool:
    return (
        scheduled is not None
        and not scheduled.done()
        and not _cancel_sent(scheduled)
        and scheduled.stage in MATCHING_STAGES
    )


def _cancel_sent(control: StepControl) -> bool:
    """This process has already called the round off (its cancel future is set: hivemind's StepControl.cancel)."""
    return control._cancel is not None and control._cancel.done()


def cancel_round(control: StepControl | None) -> None:
    """Call off a round this peer will not make, once. A second StepControl.cancel raises InvalidStateError (its
    cancel future is already set), and a round called off still reads "looking for a group" until the averager's
    process has seen the cancel: in a fresh-clone CI run, a DiLoCo trainer's outer round cancelled at its last step
    was cancelled again at once by the final parameter round's start, and the trainer exited 1."""
    if control is not None and not _cancel_sent(control):
        control.cancel()


def _pending(scheduled: StepControl | None) -> bool:
    """A round scheduled ahead and not yet begun: still looking for its group, or formed and waiting for this peer."""
    return scheduled is not None and not scheduled.done() and not scheduled.triggered


def settle_gradient_round(optimizer: hivemind.Optimizer, timeout: float, interrupted: Callable[[], bool]) -> None:
    """Wait until the pre-scheduled gradient round (`optimizer.scheduled_grads`) is matched into a group or fails;
    one still matching after `timeout` seconds (or when `interrupted()`) is cancelled.

    hivemind keeps matching a pre-scheduled round until its deadline, also for a peer that has stopped training: a
    group formed around it afterwards would wait for a part that never comes, until the all-reduce timeout.
    """
    scheduled = optimizer.scheduled_grads
    deadline = time.monotonic() + timeout
    while _matching(scheduled) and time.monotonic() < deadline and not interrupted():
        time.sleep(SETTLE_POLL)
    if _matching(scheduled):
        cancel_round(scheduled)


def wait_for_swarm_progress(optimizer: hivemind.Optimizer, timeout: float) -> None:
    """Block until the tracker has read the swarm's progress once (`tracker.fetched_global_progress_this_epoch`)."""
    optimizer.tracker.fetched_global_progress_this_epoch.wait(timeout)


def read_progress_now(optimizer: hivemind.Optimizer, timeout: float) -> bool:
    """Make the tracker read the swarm's progress from the DHT now and wait for it; False if no read came in time.

    The fetcher sleeps until `global_progress.next_fetch_time` or until `global_state_updated` is set; when woken it
    re-reads the (now past) fetch time, fetches, and sets `fetched_global_progress_this_epoch`.
    """
    tracker = optimizer.tracker
    if isinstance(optimizer, DiLoCoOptimizer) and optimizer.read_ahead_came_in:
        return True  # asked for halfway through the round, and in: no wait before the outer round
    request_progress_read(tracker)
    return tracker.fetched_global_progress_this_epoch.wait(timeout)


def request_progress_read(tracker: ProgressTracker) -> None:
    """Wake the tracker's fetcher to read the swarm's progress now, without waiting for it."""
    tracker.fetched_global_progress_this_epoch.clear()
    tracker.global_progress.next_fetch_time = get_dht_time()
    tracker.global_state_updated.set()


def step_would_be_global(optimizer: hivemind.Optimizer, batch_size: int) -> bool:
    """Would `optimizer.step(batch_size)` start a global step, by the tracker's current view? (hivemind adds the
    batch to `global_progress.samples_accumulated`, then checks `tracker.ready_to_update_epoch`.)"""
    tracker = optimizer.tracker
    progress = tracker.global_progress
    if isinstance(optimizer, DiLoCoOptimizer):  # its outer round starts with its H-th inner step
        behind = tracker.global_epoch > optimizer.local_epoch and not optimizer.round_in_flight
        return behind or optimizer.outer_round_due(optimizer.inner_step + 1)
    return (
        tracker.global_epoch > tracker.local_progress.epoch
        or progress.samples_accumulated + batch_size >= tracker.target_batch_size
        or get_dht_time() >= progress.eta_next_epoch
    )


def inner_round(optimizer: hivemind.Optimizer) -> tuple[int, int] | None:
    """DiLoCo: (inner steps made since the last outer step, inner steps per outer step); None in synchronous mode,
    where every optimizer.step() changes the parameters only at a global step."""
    if isinstance(optimizer, DiLoCoOptimizer):
        return optimizer.inner_step, optimizer.inner_steps
    return None


def outer_round_in_flight(optimizer: hivemind.Optimizer) -> bool:
    """DiLoCo with overlap: an outer round averages in the background, its outer step not yet made."""
    return isinstance(optimizer, DiLoCoOptimizer) and optimizer.round_in_flight


def take_inner_step_seconds(optimizer: hivemind.Optimizer) -> float:
    """DiLoCo: seconds spent in inner optimizer steps since the last call (then 0 again); 0 in synchronous mode."""
    if not isinstance(optimizer, DiLoCoOptimizer):
        return 0.0
    seconds, optimizer.inner_step_seconds = optimizer.inner_step_seconds, 0.0
    return seconds


def local_state(optimizer: hivemind.Optimizer) -> dict | None:
    """DiLoCo: a copy of what a trainer changes between outer steps besides the parameters (the inner optimizer's
    state, the round's progress), to roll back to; None in synchronous mode."""
    return copy.deepcopy(optimizer.inner_state_dict()) if isinstance(optimizer, DiLoCoOptimizer) else None


def restore_local_state(optimizer: hivemind.Optimizer, state: dict | None) -> None:
    if state is not None:
        optimizer.load_inner_state_dict(copy.deepcopy(state))


def set_refresh_period(optimizer: hivemind.Optimizer, seconds: float) -> None:
    """The most seconds between two reads of the swarm's progress (`tracker.max_refresh_period`, read per fetch)."""
    optimizer.tracker.max_refresh_period = seconds


def set_bandwidth(optimizer: hivemind.Optimizer, mbit: float) -> None:
    """Declare this peer's bandwidth to both averagers; each round's matchmaking gathers `averager.bandwidth` in this
    process (DecentralizedAverager.step), and hivemind's load_balance_peers splits the all-reduce by it."""
    for averager in (optimizer.state_averager, optimizer.grad_averager):
        if averager is not None:
            averager.bandwidth = mbit


def gradient_averager_factory(gate=None, aggregation: robust.Aggregation = robust.Aggregation(), **averager_opts):
    """hivemind 1.1.x gives `averager_opts` to the state averager only: the gradient averager, made by this factory
    (the documented `grad_averager_factory`), gets the same bandwidth and group size, the access gate and the
    robust aggregation. It serves no state: hivemind's Optimizer downloads a gradient averager's state (its gradient
    buffers, the model's size) after the training state only to discard it."""
    return partial(
        GuardedGradientAverager, gate=gate, aggregation=aggregation, allow_state_sharing=False, **averager_opts
    )


def set_state_priority(optimizer: hivemind.Optimizer, priority: float) -> None:
    """Newcomers download the state from the peer with the highest priority (`state_averager.state_sharing_priority`,
    declared in the DHT under `<averager.prefix>.all_averagers`); a client-mode peer serves no state."""
    if not optimizer.client_mode:
        optimizer.state_averager.state_sharing_priority = priority


def own_state_priority(optimizer: hivemind.Optimizer) -> float:
    """This peer's declared state priority; -1 for a client-mode peer, which declares none."""
    return -1.0 if optimizer.client_mode else optimizer.state_averager.state_sharing_priority


def state_priorities(optimizer: hivemind.Optimizer) -> dict[PeerID, float]:
    """Every other peer that offers its state, with its declared priority (the key load_state_from_peers reads)."""
    averager = optimizer.state_averager
    key = f"{averager.prefix}.all_averagers"
    found = optimizer.dht.get(key, latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    own = optimizer.dht.peer_id
    priorities = {}
    for peer_id, info in entries.items():
        if info.value is None:
            continue
        peer = PeerID(peer_id)
        if peer != own:
            priorities[peer] = float(info.value)
    return priorities


def starting_peers(optimizer: hivemind.Optimizer) -> set[PeerID]:
    """Trainers of a new run that offer their state at a start priority (between 0 and 1: step 0, see
    trainer.start_priority) but report no progress yet (`tracker.training_progress_key`, whose entries name their
    `peer_id`; a peer reports once it has trained a batch)."""
    announced = {peer for peer, priority in state_priorities(optimizer).items() if 0 < priority < 1}
    if not announced:
        return set()
    found = optimizer.dht.get(optimizer.tracker.training_progress_key, latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    reporting = {
        PeerID(entry.value["peer_id"])
        for entry in entries.values()
        if isinstance(entry.value, dict) and "peer_id" in entry.value
    }
    return announced - reporting


def progress_peers(optimizer: hivemind.Optimizer) -> set[str]:
    """The peers (base58) that report training progress now (`tracker.training_progress_key`); a peer that left
    cleanly stored an empty report, and a vanished one's report expires after --metadata_expiration seconds."""
    found = optimizer.dht.get(optimizer.tracker.training_progress_key, latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    return {
        PeerID(entry.value["peer_id"]).to_base58()
        for entry in entries.values()
        if isinstance(entry.value, dict) and "peer_id" in entry.value
    }


# how hivemind reports an averaging round's end (at the optimizer's status level, INFO with verbose=True)
GRADIENT_ROUND_FAILED = re.compile(r"^Averaging gradients failed with (.*)$")
GRADIENT_ROUND_DONE = re.compile(r"^Averaged gradients with (\d+) peers$")
STATE_ROUND_FAILED = re.compile(r"^Averaging failed with (.*)$")
ROUND_LOGGERS = ("hivemind.optim.optimizer", "hivemind.optim.state_averager")


def own_samples_per_second(optimizer: hivemind.Optimizer) -> float:
    """This peer's throughput as hivemind measures it (`tracker.performance_ema.samples_per_second`)."""
    return float(optimizer.tracker.performance_ema.samples_per_second)


def report_step(optimizer: hivemind.Optimizer, step: int) -> None:
    """Tell the swarm this peer is at `step` with no samples (`tracker.report_local_progress`)."""
    optimizer.tracker.report_local_progress(step, samples_accumulated=0)


def master_parameters(optimizer: hivemind.Optimizer) -> list[torch.Tensor]:
    """The model's parameters as hivemind holds them (`state_averager.main_parameters`); with offload_optimizer
    the optimizer steps host copies of them (the documented `optimizer.opt.param_groups`)."""
    return list(optimizer.state_averager.main_parameters)


def set_step(optimizer: hivemind.Optimizer, step: int) -> None:
    """Move this peer to `step` and the learning-rate schedule with it (`state_averager.local_epoch`, then
    `state_averager._update_scheduler()`, which sets the scheduler to the averager's epoch)."""
    optimizer.state_averager.local_epoch = step
    optimizer.state_averager._update_scheduler()


def follow_schedule(optimizer: hivemind.Optimizer) -> None:
    """The learning rate follows the current global step after a state was loaded
    (`state_averager._update_scheduler()`; `load_state_dict` restores the step but not the scheduler)."""
    optimizer.state_averager._update_scheduler()


def prefer_as_state_donor(optimizer: hivemind.Optimizer) -> None:
    """Newcomers download the state from this peer first (`state_averager.state_sharing_priority`, highest wins)."""
    optimizer.state_averager.state_sharing_priority = optimizer.local_epoch


def has_pending_updates(optimizer: hivemind.Optimizer) -> bool:
    """A background optimizer step or averaging round has not been applied yet (`state_averager.pending_updates`;
    DiLoCo with overlap: an outer round in flight)."""
    return outer_round_in_flight(optimizer) or bool(optimizer.state_averager.pending_updates)


def apply_pending_updates(optimizer: hivemind.Optimizer, timeout: float, outer_round: bool = True) -> bool:
    """Wait for every background update and apply it to the parameters; False if one still runs after `timeout` s.
    `outer_round`: DiLoCo with overlap: also the outer round in flight (False: it lands at a later inner step).

    `state_averager.step(wait_for_delayed_updates=True)` waits for each update at most the all-reduce timeout and
    then leaves it running, so it is called again until `pending_updates` is empty or the time is up.
    """
    if outer_round and isinstance(optimizer, DiLoCoOptimizer):
        optimizer.finish_outer_round(timeout)
    averager = optimizer.state_averager
    deadline = time.monotonic() + timeout
    averager.step(wait_for_delayed_updates=True)
    while averager.pending_updates and time.monotonic() < deadline:
        averager.step(wait_for_delayed_updates=True)
    return not averager.pending_updates


def skip_parameter_averaging(optimizer: hivemind.Optimizer) -> None:
    """No parameter round at the coming global steps (`optimizer.average_state_every`, read at every step)."""
    optimizer.average_state_every = NO_STATE_AVERAGING


def start_parameter_round(
    optimizer: hivemind.Optimizer, group_bits: str, wait: float, timeout: float, group_size: int | None = None
) -> StepControl:
    """Start one parameter all-reduce that matches only peers under `group_bits` and begins in `wait` seconds, or as
    soon as `group_size` peers are in its group (`GuardedAverager.set_target_group_size`; None: hivemind's).

    Relies on: `scheduled_state`/`scheduled_grads` (rounds pre-scheduled for the next step, cancelled while still
    looking for a group: this peer will not make them), `state_averager.set_group_bits` (the matchmaking key),
    `schedule_step(scheduled_time, gather, timeout)` (hivemind makes the peer whose wait ends first the leader and
    starts the all-reduce when that wait ends; `gather` carries this peer's step to the others),
    `sync_epoch_when_averaging` (peers adopt the highest step gathered, the LR schedule with it), and
    `state_averager.step(averaging_round=True, averaging_control=..., delay_averaging=True)` (runs the round in the
    background; its result lands as a pending update). The returned control's result maps each peer to its step.

    The round sends fp32 (`GuardedAverager.set_compression`), whatever the run's codec: hivemind returns to each peer
    the average minus the value it received from it, in the round's codec, and the peer adds that to its own value.
    In fp16 each peer kept the rounding of that difference (2^-11 of half the peers' divergence): overlapped DiLoCo
    peers 8 apart ended 0.004 apart, and a value near 0 outside the agreement tolerance. In fp32 every peer ends at
    the average, up to fp32's rounding. It doubles the bytes of one round per run. A state downloaded from this peer
    from then on is fp32 too: a final round that came back partial ends with one peer's parameters downloaded.
    """
    for scheduled in (optimizer.scheduled_state, optimizer.scheduled_grads):
        if _matching(scheduled):
            cancel_round(scheduled)
    averager = optimizer.state_averager
    averager.set_group_bits(group_bits)
    if group_size is not None:
        averager.set_target_group_size(group_size)
    averager.set_compression(NoCompression())
    control = averager.schedule_step(
        scheduled_time=get_dht_time() + wait, gather=optimizer.local_epoch, timeout=timeout
    )
    averager.sync_epoch_when_averaging = True
    averager.step(
        averaging_round=True, averaging_control=control, delay_averaging=True, averaging_opts={"timeout": timeout}
    )
    return control


def partial_rounds(optimizer: hivemind.Optimizer) -> int:
    """Parameter rounds so far in which some averaged part did not come back: this peer kept its own values for it,
    so its parameters differ from those of the round's other peers."""
    return optimizer.state_averager.partial_rounds


def state_taken(optimizer: hivemind.Optimizer) -> None:
    """After `take_state_of` brought a state: report this peer's new step, and let a download be due again only a
    refresh period later (hivemind's check that this peer is in sync would otherwise download it once more)."""
    report_step(optimizer, optimizer.local_epoch)
    if isinstance(optimizer, GuardedOptimizer):
        optimizer.downloads.done(True, optimizer.tracker.max_refresh_period)


def take_state_of(optimizer: hivemind.Optimizer, peer_id: str, step: int, timeout: float) -> bool:
    """Download the training state (parameters included) at global step `step` from peer `peer_id` (base58) alone
    and take it, waiting at most `timeout` seconds; whether it came."""
    averager = optimizer.state_averager
    # the ceiling a state may have is set afresh: the one left by this peer's last download (the swarm's step then,
    # say 3 for a peer that caught up at step 2) refused the final state of step 9 in a test run
    averager.state_step_ceiling = step
    before = averager.states_downloaded
    try:
        averager.load_state_from_peers(source=peer_id, timeout=timeout)
    except TimeoutError:
        return False
    return averager.states_downloaded > before


def round_steps(control: StepControl) -> list[int] | None:
    """The steps gathered from every peer of a finished round, or None if it failed, was cancelled or is running."""
    if not _succeeded(control):
        return None
    return sorted(control.result().values())


def round_peers(control: StepControl) -> set[str]:
    """The peers (base58) of a finished round, this one included; empty if it failed, was cancelled or is running."""
    return {peer.to_base58() for peer in control.result()} if _succeeded(control) else set()


class RequestPipe:
    """The end of hivemind's DHT pipe its process reads requests from. A request carries its reply channel, which
    the DHT process fetches from the sender: when the sender (an averager at a stop) has exited first, the read
    fails with EOFError, which hivemind's loop does not catch (`DHT.run`: OSError, ConnectionError and RuntimeError
    only), so the DHT process ended with a traceback. Raised as ConnectionResetError, hivemind logs it (a line the
    swarm's `_GoneCaller` filter drops) and reads the next request."""

    def __init__(self, end):
        self._end = end

    def recv(self):
        try:
            return self._end.recv()
        except EOFError as e:
            raise ConnectionResetError("the sender of a DHT request exited before it was read") from e

    def __getattr__(self, name: str):
        return getattr(self._end, name)


class GuardedDHT(hivemind.DHT):
    """hivemind.DHT whose process reads its requests through `RequestPipe`."""

    def run(self) -> None:
        self._inner_pipe = RequestPipe(self._inner_pipe)  # in the DHT's own process, which run() starts
        super().run()


def unbacked_claims(optimizer: hivemind.Optimizer) -> dict[str, int]:
    """Steps other serving peers claim beyond the swarm's step this peer follows, and beyond the usual one-step lag
    (no other peer backs them, and this one cannot vouch for their claimants), by peer id (base58)."""
    tracker = optimizer.tracker
    if not isinstance(tracker, BoundedProgressTracker):
        return {}
    followed = tracker.global_epoch
    return {PeerID(peer).to_base58(): step for peer, step in tracker.claims_ahead.items() if step > followed + 1}


def left_out_peers(optimizer: hivemind.Optimizer) -> set[str]:
    """The peers (base58) this peer's averagers have left out (`GuardedOptimizer`)."""
    return {PeerID(peer).to_base58() for peer in optimizer._left_out_peers()}


def is_identity_file(path: str) -> bool:
    """Is `path` a peer identity as hivemind writes it (P2P.generate_identity): a libp2p PrivateKey protobuf holding an
    RSA key in DER? The p2p daemon itself only says "proto: cannot parse invalid wire-format data" of a bad one."""
    from cryptography.hazmat.primitives import serialization
    from google.protobuf.message import DecodeError
    from hivemind.proto import crypto_pb2

    try:
        with open(path, "rb") as f:
            key = crypto_pb2.PrivateKey.FromString(f.read())
        serialization.load_der_private_key(key.data, password=None)
    except (OSError, DecodeError, ValueError, TypeError):
        return False
    return key.key_type == crypto_pb2.KeyType.RSA


# a relayed connection is reset after this much data (bytes, each way) or time (s): the most libp2p accepts
RELAY_DATA_LIMIT = 1 << 32
RELAY_TIME_LIMIT = 3600

# p2pd flags that hivemind.P2P.create does not pass on: added to every p2p daemon this process starts, through
# `P2P._make_process_args` (its one place that turns keyword arguments into the daemon's command line)
_DAEMON_FLAGS: dict[str, object] = {}


def set_daemon_flags(**flags) -> None:
    """Extra p2pd flags for the daemons this process (and the DHT process it forks) starts from now on."""
    from hivemind.p2p.p2p_daemon import P2P

    if not getattr(P2P._make_process_args, "_sahajbert", False):
        original = P2P._make_process_args

        def make_process_args(*args, **kwargs):
            flags = dict(_DAEMON_FLAGS)
            if "trustedRelays" not in kwargs:
                # a daemon started without the relays (P2P.is_identity_taken's probe, with --identity_path): p2pd
                # refuses autoRelay with neither relay discovery nor trusted relays
                flags.pop("relayDiscovery", None)
            return original(*args, **{**kwargs, **flags})

        make_process_args._sahajbert = True
        P2P._make_process_args = staticmethod(make_process_args)
    _DAEMON_FLAGS.clear()
    _DAEMON_FLAGS.update(flags)


def relay_options(auto_relay: bool, relays: list[str], reachability: str, client_mode: bool) -> dict:
    """hivemind.DHT keyword arguments, and the p2pd flags hivemind lacks, for NAT traversal over libp2p relays.

    - A NAT'd peer books a slot on the given relays as soon as AutoNAT finds it private. p2pd's default relay
      discovery waits 3 minutes for 4 candidates; `-relayDiscovery=0` with `-trustedRelays` uses these at once.
    - Every peer that accepts connections relays (p2pd's `-relayService`, on by default) with limits sized for
      averaging: libp2p's default is 128 KiB and 2 minutes per relayed connection, which resets an all-reduce a
      fraction of the way in (a state download then ends early: "shape ... is invalid for input of size ...").
      p2pd (learning-at-home's, main.go) starts two relay services on one protocol: one with libp2p's defaults at
      start-up, and one with these limits once AutoNAT finds the peer public; the later one takes the protocol
      over. So a relay must not force its reachability public (`--reachability public` makes the two start
      together, and either may win), and libp2p's bounds hold: asked for more than its 1 h reservation or
      4 GiB, the second service fails to start (measured here with 24 h and with 1 TiB).
    """
    options: dict = {}
    flags: dict[str, object] = {"relayDataLimit": RELAY_DATA_LIMIT, "relayTimeLimit": f"{RELAY_TIME_LIMIT}s"}
    if reachability != "auto":
        options["force_reachability"] = reachability
    if auto_relay and relays and not client_mode:
        options.update(use_auto_relay=True, trusted_relays=list(relays))
        flags["relayDiscovery"] = False
    return {"dht": options, "daemon": flags}


# tasks of ours running in the DHT process, held until done (see kept_alive)
_KEPT: set = set()


async def kept_alive(coroutine):
    """Await `coroutine` as a task this module holds. hivemind's DHT process runs each `run_coroutine` call in a task
    that nothing references, and asyncio's client streams hold their reader weakly: a call waiting on a p2p stream
    can be garbage-collected mid-wait (GeneratorExit in the DHT process; the caller's future never resolves)."""
    task = asyncio.ensure_future(coroutine)
    _KEPT.add(task)
    task.add_done_callback(_KEPT.discard)
    return await task


async def _answer(dht, node) -> None:
    return None


# seconds to wait for the DHT process to read the calls already sent to it, before shutting it down
DRAIN_TIMEOUT = 10.0


def drain_dht_calls(dht: hivemind.DHT, timeout: float = DRAIN_TIMEOUT) -> bool:
    """Wait until the DHT process has read every call this process sent it; False if it did not answer in time.

    A call made with `return_future=True` (hivemind's progress tracker ends with one, a last store that withdraws
    this peer's progress) carries the end of a pipe, which the DHT process fetches from this process when it reads
    the call; had this process exited by then, the DHT process fails with a traceback (EOFError in multiprocessing's
    resource sharer), which a loaded machine makes likely. It reads calls in order: one answered means all earlier
    ones were read."""
    if not dht.is_alive():
        return True
    try:
        dht.run_coroutine(_answer, return_future=True).result(timeout=timeout)
        return True
    except Exception:  # a timeout, or a DHT process that ended meanwhile: shutting it down is all that is left
        return False


# ---- invite-only runs (sahajbert.access) ----


def identity_key(identity_path: str):
    """A peer identity file's RSA key as hivemind's RSAPrivateKey (built through its pickling state, the one way
    hivemind loads an existing key: `__setstate__` with the DER bytes `to_bytes` writes)."""
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    with open(identity_path, "rb") as f:
        der = crypto_pb2.PrivateKey.FromString(f.read()).data
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})
    return key


def peer_id_of_public_key(public_key) -> PeerID:
    """libp2p's peer id of an RSA key (hivemind.RSAPublicKey): sha2-256 multihash of its PublicKey protobuf, the
    rule hivemind's PeerID.from_identity applies to a private key."""
    import hashlib

    import multihash
    from cryptography.hazmat.primitives import serialization
    from hivemind.proto import crypto_pb2

    der = public_key._public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256")))


def dht_authorizer(node):
    """The authorizer a DHT node checks requests with (`node.protocol.authorizer`), inside the DHT process."""
    return node.protocol.authorizer


class RobustAccumulator:
    """Takes the place of hivemind's accumulator tensor in its TensorPartReducer (`reducer.accumulator`): where
    hivemind adds each contribution to a sum (`add_`) and divides by the total weight once all have arrived
    (`div_`), this keeps the contributions and combines them with `robust.aggregate`."""

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
        combined = robust.aggregate(self.contributions, self.weights, self.reducer.aggregation, own=mine)
        self.reducer.dropped.update(self.senders[i] for i in combined.dropped)
        self.reducer.outliers.update(self.senders[i] for i in combined.outliers)
        return combined.tensor


class RobustTensorPartReducer(TensorPartReducer):
    """hivemind's reducer of this peer's parts, with `RobustAccumulator` as the accumulator of each part (set up in
    `reset_accumulators`, which hivemind calls for every next part). Keeps each contribution of the current part
    until all have arrived: memory for one part times the group's size, instead of one part."""

    def __init__(self, part_shapes, num_senders: int, aggregation: robust.Aggregation, own_sender: int | None):
        self.aggregation = aggregation
        self.own_sender = own_sender  # this peer's index among the senders (None: it sends nothing, an aux peer)
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
        leads, but a client-mode peer cannot, so it waited until its time had passed. DiLoCo trainers schedule
        their rounds from their own inner steps plus --diloco_wait; with a client-mode trainer, 2 of 4 outer rounds
        took 31-45 s (the wait) against under 0.1 s without client mode. A client-mode peer waits for any group
        anyway, so it offers its round's deadline (the round fails then, grouped or not)."""
        expiration = super().get_request_expiration_time()
        if self.client_mode and self.step_control is not None and math.isfinite(self.step_control.deadline):
            return max(expiration, self.step_control.deadline)
        return expiration


hivemind.averaging.averager.Matchmaking = GuardedMatchmaking


class RobustAllReduceRunner(AllReduceRunner):
    """hivemind's all-reduce of one group, with three defences:

    - this peer reduces its parts with `RobustTensorPartReducer`;
    - each average another peer returns for this peer's parts is checked (`robust.implausible`); an implausible one
      ends that exchange, and hivemind then keeps this peer's own values for the rest of that reducer's parts
      (`register_failed_reducer`), as for a reducer that timed out. The reducer is reported to `distrust`;
    - peers in `distrusted` are left out: their contributions are not awaited and their averages not asked for.
    """

    def __init__(
        self,
        *args,
        aggregation: robust.Aggregation,
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
        own_sender = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None
        self.tensor_part_reducer = RobustTensorPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            len(self.sender_peer_ids),
            aggregation,
            own_sender,
        )
        for index, peer_id in enumerate(self.sender_peer_ids):
            if peer_id in distrusted and peer_id != self.peer_id:
                self.banned_senders.add(peer_id)
                self.active_senders.add(peer_id)  # not awaited: hivemind waits for every sender that is not active
                self.tensor_part_reducer.on_sender_failed(index)
        if len(self.active_senders) == len(self.sender_peer_ids):
            self.all_senders_started.set()
        if aggregation.rule != "plain":  # plain: hivemind's all-reduce, no checks
            container = self.tensor_part_container
            own = [part for parts in container._input_parts_by_peer for part, _ in parts]
            self._own_norm = math.sqrt(sum(float(part.float().norm()) ** 2 for part in own))
            self._own_size = max(1, sum(part.numel() for part in own))
            self._register = container.register_processed_part
            container.register_processed_part = self._register_checked

    def _register_checked(self, peer_index: int, part_index: int, delta: torch.Tensor) -> None:
        peer_id = self.ordered_peer_ids[peer_index]
        own, _ = self.tensor_part_container._input_parts_by_peer[peer_index][part_index]
        # a peer whose own part is non-finite (its parameters went bad) cannot judge anyone: it rolls back instead
        if peer_id != self.peer_id and robust.finite(own):
            scale = max(float(own.float().norm()), self._own_norm * math.sqrt(own.numel() / self._own_size))
            why = robust.implausible(delta, scale)
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
        await super()._communicate_with_peer(peer_id)

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
_refused_requests = _RefusalLog()


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
    pair_factor = robust.PAIR_FACTOR  # what it averages: gradients (see robust.aggregate on groups of two)
    _rpc_handlers = None
    _stub_type = None
    _hivemind_class: type

    def __init__(
        self, *args, gate=None, aggregation: robust.Aggregation = robust.Aggregation(), distrusted=(), **kwargs
    ):
        # set before hivemind starts the averager's process, which gets a copy of them
        self.gate, self.aggregation = gate, replace(aggregation, pair_factor=self.pair_factor)
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
        # state was taken after its checks): their progress counts alone (robust.plausible_progress). Sent from the
        # averager's process like those left out
        self._vouched_channel = mp.SimpleQueue()
        self._vouched_sent: set[PeerID] = set()  # in the averager's process
        self._vouched_seen: set[bytes] = set()
        # peers whose state was refused, skipped or timed out, and until when (time.monotonic(), in the averager's
        # process) they are passed over by a download that may take any peer's state
        self._cooling: dict[PeerID, float] = {}
        self._state_template: robust.StateTemplate | None = None  # what a downloaded state must match
        self._state_source: str | None = None  # the one peer (base58) to download it from; None: any
        # counted in its process, read in the one that made it
        self._partial_rounds = mp.Value("i", 0)  # rounds in which some averaged part did not come back
        self._states_downloaded = mp.Value("i", 0)
        super().__init__(*args, **kwargs)

    @property
    def matchmaking_kwargs(self) -> dict:
        return self._matchmaking_kwargs

    @matchmaking_kwargs.setter
    def matchmaking_kwargs(self, kwargs: dict) -> None:
        # hivemind builds its Matchmaking (ours: GuardedMatchmaking) from these, in the averager's process
        self._matchmaking_kwargs = {**kwargs, "distrusted": self._distrusted}

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
        """hivemind's own (averager.py), with RobustAllReduceRunner in place of AllReduceRunner: run the group's
        all-reduce and add each averaged delta to the local tensors as it arrives. The state is declared again for
        download once the round is done: hivemind's signal after every tensor made one DHT store per tensor, ~100
        in a DiLoCo trainer's final round."""
        group_id = group_info.group_id if group_id is None else group_id
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
        it; the answer cost a trainer an inter-process round trip per outer step on busy cores."""
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

    async def _expect_state(self, template: robust.StateTemplate, future: MPFuture, source: str | None = None) -> None:
        self._state_template, self._state_source = template, source
        future.set_result(None)

    async def _load_state_from_peers(self, future: MPFuture, timeout: float | None = None) -> None:
        """hivemind's download of the training state (from the peer that declares the highest priority first), with
        each state checked against `_state_template` before it is taken: a peer that serves a corrupted one
        (`robust.state_problem`) is left out from then on, and one whose step is out of range
        (`robust.step_out_of_range`) or whose stream ended early (`robust.state_cut_short`) skipped; the next peer
        is tried. `timeout` bounds each chunk
        (hivemind's own reading of it)."""
        chunk_timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        template = self._state_template
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
                    why := robust.step_out_of_range(state[0], template) or robust.state_cut_short(state[1], template)
                ):
                    self._cool_down(peer, f"skipped the training state of peer {peer}: {why}; trying the next peer")
                    continue
                problem = robust.state_problem(*state, template) if template is not None else None
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
        """One peer's (metadata, tensors), or None if it shares nothing. With a template, a stream larger than the
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
    pair_factor = robust.PARAMETER_PAIR_FACTOR
    state_step_ceiling: int | None = None  # the highest step a downloaded state may have (set by GuardedOptimizer)
    # DiLoCo with overlap: the model's parameters when its outer round was sent; set while that round's outer step is
    # applied, so that the model keeps the inner progress it made since (see DiLoCoOptimizer)
    progress_since: list[torch.Tensor] | None = None

    @torch.no_grad()
    def _apply_optimizer_parameters_(self):
        """hivemind copies the outer (offloaded) parameters into the model; with `progress_since`, the model moves
        by as much as the outer step moved them from where the round was sent: new outer + (model - sent)."""
        if self.progress_since is None:
            return super()._apply_optimizer_parameters_()
        offloaded = [param for group in self.optimizer.param_groups for param in group["params"]]
        for model_param, outer_param, sent in zip(self.main_parameters, offloaded, self.progress_since, strict=True):
            model_param.add_(outer_param.to(model_param.device) - sent)

    def state_template(self) -> robust.StateTemplate:
        """This peer's own state as it would serve it (`get_current_state`), for checking a downloaded one."""
        metadata, tensors, _ = self.get_current_state()
        groups = self.optimizer.param_groups
        return robust.StateTemplate(
            shapes=[tuple(tensor.shape) for tensor in tensors],
            optimizer_metadata=metadata["optimizer_metadata"],
            keys=list(robust.flat_keys(self.optimizer.state_dict())),
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


def _peer_name(peer: bytes) -> str:
    try:
        return str(PeerID(peer))
    except Exception:
        return repr(peer)


class _ReportTrigger(threading.Event):
    """hivemind's `ProgressTracker.should_report_progress`: every `report_local_progress` sets it, and the tracker
    then publishes its report to the DHT at once; while `held`, a report stays local until the next publication (a
    report that sets it, or the periodic one every metadata_expiration / 2 seconds)."""

    held = False

    def set(self) -> None:
        if not self.held:
            super().set()


def _claims_ahead(claims: dict, own_peer: bytes, own_epoch: int) -> dict[bytes, int]:
    """From raw progress records: the other serving peers' steps above `own_epoch`, by peer id (bytes)."""
    ahead = {}
    for record in claims.values():
        value = getattr(record, "value", None)
        if not isinstance(value, dict) or value.get("client_mode") or value.get("peer_id") == own_peer:
            continue
        epoch, peer = value.get("epoch"), value.get("peer_id")
        if isinstance(epoch, int) and isinstance(peer, bytes) and epoch > own_epoch:
            ahead[peer] = epoch
    return ahead


class BoundedProgressTracker(ProgressTracker):
    """hivemind's progress tracker, reading the swarm's progress records through `robust.plausible_progress`: one
    peer's claims cannot move the swarm's step or fill its batch. Each distinct change is logged once."""

    def __init__(
        self,
        *args,
        left_out: Callable[[], set[bytes]] = set,
        vouched: Callable[[], set[bytes]] = set,
        start: bool = False,
        **kwargs,
    ):
        self._step_began = (None, time.monotonic())  # (global step, when this peer first saw it)
        self._noted: set[tuple[str, bytes]] = set()
        self._left_out, self._vouched = left_out, vouched
        # the other serving peers' steps above this peer's own at the last read (peer id bytes -> step), counted
        # or not: a claim no other peer backs is one a trainer may check by asking for that peer's state
        self.claims_ahead: dict[bytes, int] = {}
        self._epoch_updates = 0  # step changes so far (`update_epoch`)
        super().__init__(*args, start=False, **kwargs)
        self.should_report_progress = _ReportTrigger()  # before the reporter starts waiting on it
        if start:
            self.start()

    def update_epoch(self, new_epoch: int | None = None) -> int:
        self._epoch_updates += 1
        return super().update_epoch(new_epoch)

    async def _progress_fetcher(self):
        """hivemind's fetcher, holding `lock_global_progress` only to take in what it read, not over the DHT read:
        a step change (`pause_updates` takes the lock) waited out whole reads over slow links, 3.4% of a tiny DiLoCo
        trainer's time at H = 50 with overlap. A read that a step change overtook is taken in (peers, their steps)
        but not as this step's read, and another is made at once: hivemind's optimizer checks that this peer is in
        sync on the first read after a change (`fetched_global_progress_this_epoch`), which must begin after it.
        (Dropped instead, a peer whose steps come faster than its reads would never take one in.)"""
        loop = asyncio.get_event_loop()
        shutdown = asyncio.ensure_future(loop.run_in_executor(None, self.shutdown_triggered.wait))
        try:
            while not self.shutdown_triggered.is_set():
                wait = max(0.0, self.global_progress.next_fetch_time - get_dht_time())
                if await loop.run_in_executor(None, self.global_state_updated.wait, wait):
                    self.global_state_updated.clear()
                    continue
                updates = self._epoch_updates
                read = asyncio.ensure_future(self.dht.get(self.training_progress_key, latest=True, return_future=True))
                await asyncio.wait({read, shutdown}, return_when=asyncio.FIRST_COMPLETED)
                if self.shutdown_triggered.is_set():
                    break
                found = await read
                async with enter_asynchronously(self.lock_global_progress):
                    metadata = found.value if isinstance(found, ValueWithExpiration) else None
                    self.global_progress = self._parse_swarm_progress_data(metadata)
                    if self._epoch_updates == updates:
                        self.fetched_global_progress_this_epoch.set()
                    else:
                        self.global_progress.next_fetch_time = get_dht_time()
        finally:
            logger.log(self.status_loglevel, f"No longer fetching {self.training_progress_key}")

    @contextlib.contextmanager
    def reports_held(self, held: bool = True):
        """Within: each report stays local until the next publication (`held` False: published as usual)."""
        self.should_report_progress.held = held
        try:
            yield
        finally:
            self.should_report_progress.held = False

    def note_local_progress(self, local_epoch: int, samples_accumulated: int) -> None:
        """`report_local_progress`, published with the next report (not at once: one DHT store per call)."""
        with self.reports_held():
            self.report_local_progress(local_epoch, samples_accumulated)

    def _parse_swarm_progress_data(self, metadata):
        if isinstance(metadata, dict) and metadata:
            step, began = self._step_began
            claims_ahead = _claims_ahead(metadata, self.dht.peer_id.to_bytes(), self.local_progress.epoch)
            last = getattr(self, "global_progress", None)  # the last read's view (none before the first)
            batch_full = (
                last is not None
                and last.epoch == self.local_progress.epoch
                and last.samples_accumulated >= self.target_batch_size / 2
            )
            metadata, notes = robust.plausible_progress(
                metadata,
                own_peer=self.dht.peer_id.to_bytes(),
                own_epoch=self.local_progress.epoch,
                target=self.target_batch_size,
                step_seconds=time.monotonic() - began,
                standing=robust.Standing(left_out=self._left_out(), vouched=self._vouched()),
                batch_full=batch_full,
            )
            self.claims_ahead = claims_ahead
            for note, peer in notes:
                kind = note.split(" of ")[0]  # once per peer and kind of change: claims repeat at every refresh
                if (kind, peer) not in self._noted and len(self._noted) < 1000:
                    self._noted.add((kind, peer))
                    # a claim no other peer backs is also how a trainer that ran alone looks to a newcomer: the
                    # trainer logs what it decides (it asks that peer for its state once)
                    level = logging.INFO if robust.UNBACKED in note else logging.WARNING
                    logger.log(level, f"swarm progress: {note}, from peer {_peer_name(peer)}; further ones not logged")
        progress = super()._parse_swarm_progress_data(metadata)
        if progress.epoch != self._step_began[0]:
            self._step_began = (progress.epoch, time.monotonic())
        return progress


DOWNLOAD_BACKOFF_MAX = 8  # refresh periods: the longest wait between two attempts at the swarm's state
DOWNLOAD_BACKOFF_LOGGED = 4  # failures in a row after which the wait is logged once more


class DownloadBackoff:
    """When a peer may next try to download the swarm's state: after an attempt that brought none, after 2, 4 ..
    DOWNLOAD_BACKOFF_MAX refresh periods (a period after one that did), never in a loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock, self.failures, self.next_at = clock, 0, -math.inf

    def due(self) -> bool:
        return self.clock() >= self.next_at

    def done(self, taken: bool, period: float) -> float:
        """Record an attempt's outcome; the seconds until the next attempt is due."""
        self.failures = 0 if taken else self.failures + 1
        wait = period * min(2**self.failures, DOWNLOAD_BACKOFF_MAX)
        self.next_at = self.clock() + wait
        return wait


class GuardedOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer whose state averager is guarded and robust, and whose progress tracker bounds claims; its
    gradient averager comes from `gradient_averager_factory`. `_make_state_averager` and `_make_progress_tracker`
    repeat hivemind 1.1.12's own arguments."""

    def __init__(self, *args, gate=None, aggregation: robust.Aggregation = robust.Aggregation(), **kwargs):
        self._gate, self._aggregation = gate, aggregation
        self.downloads = DownloadBackoff()
        super().__init__(*args, **kwargs)

    def _should_load_state_from_peers(self) -> bool:
        # hivemind's answer first (it also clears its once-per-step check); then no more than the backoff allows
        return super()._should_load_state_from_peers() and self.downloads.due()

    def load_state_from_peers(self, **kwargs) -> bool:
        """One attempt at hivemind's download of the training state (hivemind's own retries at once, forever, with
        a traceback per failure), its outcome fed to `self.downloads`; whether a state was taken. The gradient
        averager's state is not asked for: hivemind resets those buffers after a download anyway."""
        # a state from beyond the swarm's step (bounded by BoundedProgressTracker) is refused; a peer that has seen
        # no other peer yet has no step to hold it to
        seen_others = self.tracker.global_progress.num_peers > 1
        self.state_averager.state_step_ceiling = self.tracker.global_epoch + 1 if seen_others else None
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            # a round this peer joined: it takes part with weight 0 rather than make the others match again
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)
        before = self.state_averager.states_downloaded
        with self.tracker.pause_updates():
            try:
                self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
            except TimeoutError:
                logger.info(f"no peer sent its state within {self.load_state_timeout:.0f} s")
            except StopNow:
                raise
            except Exception as e:  # hivemind retried any error at once, forever: one line, and the backoff
                logger.warning(f"a state download failed ({e!r}): training on")
            taken = self.state_averager.states_downloaded > before
            wait = self.downloads.done(taken, self.tracker.max_refresh_period)
            if not taken and self.downloads.failures in (1, DOWNLOAD_BACKOFF_LOGGED):
                logger.info(f"no usable state from the swarm's peers: training on, next try in {wait:.0f} s or later")
            if self.tracker.global_epoch - 1 <= self.local_epoch < self.tracker.global_epoch:
                self.state_averager.local_epoch = self.tracker.global_epoch  # one step behind: catch up, as hivemind
            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
            if self.use_gradient_averaging:
                self.grad_averager.reset_accumulated_grads_()
                if not self.client_mode:
                    self.grad_averager.state_sharing_priority = self.local_epoch
        return taken

    def _update_global_epoch(self, grad_scaler) -> None:
        # `_average_gradients_and_load_into_optimizer` may call off this step's parameter round; later steps keep it
        average_state_every = self.average_state_every
        try:
            super()._update_global_epoch(grad_scaler)
        finally:
            self.average_state_every = average_state_every

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: StepControl | None) -> None:
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        if self.delay_grad_averaging or maybe_step_control is None or _succeeded(maybe_step_control):
            return
        if self.average_state_every == NO_STATE_AVERAGING:
            return  # no parameter round to call off (DiLoCo; the run's last step)
        # Lockstep (a gradient round in the foreground, then a parameter round; each waits up to the round timeout
        # for a group that is not coming): a gradient round that found nobody while other peers report progress
        # most likely ran while they were in their parameter round. Making this step's parameter round too would
        # keep this peer one round out of phase with them for good: both kinds of round then find nobody and every
        # step takes two round timeouts (a CPU + XLA swarm, after a round cancelled at a join, made 60-s steps until
        # its test timed out). Without it, this peer's next gradient round starts as theirs does. The parameters
        # stay as they are until the next step's parameter round.
        logger.info("the gradient round found no group: this step makes no parameter round, to meet the others' next")
        self.average_state_every = NO_STATE_AVERAGING

    def shutdown(self):
        # hivemind's shutdown cancels each scheduled round whose stage reads "looking for a group", also one this
        # peer has called off already (`cancel_round`), which raised InvalidStateError; one that has ended needs
        # nothing either
        for name in ("scheduled_grads", "scheduled_state"):
            control = getattr(self, name)
            if control is not None and (control.done() or _cancel_sent(control)):
                setattr(self, name, None)
        super().shutdown()

    def _vouched_peers(self) -> set[bytes]:
        averagers = (getattr(self, "state_averager", None), getattr(self, "grad_averager", None))
        vouched = set().union(*(a.vouched_peers() for a in averagers if isinstance(a, GuardedAverager)))
        return vouched - self._left_out_peers()

    def _left_out_peers(self) -> set[bytes]:
        # the tracker starts before the averagers: until they exist, nobody is left out
        averagers = (getattr(self, "state_averager", None), getattr(self, "grad_averager", None))
        averagers = [a for a in averagers if isinstance(a, GuardedAverager)]
        left_out = set().union(*(a.left_out_peers() for a in averagers))
        for averager in averagers:  # what one averager caught, the other leaves out too
            averager.leave_out(left_out)
        return left_out

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        return BoundedProgressTracker(
            left_out=self._left_out_peers,
            vouched=self._vouched_peers,
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        return GuardedStateAverager(
            gate=self._gate,
            aggregation=self._aggregation,
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )


NEVER = 2**62  # samples: a target the swarm's progress never reaches (a DiLoCo round is started by its inner steps)
NOTE_PERIOD = 0.5  # seconds: a DiLoCo trainer notes its progress (samples) at most this often between its reports


class DiLoCoOptimizer(GuardedOptimizer):
    """DiLoCo (Douillard et al. 2023): H local steps of an inner optimizer on the model, then an all-reduce of the
    pseudo-gradients (the outer parameters minus the model's, weighted by the samples behind each) and one outer
    optimizer step (SGD with Nesterov momentum) on the outer parameters, which the model then takes.

    Built on hivemind.Optimizer's gradient path with `offload_optimizer`: the state averager's host copies of the
    parameters are the outer parameters and its optimizer is the outer one, the gradient averager's averaged tensors
    are their `.grad` (`_make_gradient_averager`), and `_update_global_epoch` averages what was accumulated, steps
    the outer optimizer (on this peer's own pseudo-gradient when the round fails or no other peer is there) and
    copies the result into the model (`_apply_optimizer_parameters_`). The inner optimizer's state travels with the
    outer state as `extra_tensors`, so a newcomer downloads both. A trainer that missed an outer round (the swarm's
    step is past its own) downloads the swarm's state at its next step, as hivemind's peers do.

    With `overlap`, the round runs in the background (in the gradient averager's process) while the next inner
    steps run from where this peer's inner steps ended; when it ends (at the first inner step after), the outer step
    is made as above, and the model moves by as much as it moved the outer parameters from where the round was sent
    (`GuardedStateAverager.progress_since`): it keeps its inner progress, and its next pseudo-gradient is that
    progress alone. This is Streaming DiLoCo's overlap with a delay of one round (Douillard et al. 2025; Kale et al.
    2025 call it the naive delayed update): each outer step arrives one round late. A round still in flight at the
    next H-th inner step (it waits for a slower peer to make its H steps) is not waited for: the inner steps go on
    until it ends, and the next round, sent then, carries them all (the rounds weigh each pseudo-gradient by its
    samples), so a faster peer computes where it would have idled. From `most_inner_steps` on (H + H/10, at least
    H + 1) the round is waited for: peers on alike hardware differ by a few percent in pace, and an outer step stays
    within 10% of H inner steps (where a round outlasts them, at small H on slow links, a looser bound would make
    every outer step one of more inner steps than H, and the one-round delay's loss worse).

    `inner_optimizer`: a factory over the parameter groups; `inner_lr(step)`: its learning rate at an inner step,
    counted over the run (global step x H + the inner steps since); `wait`: seconds a peer that made its H steps
    waits for every other trainer to make theirs (its round starts as soon as the group holds all of them), 0: the
    peers that are ready go on within the matchmaking time; `last_step`: the run's last global step (--max_steps;
    None: none), at which no outer round starts (with overlap, the inner steps made after the last round stay in the
    model for the final parameter round).
    """

    def __init__(
        self,
        *,
        inner_optimizer,
        inner_lr: Callable[[int], float],
        inner_steps: int,
        wait: float,
        overlap: bool = False,
        last_step: int | None = None,
        **kwargs,
    ):
        # copies: a torch optimizer writes its settings into the groups it is given, and the outer one gets them too
        self.inner = inner_optimizer([dict(group) for group in kwargs["params"]])
        self.inner_lr, self.inner_steps, self.wait, self.overlap = inner_lr, inner_steps, wait, overlap
        # with overlap: the most inner steps an outer step takes while its round in flight waits for a slower peer
        self.most_inner_steps = inner_steps + max(1, inner_steps // 10)
        self.last_step = last_step
        self.inner_step = 0  # inner steps since the last outer step
        self.round_samples = 0  # samples behind them
        self.inner_step_seconds = 0.0  # in inner optimizer steps, until `take_inner_step_seconds`
        self.round_began = time.monotonic()  # when this outer step's first inner step began (for `_match_ahead`)
        self.next_round: StepControl | None = None  # with overlap: a group looked for while a round is in flight
        self.own_pseudo_gradient: list[torch.Tensor] | None = None  # during an outer step: this peer's, for a failure
        # the swarm's progress as it was when this round's read ahead was asked for (None: not asked yet)
        self.read_ahead_from: GlobalTrainingProgress | None = None
        self.sent_parameters: list[torch.Tensor] | None = None  # with overlap: the model's when its round was sent
        self.published_epoch: int | None = None  # the step of this peer's last published progress record
        self.noted_at = 0.0  # when this peer's progress was last reported or noted (time.monotonic)
        extras = tuple(self._initialize_inner_state())
        kwargs.update(
            extra_tensors=extras,
            offload_optimizer=True,
            delay_optimizer_step=False,
            delay_grad_averaging=False,
            use_local_updates=False,
            average_state_every=NO_STATE_AVERAGING,
            target_batch_size=NEVER,
        )
        super().__init__(**kwargs)

    @torch.no_grad()
    def _initialize_inner_state(self):
        """Create the inner optimizer's state now (zeros, as its first step would), in the order it is shared; its
        step count is a tensor too, so that it travels and is averaged with the rest."""
        for group in self.inner.param_groups:
            for p in group["params"]:
                state = self.inner.state[p]
                state["step"] = torch.zeros(1)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
                yield from (state["step"], state["exp_avg"], state["exp_avg_sq"])

    @property
    def run_inner_step(self) -> int:
        return self.local_epoch * self.inner_steps + self.inner_step

    def step(self, closure=None, batch_size: int | None = None, grad_scaler=None):
        """One inner step on this pass's gradients; the outer round after the H-th."""
        if self.auxiliary:
            return super().step()
        if grad_scaler is not None:
            raise ValueError("DiLoCo steps the inner optimizer itself: it takes no fp16 gradient scaler")
        batch_size = batch_size if batch_size is not None else self.batch_size_per_step
        # while a round runs in the background, the swarm may be a step ahead: that round brings this peer there
        if not self.round_in_flight and self._should_load_state_from_peers():
            logger.log(self.status_loglevel, "Peer is out of sync")
            self.load_state_from_peers()
            return None  # these gradients came from parameters the swarm has moved past
        for group in self.inner.param_groups:
            group["lr"] = self.inner_lr(self.run_inner_step)
        started = time.perf_counter()
        self.inner.step()
        self.inner_step_seconds += time.perf_counter() - started
        self.inner_step += 1
        self.round_samples += batch_size
        if self.round_in_flight and (self.scheduled_grads.done() or self.inner_step >= self.most_inner_steps):
            self.finish_outer_round()  # it ended, or this peer is a round ahead of the slowest: wait for it
        self._report_progress()
        self._read_ahead()
        self._match_ahead()
        if self.inner_step >= self.inner_steps and not self.round_in_flight:
            self._outer_step()
        return None

    def outer_round_due(self, inner_step: int) -> bool:
        """Whether an outer round would start after `inner_step` inner steps, as things are now (as `step` decides):
        from the H-th on, once no round is in flight (one in flight is finished at the first inner step after it
        ends, at the latest at the `most_inner_steps`-th)."""
        if inner_step < self.inner_steps:
            return False
        in_flight = self.round_in_flight and not self.scheduled_grads.done()
        return not in_flight or inner_step >= self.most_inner_steps

    def _report_progress(self) -> None:
        """The swarm needs this peer's step and presence from its progress record, not its samples (no count of
        samples starts a round): the record is published once per step, at the first inner step made at it, and
        refreshed by the tracker's periodic report; the other reports stay local. Each store of a signed record
        costs a DHT lookup that returns every peer's record: a store per inner step was most of what a trainer
        sent, and the epoch change's own report (held in `_update_global_epoch`) was one more per round. The other
        reports are noted at most every NOTE_PERIOD seconds: the periodic report sends the last one, seconds apart,
        and each note (a record built, the throughput's average updated) cost ~0.7% of a tiny trainer's time."""
        now = time.monotonic()
        if self.local_epoch != self.published_epoch:
            self.tracker.report_local_progress(self.local_epoch, self.round_samples)
            self.published_epoch, self.noted_at = self.local_epoch, now
        elif now - self.noted_at >= NOTE_PERIOD:
            self.tracker.note_local_progress(self.local_epoch, self.round_samples)
            self.noted_at = now

    def _update_global_epoch(self, grad_scaler) -> None:
        # the new step is published with the next inner step's report (`_report_progress`), except the run's last,
        # after which there is no inner step
        last = self.last_step is not None and self.local_epoch + 1 >= self.last_step
        with self.tracker.reports_held(not (last or self.auxiliary)):
            super()._update_global_epoch(grad_scaler)

    def _read_ahead(self) -> None:
        """Halfway through a round, ask for the fresh read of the swarm's progress (its peers, its step) that the
        outer round starts on, without waiting: it comes in during the next inner steps, and the H-th step does not
        wait for a DHT read (a read over a slow link took as long as 6 tiny inner steps). Not in the run's first
        round, whose read follows the wait for the trainers starting with it; with overlap the second round, also
        sent at step 0 (while the first is in flight), reads ahead like the rest: without, its send waited for a
        fresh read and then looked for its group, and a tiny overlapped trainer idled 0.1-0.5 s at step 2. Also
        while the previous round is in flight: its outer step changes only this peer's own step, which the outer
        round does not read from the swarm, and asking only once it had ended (often after halfway, with overlap at
        H = 50) left the H-th step waiting for the read, 4% of a trainer's time."""
        if (self.local_epoch == 0 and not self.round_in_flight) or self.read_ahead_from is not None:
            return
        if self.inner_step >= self.inner_steps // 2:
            self.read_ahead_from = self.tracker.global_progress
            request_progress_read(self.tracker)

    def _match_ahead(self) -> None:
        """Once the read asked halfway through the round has come in, look for the outer round's group, timed for
        the H-th inner step, where its all-reduce then starts at once: matchmaking takes several round trips (the
        DHT, then the leader) that otherwise came after the H-th step, ~half of a tiny trainer's ~1.1 s rounds on
        the slow links (where 50 inner steps take ~1 s). hivemind's optimizer pre-schedules its gradient rounds the
        same way, in `scheduled_grads`, which the trainer's stopping rules read. With overlap, also while the
        previous round's all-reduce runs, into `next_round` until that round ends (matchmaking over the slow links
        took ~0.65 s, 30 tiny inner steps: begun only once a round had ended, ~35 steps into the next, it was still
        looking at the H-th); not while that round still looks for its group: the averager looks for one group at a
        time, and the group size it aims for is one setting."""
        if not self.read_ahead_came_in or _pending(self.scheduled_grads) or _pending(self.next_round):
            return
        if self.round_in_flight and _matching(self.scheduled_grads):
            return
        coming_step = self.local_epoch + (1 if self.round_in_flight else 0)  # the step the next round starts from
        if self.last_step is not None and coming_step >= self.last_step:
            return  # no outer round follows
        peers = self.tracker.global_progress.num_peers
        if peers > 1:
            seconds_per_step = (time.monotonic() - self.round_began) / max(1, self.inner_step)
            control = self._schedule_round(peers, (self.inner_steps - self.inner_step) * seconds_per_step)
            if control is None:
                return  # the round is looked for at the H-th step instead
            if self.round_in_flight:
                self.next_round = control
            else:
                self.scheduled_grads = control

    def _schedule_round(self, peers: int, delay: float) -> StepControl | None:
        """A gradient round that looks for its group now and starts its all-reduce when triggered; a group waits
        `delay` seconds (the time to the H-th inner step) plus `wait` for the others, the matchmaking time at
        least, and is complete as soon as it holds every trainer when `wait` > 0. None, with a warning, when
        hivemind refuses it: the round is then looked for when it begins, as hivemind's optimizer does."""
        if self.wait > 0:
            self.grad_averager.set_target_group_size(peers)
        wait = max(self.wait, self.matchmaking_time)
        # hivemind refuses a start later than the round's timeout: a pace estimate can ask for that (a trainer whose
        # inner steps stalled), and the round then starts at the latest time that still fits
        if self.averaging_timeout is not None:
            delay = min(delay, self.averaging_timeout - wait - SCHEDULE_MARGIN)
        try:
            return self.grad_averager.schedule_step(
                scheduled_time=get_dht_time() + max(0.0, delay) + wait, timeout=self.averaging_timeout
            )
        except Exception as e:  # noqa: BLE001 - hivemind asserts its scheduling rules; a round it refuses is not made
            logger.warning(f"could not schedule the outer round ahead ({e!r}): it looks for its group when it begins")
            return None

    @property
    def read_ahead_came_in(self) -> bool:
        """The read asked for this round has come in (each read replaces the tracker's `global_progress`)."""
        return self.read_ahead_from is not None and self.tracker.global_progress is not self.read_ahead_from

    @property
    def round_in_flight(self) -> bool:
        """With overlap: an outer round runs in the background, its outer step not yet made."""
        return self.sent_parameters is not None

    @torch.no_grad()
    def _outer_step(self) -> None:
        if self.last_step is not None and self.local_epoch >= self.last_step:
            return  # the run has ended: the trainer stops at this step
        outer = [p for group in self.state_averager.optimizer.param_groups for p in group["params"]]
        for model_param, outer_param in zip(self.state_averager.main_parameters, outer):
            model_param.grad = outer_param.to(model_param.device) - model_param
        self.grad_averager.reset_accumulated_grads_()
        self.grad_averager.accumulate_grads_(self.round_samples)  # once: the pseudo-gradient, weighted by samples
        peers = self.tracker.global_progress.num_peers
        # a group looked for ahead (`_match_ahead`) is taken as it is; alone, hivemind cancels it
        if peers > 1 and not _pending(self.scheduled_grads):
            self.scheduled_grads = self._schedule_round(peers, 0.0)  # None: hivemind schedules its own below
        self.own_pseudo_gradient = [p.grad for p in self.state_averager.main_parameters]
        self.inner_step = self.round_samples = 0
        self.round_began = time.monotonic()
        self.read_ahead_from = None
        # alone, there is no round to overlap: the outer step is made now
        if self.overlap and peers > 1 and super()._begin_averaging_gradients(None):
            self.sent_parameters = [p.detach().clone() for p in self.state_averager.main_parameters]
            logger.log(self.status_loglevel, "Outer round sent: the next inner steps run while it averages")
        else:
            try:
                self._update_global_epoch(None)
            finally:
                self.own_pseudo_gradient = None
                # the pace of the next inner steps is measured from here: the wait for this round is no inner step's
                self.round_began = time.monotonic()
        self.zero_grad(set_to_none=True)

    def finish_outer_round(self, timeout: float | None = None) -> None:
        """With overlap: wait for the round in flight (at most `timeout` seconds, then it is cancelled; None: the
        averaging timeout), make its outer step (on this peer's own pseudo-gradient if the round failed) and move
        the model by as much, keeping the inner progress made since the round was sent."""
        if not self.round_in_flight:
            return
        if timeout is not None:
            try:
                self.scheduled_grads.result(timeout)
            except BaseException:  # failed or still running: hivemind's fallback below takes the own pseudo-gradient
                if not self.scheduled_grads.done():
                    cancel_round(self.scheduled_grads)
        logger.log(self.status_loglevel, f"Outer round awaited after {self.inner_step} inner step(s) behind it")
        self.state_averager.progress_since = self.sent_parameters
        try:
            self._update_global_epoch(None)
        finally:
            self.state_averager.progress_since = self.sent_parameters = self.own_pseudo_gradient = None
            if self.next_round is not None:  # the next round's group, looked for meanwhile, is the one to use
                self.scheduled_grads, self.next_round = self.next_round, None

    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        # with overlap the round in flight was begun when it was sent (`_outer_step`); `finish_outer_round`'s
        # `_update_global_epoch` only awaits it
        return True if self.round_in_flight else super()._begin_averaging_gradients(grad_scaler)

    @torch.no_grad()
    def _load_local_gradients_into_optimizer(self):
        """No other peer, or a failed round: the outer step takes this peer's own pseudo-gradient. (hivemind's
        fallback reloads the gradient accumulators, which the start of a round has reset: after a failed round the
        outer step got zeros and took the model back to where its inner steps began, H steps of work lost.)"""
        if self.own_pseudo_gradient is None:  # not in an outer step (an auxiliary peer's round): hivemind's way
            return super()._load_local_gradients_into_optimizer()
        logger.log(self.status_loglevel, "Proceeding with this peer's own pseudo-gradient")
        with self.grad_averager.get_tensors() as averaged:
            for target, own in zip(averaged, self.own_pseudo_gradient):
                target.copy_(own)
        self._load_averaged_gradients_into_optimizer_()

    def load_state_from_peers(self, **kwargs):
        self.finish_outer_round()  # its result lands in the tensors the download replaces
        if _matching(self.scheduled_grads):  # a group looked for ahead, not formed yet: this round is not made
            cancel_round(self.scheduled_grads)  # (hivemind's download joins a formed one with no weight, as it waits)
        taken = super().load_state_from_peers(**kwargs)
        if taken:
            self.inner_step = self.round_samples = 0  # the model is the swarm's outer parameters: a new round
            self.round_began = time.monotonic()
            self.read_ahead_from = None  # which reads ahead of its outer round again
        return taken

    def shutdown(self):
        # hivemind's shutdown leaves only `scheduled_grads`: a group looked for behind a round in flight is left too
        if _matching(self.next_round):
            cancel_round(self.next_round)
        elif _pending(self.next_round):
            self._tag_along_with_zero_weight(self.next_round)
        super().shutdown()

    def inner_state_dict(self) -> dict:
        """The inner optimizer's state and this round's progress (its tensors are the live ones: copy to keep)."""
        return {"inner": self.inner.state_dict(), "inner_step": self.inner_step, "round_samples": self.round_samples}

    @torch.no_grad()
    def load_inner_state_dict(self, state: dict) -> None:
        # into the tensors the state averager shares (extra_tensors): the inner optimizer's own load_state_dict
        # would replace them
        params = [p for group in self.inner.param_groups for p in group["params"]]
        for index, p in enumerate(params):
            for name, value in state["inner"]["state"].get(index, {}).items():
                self.inner.state[p][name].copy_(torch.as_tensor(value))
        self.inner_step, self.round_samples = state["inner_step"], state.get("round_samples", 0)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["diloco"] = self.inner_state_dict()
        return state

    def load_state_dict(self, state_dict: dict):
        diloco = state_dict.pop("diloco", None)
        result = super().load_state_dict(state_dict)
        if diloco is not None:
            self.load_inner_state_dict(diloco)
        return result
