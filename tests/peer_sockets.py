"""What the tests of capped listeners ask of a peer's raw socket and of the server process."""

from __future__ import annotations

import os
import socket


def open_fds(pid: int) -> int:
    """Descriptors the process holds now (Linux)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closed or reset the connection within `within_s` (a byte of data counts as open)."""
    sock.settimeout(within_s)
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
