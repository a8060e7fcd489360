"""What the serving layer needs from the access policy, which `server.gateway` implements.

The layers point one way (api → gateway → serving → engine; docs/architecture.md), so the
service cannot name the gateway's `Principal` or `QuotaBook`. It names these instead: a
`Caller` (who may see which request, batch and file), `Quotas` (reserve tokens at admission,
settle them at the end) with the `Reservation` it hands back, and the `AccessPolicy` the
Runtime starts once the ledger is open. The gateway's classes satisfy them structurally; the
composition root (`server/serve.py`) plugs one into the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from server.serving.ledger import Ledger


class Caller(Protocol):
    """An authenticated caller (the gateway's `Principal`): a key, or the admin."""

    @property
    def key_id(self) -> str: ...

    @property
    def admin(self) -> bool: ...

    def may_see(self, owner: Optional[str]) -> bool:
        """Ownership: a key sees only what it owns (`owner` is a key id); the admin sees all."""
        ...


@dataclass
class Reservation:
    """Tokens and one request held for a key between admission and the request's end."""

    key_id: str
    tokens: int
    day: int
    ident: int
    settled: bool = False
    hold_id: Optional[str] = None  # its row in quota_holds when the database holds it (gateway.quota_db)
    model: Optional[str] = None  # the model name the request used: its per-model limits hold it too


class Quotas(Protocol):
    """Token quotas per key, and per model of a key (the gateway's `QuotaBook`). `reserve` raises
    RateLimited (429)."""

    def reserve(self, key_id: str, cost: int, model: Optional[str] = None) -> Reservation: ...

    async def acquire(self, key_id: str, cost: int, hold_id: str, model: Optional[str] = None) -> Reservation:
        """`reserve`, awaited: a quota book in a shared database reserves in a transaction. `model`
        (the name the request used) also reserves against the key's limits for that model."""
        ...

    def settle(self, res: Reservation, actual: int, *, ran: bool = True) -> None: ...


class AccessPolicy(Protocol):
    """The policy a Runtime starts after its ledger opens (the keys live in the ledger's
    database) and before the service admits anything; closed after the ledger."""

    @property
    def quotas(self) -> Optional[Quotas]:
        """None while not started; the service reserves against it once it is."""
        ...

    async def start(self, ledger: "Ledger") -> None: ...

    def close(self) -> None: ...
