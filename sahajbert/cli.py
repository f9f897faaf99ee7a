"""Command-line plumbing shared by every script: argument parsing, logging, and errors meant for people."""

import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from transformers import HfArgumentParser

logger = logging.getLogger("sahajbert")


class UserError(Exception):
    """A mistake in the input that a person can fix; reported as one line, never as a traceback."""


def setup_logging(level: int = logging.INFO) -> None:
    """One log format for every script: stable, greppable lines on stderr."""
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", force=True
    )
    # hivemind installs its own handler; keep its level but let our format stay the only one on the root logger
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Writing model shards" bars would interleave with progress lines


def parse_args(dataclass_types: Sequence[type], argv: Sequence[str] | None = None) -> tuple:
    """Parse flags (or one `.json` file) into the given argument dataclasses; validation errors become UserError.

    A composite such as `PeerArguments` stands for its GROUPS: their flags are parsed, and it is built from them.
    """
    flat = [group for t in dataclass_types for group in getattr(t, "GROUPS", (t,))]
    parser = HfArgumentParser(flat)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if len(argv) == 1 and argv[0].endswith(".json"):
            parsed = iter(parser.parse_json_file(json_file=Path(argv[0]).resolve()))
        else:
            parsed = iter(parser.parse_args_into_dataclasses(args=argv))
    except (ValueError, TypeError) as e:
        raise UserError(str(e)) from e
    return tuple(
        t(*(next(parsed) for _ in t.GROUPS)) if hasattr(t, "GROUPS") else next(parsed) for t in dataclass_types
    )


def run(main: Callable[[], int | None]) -> None:
    """Run a script's main(); a UserError or Ctrl+C ends it with one clear line and a non-zero exit code."""
    try:
        code = main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
