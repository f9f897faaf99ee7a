#!/usr/bin/env python
"""`unpaced.py SCRIPT [ARGS...]`: run one of this repository's scripts with the DHT traffic paced as hivemind paces
it, i.e. not at all: matchmaking reads its group key again as soon as a read ends, and every pass's progress report
is published at once. The control of benchmarks/bench_peer_cpu.py."""

import runpy
import sys

import sahajbert.hivemind_ext.averaging.matchmaking as matchmaking
import sahajbert.hivemind_ext.optim.progress as progress


def main() -> None:
    matchmaking.LEADER_READ_SECONDS = 0.0  # read at module level on every look for a leader
    progress.REPORT_PACE_SECONDS = 0.0  # read when a progress tracker is made
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
