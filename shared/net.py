"""Small network facts the commands share."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost). A host
    name other than localhost counts as reachable: it may resolve to any interface; so does a
    wildcard such as 0.0.0.0."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # ::ffff:127.0.0.1 is loopback too (not so before Python 3.13)
    return addr.is_loopback
