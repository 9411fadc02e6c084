"""Listening sockets for raylign's HTTP servers (the agent endpoint, serve-rm)."""

from __future__ import annotations

import socket


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv6 where ``host`` has a colon), not yet listening;
    port 0 takes one the OS picks. Bound by the caller before its server starts, so the port is
    known and held from then on. Raises ``OSError`` where the address cannot be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def http_url(host: str, port: int, path: str) -> str:
    """``http://host:port/path``, an IPv6 host in brackets."""
    return f"http://[{host}]:{port}{path}" if ":" in host else f"http://{host}:{port}{path}"
