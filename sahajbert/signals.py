"""How every long-running role (first peer, trainer, aux peer) stops: on SIGINT or SIGTERM, after its current step."""

import logging
import signal
import threading

logger = logging.getLogger(__name__)


class StopRequest:
    """SIGINT/SIGTERM ask the peer to stop after the current step; a second signal stops it at once.

    Use as a context manager around the role's loop (it restores the previous handlers on exit); it is truthy once a
    stop was asked for, and `event` can be waited on.
    """

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous = {}

    def __enter__(self) -> "StopRequest":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        logger.info(f"received {signal.Signals(signum).name}: stopping after this step (send again to force)")
        self.event.set()

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __bool__(self) -> bool:
        return self.event.is_set()
