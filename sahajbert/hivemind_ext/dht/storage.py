"""The DHT records a peer stores for others, bounded in size, lifetime and number (`BoundedLocalStorage`)."""

import heapq
import math
import time
from collections.abc import Callable

from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import TimedStorage

import sahajbert.hivemind_ext.policy as policy
from sahajbert.hivemind_ext.refusals import RefusalLog

# The DHT records this peer holds for others. hivemind's DHTProtocol keeps every record a peer asks it to store until
# the expiration that peer chose, with no bound on their number or lifetime, and queues a heap entry for each store
# even of a record it already holds. Ours refuses a record that would not fit these bounds, and keeps the heap in
# proportion to the records. The swarm's own records are a few per peer (progress, metrics, state and group
# declarations, invite tokens), each under 1 KiB and renewed within minutes.
MAX_RECORD_BYTES = 4 * 2**10  # one value, or one subkey's value, with its signature
MAX_STORED_RECORDS = 10_000  # values and subkeys' values together, per storage (this peer's records and its cache)
RECOUNT_EVERY = 1.0  # seconds between two counts of a full storage's records (some may have expired)
_refused_records = RefusalLog()


def _refuse_record(why: str) -> bool:
    _refused_records.refused(f"refused to store a DHT record: {why}")
    return False


def _compact(storage: TimedStorage) -> None:
    """Drop the heap entries of replaced records (hivemind drops them only once they expire)."""
    if len(storage.expiration_heap) > 2 * len(storage.data) + 64:
        storage.expiration_heap = [storage.key_to_heap[key] for key in storage.data]
        heapq.heapify(storage.expiration_heap)


class BoundedLocalStorage(DHTLocalStorage):
    """hivemind's DHTLocalStorage within MAX_RECORD_BYTES, the record lifetime `install()` was given
    (`policy.max_record_lifetime`) and MAX_STORED_RECORDS: a record over them is refused (the storing peer's store_ok
    says so), one already held can always be renewed. Installed for every DHT node this process or its children
    start (`hivemind.dht.protocol.DHTLocalStorage`, by `install()`)."""

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
        lifetime = policy.max_record_lifetime()
        if expiration_time > get_dht_time() + lifetime:
            kept = expiration_time - get_dht_time()
            return _refuse_record(f"it would be kept {kept:.0f} s (the bound is {lifetime:.0f})")
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
