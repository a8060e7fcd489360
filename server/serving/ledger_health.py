"""What the server says when the ledger cannot write: the end event a client gets instead of `done`
when its terminal row did not commit, and the ledger's part of /health.

The rule is the one `accepted` follows: an acknowledgement follows the commit. A request whose
terminal write failed is not reported `done`; the client gets an error (`ledger_write_failed`)
that says the output was produced but not recorded, with the usage, while the ledger keeps
retrying the write (`Ledger.finish_later`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from server.serving.ledger import Ledger
from server.serving.lifecycle import EndReason
from server.serving.streams import EndEvent


def unrecorded_end(end: EndEvent, exc: BaseException) -> EndEvent:
    """The client-facing end of a request whose terminal commit failed (`ledger_write_failed`)."""
    how = f"{end.state}" + (f" ({end.finish_reason})" if end.finished and end.finish_reason else "")
    return dataclasses.replace(
        end, reason=EndReason.UNRECORDED,
        message=(f"the request ended {how} but its record could not be written to the ledger ({exc}); "
                 "the server keeps retrying the write and holds the usage until it lands"),
    )


def ledger_health(ledger: Ledger | None) -> dict[str, Any]:
    """The ledger's entry in /health: ok, or failing with the error and the writes still owed."""
    if ledger is None:
        return {"status": "closed"}
    if ledger.healthy:
        return {"status": "ok"}
    return {"status": "failing", "error": ledger.write_error or "terminal writes are still being retried",
            "owed_terminal_writes": len(ledger.owed)}
