"""Small address helpers shared by the sandbox and the servers."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Is `host` (a name or an address, IPv6 in brackets or not) this machine's loopback?"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
