"""A peer that reports progress toward a run's step and never comes to its averaging rounds: a trainer that went away
after its last report. `python tests/absent_peer.py RUN_ID INITIAL_PEER` prints `reporting` once its report is made,
then runs until its stdin closes. hivemind's own progress tracker, in its own process (its records are signed with
the process's key)."""

import sys

import hivemind
from hivemind.optim.progress_tracker import ProgressTracker


def main() -> None:
    run_id, initial_peer = sys.argv[1], sys.argv[2]
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[initial_peer])
    tracker = ProgressTracker(dht, run_id, target_batch_size=1024, start=True)
    tracker.report_local_progress(0, 4)
    print("reporting", flush=True)
    sys.stdin.read()
    tracker.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
