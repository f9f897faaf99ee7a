"""Counting and logging what a bound refused, at most a line per REFUSED_LOG_EVERY seconds per kind."""

import logging
import math
import time

logger = logging.getLogger(__name__)


REFUSED_LOG_EVERY = 10.0  # seconds between two lines about refused input of one kind: a flood must not flood the log


class RefusalLog:
    """Counts what a bound refused, and logs it at most once a REFUSED_LOG_EVERY, with the count so far."""

    def __init__(self) -> None:
        self.count, self.logged_at = 0, -math.inf

    def refused(self, line: str) -> None:
        self.count, now = self.count + 1, time.monotonic()
        if now - self.logged_at >= REFUSED_LOG_EVERY:
            self.logged_at = now
            logger.warning(f"{line}; {self.count} such so far")
