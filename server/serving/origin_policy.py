"""The `--allowed-origins` policy: which browser Origins may drive this server (parsing and
matching only). It lives in the serving layer so that settings can validate the option without
importing the network edge; `server.api.origins.OriginGuard` enforces it on every request.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def is_loopback_host(host: Optional[str]) -> bool:
    if not host:
        return False
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _origin_parts(origin: str) -> Optional[tuple[str, str, int]]:
    """(scheme, host, port) of a serialised origin, or None when it is not one."""
    try:
        u = urlsplit(origin)
        port = u.port
    except ValueError:
        return None
    if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/") or u.query:
        return None
    return u.scheme, u.hostname.lower(), port if port is not None else _DEFAULT_PORTS[u.scheme]


@dataclass
class OriginPolicy:
    """Parsed `--allowed-origins`; `bind_host` is the server's --host (for same-origin checks)."""

    any_origin: bool = False
    loopback: bool = False
    null: bool = False
    exact: set[tuple[str, str, int]] = field(default_factory=set)
    bind_host: str = "127.0.0.1"

    @classmethod
    def parse(cls, setting: str, bind_host: str = "127.0.0.1") -> "OriginPolicy":
        """Raise ValueError naming the bad entry (the CLI reports it as the option's error)."""
        p = cls(bind_host=bind_host.lower())
        for raw in setting.split(","):
            item = raw.strip()
            if not item:
                continue
            low = item.lower()
            if low == "*":
                p.any_origin = True
            elif low == "loopback":
                p.loopback = True
            elif low == "null":
                p.null = True
            else:
                parts = _origin_parts(item)
                if parts is None:
                    raise ValueError(f"{item!r} is not an origin like https://host[:port], 'loopback', '*' or 'null'")
                p.exact.add(parts)
        return p

    def allows(self, origin: str, host_header: Optional[str]) -> bool:
        if origin == "null":
            return self.null
        parts = _origin_parts(origin)
        if parts is None:
            return False
        if self.any_origin or parts in self.exact:
            return True
        scheme, host, port = parts
        if self.loopback and is_loopback_host(host):
            return True
        return self._same_origin(parts, host_header)

    def _same_origin(self, parts: tuple[str, str, int], host_header: Optional[str]) -> bool:
        if not host_header:
            return False
        scheme, host, port = parts
        try:
            h = urlsplit(f"//{host_header}")
            h_host, h_port = (h.hostname or "").lower(), h.port
        except ValueError:
            return False
        if h_host != host or (h_port if h_port is not None else _DEFAULT_PORTS[scheme]) != port:
            return False
        # A name that merely resolves here (DNS rebinding) is not this server's origin.
        return is_loopback_host(h_host) or h_host == self.bind_host
