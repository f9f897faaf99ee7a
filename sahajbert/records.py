"""The DHT records of a run besides its progress: each trainer's signed metrics (its steps, samples and status), the
start, finish and archive declarations and the announced step; their schemas, validators, publishing and reading."""

from collections import Counter

import hivemind
import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils.timed_storage import get_dht_time

# steps a trainer's record repeats (its last ones): a monitor that reads every few steps still sees each step
RECENT_STEPS = 16
PEER_STATUSES = ("training", "finished", "stopped")


class StepEntry(pydantic.BaseModel):
    """One trainer's part in one global step."""

    step: pydantic.conint(ge=0, strict=True)
    loss: pydantic.StrictFloat  # SUM of the mini-step losses
    mini_steps: pydantic.conint(ge=0, strict=True)
    samples: pydantic.conint(ge=0, strict=True)
    samples_per_second: pydantic.confloat(ge=0.0, strict=True)


class LocalMetrics(pydantic.BaseModel):
    """What one trainer reports after each global step it took part in, and once more when it ends."""

    step: pydantic.conint(ge=0, strict=True)  # the global step just finished
    samples_per_second: pydantic.confloat(ge=0.0, strict=True)
    samples_accumulated: pydantic.conint(ge=0, strict=True)  # this peer's samples in that step
    loss: pydantic.StrictFloat  # SUM of the mini-step losses, so the swarm's mean is sum(loss) / sum(mini_steps)
    mini_steps: pydantic.conint(ge=0, strict=True)
    peer_id: pydantic.constr(strict=True, max_length=128) = ""  # base58, as the peer's own log names it
    samples_contributed: pydantic.conint(ge=0, strict=True) = 0  # since it started, as its log counts them
    recent: pydantic.conlist(StepEntry, max_items=RECENT_STEPS) = []  # its last steps, oldest first
    status: pydantic.constr(strict=True, regex="^(" + "|".join(PEER_STATUSES) + ")$") = "training"
    # the most peers it saw report progress over the last two reads of the others (0: not said; sahajbert.split_watch)
    peers_seen: pydantic.conint(ge=0, strict=True) = 0


class ArchiveRecord(pydantic.BaseModel):
    """An aux peer that keeps the run's checkpoints: the last final model it saved, and how often it looks."""

    step: pydantic.conint(ge=0, strict=True)  # the global step of the last final model it saved (0: none yet)
    refresh_period: pydantic.confloat(gt=0.0, strict=True)  # seconds between its reads of the swarm's records


class StartRecord(pydantic.BaseModel):
    """What a trainer of a new run starts from: its peer id and a digest of its initial parameters."""

    peer_id: pydantic.constr(strict=True, max_length=128)  # base58, as hivemind's state declarations name peers
    parameters: pydantic.constr(strict=True, regex=r"^[0-9a-f]{32}$")  # see joining.parameters_digest


class FinishedRecord(pydantic.BaseModel):
    """What a trainer tells the other peers of its final parameter round once that round has ended for it."""

    step: pydantic.conint(ge=0, strict=True)  # the global step the round was made at
    peer_id: pydantic.constr(strict=True, max_length=128)  # base58: the peer to download its parameters from
    complete: pydantic.StrictBool  # every averaged part came back (False: it kept its own values for some)
    serves_state: pydantic.StrictBool  # others can download its state (not a client-mode peer)
    adopted: pydantic.StrictBool = False  # it has since taken the parameters of the peer the round settled on


class MetricSchema(pydantic.BaseModel):
    # the subkey must hold the writer's public key: RSASignatureValidator then lets only its owner write it
    metrics: dict[BytesWithPublicKey, LocalMetrics]
    # global step of a state an aux peer serves (--initial_state). hivemind publishes no progress for peers that
    # accumulate no samples, so without this a trainer joining a rescued run could not know that it is behind.
    state: dict[BytesWithPublicKey, pydantic.conint(ge=0, strict=True)]
    # an invite-only run's access tokens (sahajbert.access): averagers admit the peers these name
    members: dict[BytesWithPublicKey, pydantic.StrictBytes]
    # each trainer's initial parameters at step 0: a trainer of a new run skips the download of the first trainer's
    # parameters when they are its own (the same --seed)
    start: dict[BytesWithPublicKey, StartRecord]
    # a trainer's final parameter round ended for it: the round's other peers stay up until each of them has its
    # results, and settle on one peer's parameters if a part came back partial (ending.Ending._end_together)
    finished: dict[BytesWithPublicKey, FinishedRecord]
    # aux peers that save the run's final model: trainers that end the run stay up until one has it
    archive: dict[BytesWithPublicKey, ArchiveRecord]


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def make_validators(run_id: str) -> tuple[list, bytes]:
    """Record validators for this run's DHT, and this process's public key (its metrics subkey)."""
    signature_validator = RSASignatureValidator()
    return [SchemaValidator(MetricSchema, prefix=run_id), signature_validator], signature_validator.local_public_key


def publish(dht: hivemind.DHT, run_id: str, public_key: bytes, metrics: LocalMetrics, expiration: float = 600.0):
    """Store this peer's record (non-blocking); it expires `expiration` seconds after its last update."""
    return dht.store(
        key=metrics_key(run_id),
        subkey=public_key,
        value=metrics.dict(),
        expiration_time=get_dht_time() + expiration,
        return_future=True,
    )


