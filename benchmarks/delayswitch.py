#!/usr/bin/env python
"""A learning Ethernet switch that holds every frame for the link latency: netswarm.py's latency where the kernel has
no sch_netem (tc's delay qdisc).

It runs inside netswarm's hub namespace, in place of the bridge, on the hub ends of the peers' veth pairs. A frame
from port a to port b leaves `delay_a + delay_b` milliseconds after it arrived (each port's one-way latency to the
"internet core"), so the round trip between two peers is 2 * (delay_a + delay_b); frames keep their order. tc still
shapes bandwidth on both ends of each veth (upload before the switch, download after it).

Ports need their offloads off (netswarm.py runs `ethtool -K ... tso off gso off tx off`): a raw socket otherwise
reads 64 KiB segmentation super-frames with unfinished checksums, which cannot be sent on as they are.

    python delayswitch.py --port v2:12.5 --port v3:25   # in the hub namespace, as root; stop it with SIGTERM
"""

import argparse
import heapq
import select
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4  # what the socket sees of its own sends: never forwarded again
BROADCAST_BIT = 0x01  # in the destination MAC's first byte: broadcast and multicast are flooded


def parse_port(text: str) -> tuple[str, float]:
    name, _, delay = text.partition(":")
    if not name or not delay:
        raise argparse.ArgumentTypeError(f"expected NAME:ONE_WAY_MS, got '{text}'")
    return name, float(delay)


class DelaySwitch:
    def __init__(self, ports: dict[str, float]):
        self.delay = {name: ms / 1000.0 for name, ms in ports.items()}  # seconds
        self.sockets: dict[str, socket.socket] = {}
        for name in ports:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * 2**20)  # bursts of a gradient exchange
            sock.bind((name, 0))
            sock.setblocking(False)
            self.sockets[name] = sock
        self.port_of = {sock.fileno(): name for name, sock in self.sockets.items()}
        self.mac_table: dict[bytes, str] = {}
        self.queue: list[tuple[float, int, str, bytes]] = []  # (release time, arrival number, out port, frame)
        self.arrivals = 0
        self.forwarded = 0
        self.dropped = 0

    def _receive(self, port: str, now: float) -> None:
        sock = self.sockets[port]
        while True:
            try:
                frame, address = sock.recvfrom(65536)
            except BlockingIOError:
                return
            if address[2] == PACKET_OUTGOING or len(frame) < 14:
                continue
            destination, source = frame[0:6], frame[6:12]
            self.mac_table[source] = port
            if destination[0] & BROADCAST_BIT or destination not in self.mac_table:
                outs = [p for p in self.sockets if p != port]
            else:
                outs = [self.mac_table[destination]] if self.mac_table[destination] != port else []
            for out in outs:
                self.arrivals += 1
                heapq.heappush(self.queue, (now + self.delay[port] + self.delay[out], self.arrivals, out, frame))

    def _release(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now:
            _, _, out, frame = heapq.heappop(self.queue)
            try:
                self.sockets[out].send(frame)
                self.forwarded += 1
            except OSError:  # the port's queue is full (its tc shaper drops, as a router would)
                self.dropped += 1

    def serve(self, stop) -> None:
        sockets = list(self.sockets.values())
        while not stop():
            now = time.monotonic()
            timeout = min(0.5, max(0.0, self.queue[0][0] - now)) if self.queue else 0.5
            readable, _, _ = select.select(sockets, [], [], timeout)
            now = time.monotonic()
            for sock in readable:
                self._receive(self.port_of[sock.fileno()], now)
            self._release(time.monotonic())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--port", type=parse_port, action="append", required=True, help="NAME:ONE_WAY_MS, once per port"
    )
    parser.add_argument(
        "--network", default="", help="the network this switch serves (its hub namespace), to tell switches apart"
    )
    args = parser.parse_args(argv)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    try:
        switch = DelaySwitch(dict(args.port))
    except OSError as e:
        print(f"error: cannot open the switch ports (root, inside the hub namespace?): {e}", file=sys.stderr)
        return 2
    print(f"delay switch up on {', '.join(switch.sockets)}", flush=True)
    switch.serve(lambda: bool(stopping))
    print(f"delay switch stopped: {switch.forwarded} frames forwarded, {switch.dropped} dropped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
