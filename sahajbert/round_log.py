"""hivemind's own account of its averaging rounds, read from its log lines: each round counted, each gradient round
timed, each failure one line with its cause (`RoundMonitor`)."""

import logging

from sahajbert.hivemind_ext.optim.accessors import (
    GRADIENT_ROUND_DONE,
    GRADIENT_ROUND_FAILED,
    ROUND_LOGGERS,
    STATE_ROUND_FAILED,
)

logger = logging.getLogger(__name__)


class RoundMonitor(logging.Filter):
    """Counts the averaging rounds hivemind reports and times the gradient rounds; one line per failure, with its
    cause. Attached to hivemind's optimizer and state-averager loggers, it also keeps their INFO lines off the
    terminal unless --verbose (hivemind reports round results at INFO only with its own verbose on)."""

    def __init__(self, verbose: bool):
        super().__init__()
        self.verbose = verbose
        self.failed_rounds = 0
        self.gradient_rounds = 0
        self.round_seconds: list[float] = []  # wall seconds from the step that triggered a gradient round to its end
        self._round_started: float | None = None

    def attach(self) -> "RoundMonitor":
        for name in ROUND_LOGGERS:
            hivemind_logger = logging.getLogger(name)
            hivemind_logger.setLevel(logging.INFO)
            hivemind_logger.addFilter(self)
        return self

    def detach(self) -> None:
        for name in ROUND_LOGGERS:
            logging.getLogger(name).removeFilter(self)

    def gradient_round_started(self, unix_time: float) -> None:
        self._round_started = unix_time

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if match := GRADIENT_ROUND_FAILED.match(message):
            self._failed("gradient", match.group(1), "this peer steps with its own gradients")
        elif match := STATE_ROUND_FAILED.match(message):
            self._failed("parameter", match.group(1), "parameters stay as they are until the next round")
        elif GRADIENT_ROUND_DONE.match(message):
            self.gradient_rounds += 1
            if self._round_started is not None:
                self.round_seconds.append(record.created - self._round_started)
                self._round_started = None
        return self.verbose or record.levelno >= logging.WARNING

    def _failed(self, kind: str, cause: str, consequence: str) -> None:
        self.failed_rounds += 1
        if kind == "gradient":
            self._round_started = None
        logger.info(f"a {kind} averaging round failed ({cause}): {consequence} ({self.failed_rounds} failed so far)")
