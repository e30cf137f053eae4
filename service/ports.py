"""Free TCP ports for the servers memfit starts on this host: local Ray heads and their daemons, gloo
rendezvous, the API in tests and benchmarks. One rule, imported by service, workers, tests and bench."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Picked below the kernel's ephemeral range and above Ray's worker ports (10002-19999 by default). A port
# asked of the kernel (bind to 0) comes from the ephemeral range, which every outgoing connection also
# draws from: between the pick and the server's bind, a client socket of any process on the host may take
# it (measured: a Ray head failing with "the same port is used by multiple components" while other Ray
# clusters ran on the machine). Outside that range only another server's pick can collide, and a random
# pick among ~12,000 ports makes that rare; the bind check skips ports already taken.
LOWEST, HIGHEST = 20000, 32767


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing on ``host`` listens on now, outside the ephemeral range where one is free."""
    highest = min(HIGHEST, _ephemeral_low() - 1)
    pick = random.SystemRandom()
    for _ in range(64):
        port = pick.randint(LOWEST, highest)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range is full: the kernel's choice, with its race
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1", taken: tuple[int, ...] = ()) -> list[int]:
    """``n`` different free ports, none of them in ``taken``: one server's several daemons each need their own
    (two picks of :func:`free_port` alone may return the same port, which nothing holds between the picks)."""
    out: list[int] = []
    while len(out) < n:
        port = free_port(host)
        if port not in out and port not in taken:
            out.append(port)
    return out
