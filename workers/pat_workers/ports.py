"""A free TCP port for a server this process is about to start."""
from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # below: well-known and registered services


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, _EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now and lies outside the kernel's ephemeral range. Between this check and the server's
    own bind, the kernel hands ephemeral ports to outgoing connections and to every bind to port 0 (a port taken
    that way once failed etcd's start); a port outside that range can only be taken by another pick like this one,
    which is random."""
    low, high = _ephemeral_range()
    outside = [(_LOWEST, low - 1), (high + 1, 65535)]
    outside = [(a, b) for a, b in outside if a <= b]
    pick = random.SystemRandom()  # not the seeded module state: two seeded processes must not pick alike
    for _ in range(200):
        a, b = pick.choice(outside)
        port = pick.randint(a, b)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} outside the ephemeral range {low}-{high} after 200 tries")
