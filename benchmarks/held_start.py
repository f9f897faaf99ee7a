#!/usr/bin/env python
"""`held_start.py GO_FILE SCRIPT [ARGS...]`: run one of this repository's scripts with its imports done ahead, once
GO_FILE exists. netswarm.py starts each churn replacement this way at the start of a run and releases it when its
churn event comes: importing torch, transformers and hivemind is most of a trainer's start (30 s of a tiny trainer's
40 s with the swarm busy on 2 cores, minutes with a CPU hog beside it), and a start that slow decided whether the
replacement met the survivors before the run's last step."""

import runpy
import sys
import time
from pathlib import Path

POLL_SECONDS = 0.2  # how often the file is looked for: small next to the seconds between global steps


def main() -> None:
    go, script, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    # a trainer's imports: torch, hivemind, and transformers with the model's module (which it imports lazily)
    import transformers.models.albert.modeling_albert  # noqa: F401

    import sahajbert.trainer  # noqa: F401

    while not go.exists():
        time.sleep(POLL_SECONDS)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
