"""Read the metrics an offline wandb run logged, from its run-*.wandb file (wandb >= 0.19 has no Python reader).

The file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of chunks, each with a
7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last); chunks join into wandb Record protobufs.
"""

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B", f"{path} is not a wandb run file"
    offset, pending = HEADER, b""
    while offset + HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < HEADER:  # block trailer padding
            offset += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + HEADER])
        chunk = data[offset + HEADER : offset + HEADER + length]
        offset += HEADER + length
        if kind == 0 and length == 0:
            offset += BLOCK - offset % BLOCK if offset % BLOCK else 0
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def history(run_dir: Path) -> list[dict]:
    """Every wandb.log() call of the run, as dicts of key -> value."""
    (run_file,) = Path(run_dir).glob("run-*.wandb")
    rows = []
    for record in records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows
