"""The DHT process: the pipe it reads requests from (`GuardedDHT`), and waiting for it to read them all."""

import hivemind


class RequestPipe:
    """The end of hivemind's DHT pipe its process reads requests from. A request carries its reply channel, which
    the DHT process fetches from the sender: when the sender (an averager at a stop) has exited first, the read
    fails with EOFError, which hivemind's loop does not catch (`DHT.run`: OSError, ConnectionError and RuntimeError
    only), so the DHT process ended with a traceback. Raised as ConnectionResetError, hivemind logs it (a line the
    swarm's `_GoneCaller` filter drops) and reads the next request."""

    def __init__(self, end):
        self._end = end

    def recv(self):
        try:
            return self._end.recv()
        except EOFError as e:
            raise ConnectionResetError("the sender of a DHT request exited before it was read") from e

    def __getattr__(self, name: str):
        return getattr(self._end, name)


class GuardedDHT(hivemind.DHT):
    """hivemind.DHT whose process reads its requests through `RequestPipe`."""

    def run(self) -> None:
        self._inner_pipe = RequestPipe(self._inner_pipe)  # in the DHT's own process, which run() starts
        super().run()


async def _answer(dht, node) -> None:
    return None


# seconds to wait for the DHT process to read the calls already sent to it, before shutting it down
DRAIN_TIMEOUT = 10.0


def drain_dht_calls(dht: hivemind.DHT, timeout: float = DRAIN_TIMEOUT) -> bool:
    """Wait until the DHT process has read every call this process sent it; False if it did not answer in time.

    A call made with `return_future=True` (hivemind's progress tracker ends with one, a last store that withdraws
    this peer's progress) carries the end of a pipe, which the DHT process fetches from this process when it reads
    the call; had this process exited by then, the DHT process fails with a traceback (EOFError in multiprocessing's
    resource sharer), which a loaded machine makes likely. It reads calls in order: one answered means all earlier
    ones were read."""
    if not dht.is_alive():
        return True
    try:
        dht.run_coroutine(_answer, return_future=True).result(timeout=timeout)
        return True
    except Exception:  # a timeout, or a DHT process that ended meanwhile: shutting it down is all that is left
        return False


def dht_authorizer(node):
    """The authorizer a DHT node checks requests with (`node.protocol.authorizer`), inside the DHT process."""
    return node.protocol.authorizer