def announce_state(dht: hivemind.DHT, run_id: str, public_key: bytes, step: int, expiration: float = 60.0):
    """Tell joining trainers that this peer serves the swarm's state at global step `step`."""
    return dht.store(
        key=f"{run_id}_state",
        subkey=public_key,
        value=step,
        expiration_time=get_dht_time() + expiration,
        return_future=True,
    )


def declare_start(
    dht: hivemind.DHT, run_id: str, public_key: bytes, peer_id: str, digest: str, expiration: float = 3600.0
) -> bool:
    """Tell the run's other trainers which initial parameters this one starts from (blocking; False if not stored)."""
    return bool(
        dht.store(
            key=f"{run_id}_start",
            subkey=public_key,
            value=StartRecord(peer_id=peer_id, parameters=digest).dict(),
            expiration_time=get_dht_time() + expiration,
        )
    )


def fetch_starts(dht: hivemind.DHT, run_id: str) -> dict[str, str]:
    """Each declaring trainer's initial-parameter digest, by its peer id (base58).

    A record's signer (its process's RSA key) need not be the libp2p identity that the record names, so any peer can
    name any trainer: a peer id that the records of more than one signer name is left out. A record naming another
    trainer then costs at most a download (the trainer starting behind it takes the first trainer's parameters), and
    never makes a trainer start from parameters other than the first one's."""
    records = _valid_records(dht, f"{run_id}_start", StartRecord).values()
    signers = Counter(record.peer_id for record in records)  # one record per signer (its subkey)
    return {record.peer_id: record.parameters for record in records if signers[record.peer_id] == 1}


def declare_finished(
    dht: hivemind.DHT, run_id: str, public_key: bytes, record: FinishedRecord, expiration: float = 600.0
) -> bool:
    """Tell the final round's other peers that this one's round ended, and how (blocking; False if not stored). A
    later record of the same peer replaces its earlier one."""
    expiration_time = get_dht_time() + expiration
    return bool(dht.store(f"{run_id}_finished", record.dict(), expiration_time, subkey=public_key))


def fetch_finished(dht: hivemind.DHT, run_id: str, step: int) -> list[FinishedRecord]:
    """The records of the peers whose final round ended at global step `step`."""
    records = _valid_records(dht, f"{run_id}_finished", FinishedRecord).values()
    return [record for record in records if record.step == step]


def fetch_all_finished(dht: hivemind.DHT, run_id: str) -> list[FinishedRecord]:
    """Every current record of a final round's end, whatever its step."""
    return list(_valid_records(dht, f"{run_id}_finished", FinishedRecord).values())


def announce_archive(dht: hivemind.DHT, run_id: str, public_key: bytes, record: ArchiveRecord):
    """Tell the trainers that this aux peer saves the run's final model (non-blocking); announced at every refresh,
    it lives three refresh periods (at least a minute)."""
    return dht.store(
        key=f"{run_id}_archive",
        subkey=public_key,
        value=record.dict(),
        expiration_time=get_dht_time() + max(60.0, 3 * record.refresh_period),
        return_future=True,
    )


def fetch_archives(dht: hivemind.DHT, run_id: str) -> list[ArchiveRecord]:
    """The aux peers that save the run's final model, as they announced themselves."""
    return list(_valid_records(dht, f"{run_id}_archive", ArchiveRecord).values())


def fetch_announced_step(dht: hivemind.DHT, run_id: str) -> int:
    """The highest global step that a peer announced to serve (0 if none)."""
    items = _subkey_items(dht, f"{run_id}_state").values()
    return max((item.value for item in items if isinstance(item.value, int)), default=0)


def _subkey_items(dht: hivemind.DHT, key: str) -> dict:
    """A key's current entries, by subkey (each a ValueWithExpiration); {} if it holds none."""
    return _entries(dht.get(key, latest=True))


def _entries(entry) -> dict:
    return entry.value if entry is not None and isinstance(entry.value, dict) else {}


def _valid_records(dht: hivemind.DHT, key: str, model: type[pydantic.BaseModel]) -> dict[bytes, pydantic.BaseModel]:
    """A key's current records that parse as `model`, keyed by the writer's public key."""
    return _parsed(_subkey_items(dht, key), model)


def _parsed(items: dict, model: type[pydantic.BaseModel]) -> dict[bytes, pydantic.BaseModel]:
    records = {}
    for subkey, item in items.items():
        try:
            records[subkey] = model.parse_obj(item.value)
        except pydantic.ValidationError:
            continue  # the DHT validates on store; this only guards against a peer with other software
    return records


def fetch(dht: hivemind.DHT, run_id: str) -> dict[bytes, LocalMetrics]:
    """All current, validated records of the run, keyed by the writer's public key."""
    return _valid_records(dht, metrics_key(run_id), LocalMetrics)


def fetch_later(dht: hivemind.DHT, run_id: str):
    """fetch()'s DHT read, started now without waiting: a future of the entry that metrics_of() parses."""
    return dht.get(metrics_key(run_id), latest=True, return_future=True)


def metrics_of(entry) -> dict[bytes, LocalMetrics]:
    """The validated records in a metrics entry that fetch_later() read, keyed by the writer's public key."""
    return _parsed(_entries(entry), LocalMetrics)
