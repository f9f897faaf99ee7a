"""The swarm's progress as this peer reads it, through the project's plausibility rule (`BoundedProgressTracker`)."""

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable

from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import enter_asynchronously
from hivemind.utils.timed_storage import ValueWithExpiration

import sahajbert.hivemind_ext.policy as policy

logger = logging.getLogger(__name__)

# the most often a pass's progress is published (seconds): hivemind's default min_refresh_period, how often a peer
# reads the records at most
REPORT_PACE_SECONDS = 0.5


def _peer_name(peer: bytes) -> str:
    try:
        return str(PeerID(peer))
    except Exception:
        return repr(peer)


class _ReportTrigger(threading.Event):
    """hivemind's `ProgressTracker.should_report_progress`: every `report_local_progress` sets it, and the tracker
    then publishes its report to the DHT at once; while `held`, a report stays local until the next publication (a
    report that sets it, or the periodic one every metadata_expiration / 2 seconds). `set_paced` sets it at most once
    every `pace` seconds."""

    held = False

    def __init__(self, pace: float):
        super().__init__()
        self.pace = pace  # seconds
        self._last_set = -math.inf
        self._later: threading.Timer | None = None
        self._lock = threading.Lock()

    def set(self) -> None:
        if not self.held:
            self._last_set = time.monotonic()
            super().set()

    def set_paced(self) -> None:
        """Set now, or, sooner than `pace` after the last set, once the pace allows (the publication then carries the
        latest report)."""
        with self._lock:
            wait = self._last_set + self.pace - time.monotonic()
            if wait <= 0:
                self.set()
            elif self._later is None:
                self._arm(wait)

    def _arm(self, seconds: float) -> None:
        """Call `_set_later` in `seconds` (with the lock held)."""
        self._later = threading.Timer(seconds, self._set_later)
        self._later.daemon = True
        self._later.start()

    def _set_later(self) -> None:
        with self._lock:
            self._later = None
            if self.held:  # a report is being held: this publication comes a pace later, not never
                self._arm(self.pace)
            else:
                self.set()


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
    """hivemind's progress tracker, reading the swarm's progress records through the rules' `plausible_progress`: one
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
        # this peer's step at which one of its reads counted at least half the step's batch (None: none yet)
        self._half_batch_at: int | None = None
        self._noted: set[tuple[str, bytes]] = set()
        self._left_out, self._vouched = left_out, vouched
        # the other serving peers' steps above this peer's own at the last read (peer id bytes -> step), counted
        # or not: a claim no other peer backs is one a trainer may check by asking for that peer's state
        self.claims_ahead: dict[bytes, int] = {}
        self._epoch_updates = 0  # step changes so far (`update_epoch`)
        super().__init__(*args, start=False, **kwargs)
        # before the reporter waits on it
        self.should_report_progress = _ReportTrigger(min(self.min_refresh_period, REPORT_PACE_SECONDS))
        if start:
            self.start()

    def update_epoch(self, new_epoch: int | None = None) -> int:
        self._epoch_updates += 1
        return super().update_epoch(new_epoch)

    async def _progress_fetcher(self):
        """Follows hivemind 1.1.12's ProgressTracker._progress_fetcher (hivemind/optim/progress_tracker.py): hivemind's
        fetcher, holding `lock_global_progress` only to take in what it read, not over the DHT read: a step change
        (`pause_updates` takes the lock) must not wait out a whole DHT read over a slow link. A read that a step
        change overtook is taken in (peers, their steps) but not as this step's read, and another is made at once:
        hivemind's optimizer checks that this peer is in sync on the first read after a change
        (`fetched_global_progress_this_epoch`), which must begin after it. (Dropped instead, a peer whose steps come
        faster than its reads would never take one in.)"""
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

    @contextlib.contextmanager
    def sitting_out(self):
        """Within: this peer makes no samples (it waits for a background update, saves a checkpoint), and its record
        says so at once with 0 samples/s. hivemind's peers extrapolate every record at its samples/s from the time it
        was written (`_parse_swarm_progress_data`), so a peer that sits out would still be counted making samples,
        and a peer that steps when that estimate comes due (an assisting aux peer) would start a step on samples
        nobody made. The measured pace is kept for afterwards: the time within is not counted."""
        self.local_progress = self.local_progress.copy(update=dict(samples_per_second=0.0, time=get_dht_time()))
        self.should_report_progress.set()
        try:
            yield
        finally:
            current = self.local_progress  # a step change within keeps its own record, at this peer's measured pace
            self.performance_ema.reset_timer()
            self.local_progress = self._get_local_progress(current.epoch, current.samples_accumulated)
            self.should_report_progress.set()

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        """hivemind's, with the samples that a pass adds to this step published at a pace (REPORT_PACE_SECONDS); a step
        change or a reset is published at once. hivemind publishes every report, i.e. after every pass (about 5 a
        second per trainer of the tiny model), and each store costs every DHT node it reaches a signature check."""
        progress = self.local_progress
        paced = local_epoch == progress.epoch and samples_accumulated > progress.samples_accumulated
        if not paced or self.should_report_progress.held:
            return super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        with self.reports_held():
            super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        self.should_report_progress.set_paced()

    def note_local_progress(self, local_epoch: int, samples_accumulated: int) -> None:
        """`report_local_progress`, published with the next report (not at once: one DHT store per call)."""
        with self.reports_held():
            self.report_local_progress(local_epoch, samples_accumulated)

    def _parse_swarm_progress_data(self, metadata):
        own = self._local_public_key
        if isinstance(metadata, dict) and isinstance(metadata.get(own), ValueWithExpiration):
            # this peer's own record as it is now, not as last published: a pass's samples are published at a pace,
            # and a read that counted the published ones would lose this peer's newer samples from the step's count
            current = ValueWithExpiration(self.local_progress.dict(), metadata[own].expiration_time)
            metadata = {**metadata, own: current}
        if isinstance(metadata, dict) and metadata:
            step, began = self._step_began
            claims_ahead = _claims_ahead(metadata, self.dht.peer_id.to_bytes(), self.local_progress.epoch)
            last = getattr(self, "global_progress", None)  # the last read's view (none before the first)
            own_step = self.local_progress.epoch
            if last is not None and last.epoch == own_step and last.samples_accumulated >= self.target_batch_size / 2:
                self._half_batch_at = own_step
            # held until this peer steps: the read that follows the claim has a view a step ahead of this peer, and
            # judged by the last read alone the read after dropped the claim again; at the sahajbert preset a pass
            # takes 14 s on 2 cores, reads came faster, and the peer made the step alone on its own samples
            batch_full = self._half_batch_at == own_step
            rules = policy.rules()
            metadata, notes = rules.plausible_progress(
                metadata,
                own_peer=self.dht.peer_id.to_bytes(),
                own_epoch=self.local_progress.epoch,
                target=self.target_batch_size,
                step_seconds=time.monotonic() - began,
                standing=rules.Standing(left_out=self._left_out(), vouched=self._vouched()),
                batch_full=batch_full,
            )
            self.claims_ahead = claims_ahead
            for note, peer in notes:
                kind = note.split(" of ")[0]  # once per peer and kind of change: claims repeat at every refresh
                if (kind, peer) not in self._noted and len(self._noted) < 1000:
                    self._noted.add((kind, peer))
                    # a claim no other peer backs is also how a trainer that ran alone looks to a newcomer: the
                    # trainer logs what it decides (it asks that peer for its state once)
                    level = logging.INFO if rules.UNBACKED in note else logging.WARNING
                    logger.log(level, f"swarm progress: {note}, from peer {_peer_name(peer)}; further ones not logged")
        progress = super()._parse_swarm_progress_data(metadata)
        if progress.epoch != self._step_began[0]:
            self._step_began = (progress.epoch, time.monotonic())
        return progress


def request_progress_read(tracker: ProgressTracker) -> None:
    """Wake the tracker's fetcher to read the swarm's progress now, without waiting for it."""
    tracker.fetched_global_progress_this_epoch.clear()
    tracker.global_progress.next_fetch_time = get_dht_time()
    tracker.global_state_updated.set()
