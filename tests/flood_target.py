"""A peer for tests/test_bounds.py to flood: a DHT and a started state averager, on 127.0.0.1.

`python tests/flood_target.py ours [VALUES [RATE,BURST]]` runs ours (sahajbert.hivemind_ext installed: its
stream-message and DHT bounds in force, GuardedStateAverager, the link probe served); `plain` runs hivemind's
TrainingStateAverager without importing our package (the control). Prints one JSON line (the DHT's addresses, the DHT's
and the averager's process ids, the all-reduce handler's name, its DHT request bounds), then runs until its stdin
closes. Its state is VALUES parameters (default 1000); RATE,BURST replace our DHT request allowance per caller
(requests per second and burst), so that a test's flood outruns it on a machine of any speed.
"""

import json
import os
import sys
from functools import partial
from pathlib import Path

import hivemind
import torch
from hivemind.optim.state_averager import TrainingStateAverager

PREFIX = "flood"


def main() -> None:
    kind, values = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    averager_class = TrainingStateAverager
    if kind == "ours":  # installed before any hivemind process starts: each one forks with the bounds in force
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from sahajbert import link_probe, swarm
        from sahajbert.hivemind_ext.averaging.averager import GuardedStateAverager
        from sahajbert.hivemind_ext.dht import protocol

        swarm.install_hivemind_ext()
        averager_class = GuardedStateAverager
        if len(sys.argv) > 3:
            rate, burst = sys.argv[3].split(",")
            protocol.DHT_REQUESTS_PER_SECOND, protocol.DHT_REQUEST_BURST = float(rate), int(burst)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    if kind == "ours":
        link_probe.serve_link_probe(dht)
    # FLOOD_CHUNK_TIMEOUT: the averager's next_chunk_timeout (seconds), for a test that waits it out
    chunk_timeout = float(os.environ["FLOOD_CHUNK_TIMEOUT"]) if "FLOOD_CHUNK_TIMEOUT" in os.environ else None
    averager = averager_class(
        dht=dht,
        optimizer=partial(torch.optim.SGD, lr=0.1),
        params=[torch.nn.Parameter(torch.zeros(values))],
        prefix=PREFIX,
        next_chunk_timeout=chunk_timeout,
        start=True,
    )
    handler = TrainingStateAverager._get_handle_name(PREFIX, "rpc_aggregate_part")
    maddrs = [str(maddr) for maddr in dht.get_visible_maddrs()]
    info = {"maddrs": maddrs, "averager_pid": averager.pid, "dht_pid": dht.pid, "handler": handler}
    if kind == "ours":
        info["dht_rate"], info["dht_burst"] = protocol.DHT_REQUESTS_PER_SECOND, protocol.DHT_REQUEST_BURST
    print(json.dumps(info), flush=True)
    sys.stdin.read()
    averager.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
