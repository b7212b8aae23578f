"""Ports for the servers a test or a benchmark starts, chosen below this machine's ephemeral range: the kernel hands a
port in that range to any bind to port 0 or outgoing connection (a starting Ray makes dozens of each), so one
found free there can be taken before the server binds it."""

from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_END = 20000  # Ray's workers listen on 10002-19999 by default


def ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default where the range cannot be read


def unclaimed_ports(count: int) -> list[int]:
    """`count` distinct ports nothing listens on, on every interface, from [20000, the ephemeral range)."""
    candidates = list(range(RAY_WORKER_PORTS_END, ephemeral_start()))
    random.shuffle(candidates)
    chosen: list[int] = []
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
        chosen.append(port)
        if len(chosen) == count:
            return chosen
    raise RuntimeError(f"fewer than {count} free ports between {RAY_WORKER_PORTS_END} and the ephemeral range")
