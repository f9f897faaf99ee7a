"""How every long-running role (first peer, trainer, aux peer) stops: on SIGINT or SIGTERM, within seconds."""

import _thread
import logging
import os
import signal
import threading
from contextlib import contextmanager

logger = logging.getLogger(__name__)
# seconds a role has, after the first SIGINT/SIGTERM, to finish its current step and save; then it stops at once
FORCE_AFTER = 15.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopNow(Exception):
    """Raised where a role waits (for data, say) once a stop was requested: the wait is abandoned, the role ends."""


class StopRequest:
    """The first SIGINT/SIGTERM asks the role to stop after its current step; a second one stops it at once.

    A role that has not stopped FORCE_AFTER seconds after the first signal is stopped at once too, whatever it waits
    for (a round, a download): it never outlives a stop request by more than that. Stopping at once raises
    KeyboardInterrupt in the main thread, which `sahajbert.cli.run` reports as one line; further signals are then
    ignored, so that leaving the swarm (the p2p daemon, the averagers) is not cut short.

    Use as a context manager around the role's whole life (it restores the previous handlers on exit); it is truthy
    once a stop was asked for, and `event` can be waited on.
    """

    def __init__(self, message: str = "stopping after the current step", force_after: float = FORCE_AFTER) -> None:
        self.event = threading.Event()
        self.message = message
        self.force_after = force_after
        self._previous = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> "StopRequest":
        self._pid = os.getpid()
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            # a forked child (hivemind's DHT and averager processes) inherits this handler: there the signal does
            # what it did before, so that hivemind can still terminate its own processes
            signal.signal(signum, self._previous[signum])
            os.kill(os.getpid(), signum)
            return
        if self.event.is_set():
            self._stop_now()
        logger.info(f"received {signal.Signals(signum).name}: {self.message} (send it again to stop at once)")
        self.event.set()
        self._timer = threading.Timer(self.force_after, self._force)
        self._timer.daemon = True
        self._timer.start()

    def _force(self) -> None:
        logger.warning(f"still running {self.force_after:.0f} s after the stop request: stopping at once")
        _thread.interrupt_main()  # runs _handle in the main thread, which now stops at once

    def _stop_now(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raise StopNow if a stop was requested (for waits that poll)."""
        if self.event.is_set():
            raise StopNow

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __bool__(self) -> bool:
        return self.event.is_set()


@contextmanager
def ignoring_signals():
    """SIGINT and SIGTERM are ignored while the body runs: leaving the swarm (the p2p daemon, the averagers) takes
    a few seconds, and a signal that cut it short would leave those processes behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
