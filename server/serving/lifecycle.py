"""The request lifecycle: its states, its reasons, and the one table that says how each way of
ending is stored and reported.

A job (an accepted request, in memory) moves queued → running → ending → ended; its ledger row
moves queued → running → one terminal state. How it ended is an `EndReason`, decided once by the
service; everything downstream (the ledger row, the WebSocket `done`/`error` frame, the HTTP
error of a non-streamed or retried request, the SSE error event) reads `END_RULES[reason]`, so a
new way of ending is one new row here, not a new branch in each edge.

All enums are str-valued: their values are exactly what the ledger stores and the wire carries,
so comparing or serialising them needs no conversion.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from server.engine.outputs import FinishReason  # re-exported: the serving layer's name for it
from server.serving.errors import Conflict, DeadlineExceeded, GenerationFailed, Interrupted, PagewireError
from server.strenum import StrEnum as _StrEnum


class JobState(_StrEnum):
    """An accepted request in memory. `ending`: its terminal row is being committed."""

    QUEUED = "queued"
    RUNNING = "running"
    ENDING = "ending"
    ENDED = "ended"


class LedgerState(_StrEnum):
    """A ledger row's `state` column."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


OPEN_STATES = (LedgerState.QUEUED, LedgerState.RUNNING)
TERMINAL_STATES = (LedgerState.FINISHED, LedgerState.CANCELLED, LedgerState.FAILED, LedgerState.INTERRUPTED)


COMPLETE_REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.GRAMMAR_DEAD_END, FinishReason.TOOL_CALLS)


class CancelReason(_StrEnum):
    """Who stopped a request before it finished."""

    CLIENT = "client"
    DEADLINE = "deadline"
    SHUTDOWN = "shutdown"


class EndReason(_StrEnum):
    """How a request ended: the key of `END_RULES`."""

    FINISHED = "finished"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    INTERRUPTED = "interrupted"
    FAILED = "failed"
    # Ended (any way) but its terminal row did not commit: what the client hears instead of
    # the real end, while the ledger retries the write (server.serving.ledger_health).
    UNRECORDED = "unrecorded"


@dataclass(frozen=True)
class EndRule:
    """Everything that follows from one `EndReason`.

    Attributes:
        state: the ledger state.
        code: the error code in `error` frames and SSE error events, stored in the ledger's
            `finish_reason` column when the request did not finish (None when it did).
        message: the default message (a failure carries the engine's error when it has one).
        http_error: the error a non-streamed response (or an idempotent retry) answers with;
            its class gives the HTTP status (`http_status`).
        http_code: that error's code.
        http_message: that error's message; formatted with `request_id` and `message`.
        ws_frame: the WebSocket frame that ends the request, `done` or `error`.
        ws_finish_reason: in a `done` frame, replaces each sample's finish reason.
    """

    state: LedgerState
    code: Optional[str]
    message: Optional[str]
    http_error: Optional[type[PagewireError]]
    http_code: Optional[str]
    http_message: str
    ws_frame: str
    ws_finish_reason: Optional[FinishReason] = None

    @property
    def http_status(self) -> int:
        return 200 if self.http_error is None else self.http_error.status


END_RULES: dict[EndReason, EndRule] = {
    EndReason.FINISHED: EndRule(
        LedgerState.FINISHED, None, None, None, None, "", "done"),
    EndReason.CANCELLED: EndRule(
        LedgerState.CANCELLED, "cancelled", "cancelled by the client",
        Conflict, "request_cancelled", "request {request_id} was cancelled",
        "done", FinishReason.CANCELLED),
    EndReason.DEADLINE: EndRule(
        LedgerState.FAILED, "deadline_exceeded", "deadline exceeded before the request finished",
        DeadlineExceeded, "deadline_exceeded", "request {request_id}: {message}", "error"),
    EndReason.INTERRUPTED: EndRule(
        LedgerState.INTERRUPTED, "interrupted", "server stopped before the request finished",
        Interrupted, "request_interrupted", "request {request_id} was interrupted: {message}", "error"),
    EndReason.FAILED: EndRule(
        LedgerState.FAILED, "generation_failed", "generation failed",
        GenerationFailed, "generation_failed", "request {request_id} failed: {message}", "error"),
    EndReason.UNRECORDED: EndRule(
        LedgerState.FAILED, "ledger_write_failed", "the request's record could not be written to the ledger",
        GenerationFailed, "ledger_write_failed", "request {request_id}: {message}", "error"),
}

# A request stopped before it completed ends this way.
CANCEL_ENDS: dict[CancelReason, EndReason] = {
    CancelReason.CLIENT: EndReason.CANCELLED,
    CancelReason.DEADLINE: EndReason.DEADLINE,
    CancelReason.SHUTDOWN: EndReason.INTERRUPTED,
}


def end_reason_of_row(state: str, finish_reason: Optional[str]) -> EndReason:
    """How a ledger row ended, from its `state` and `finish_reason` columns (no message parsing).

    A row still open without a live request was left by a process that stopped: interrupted.
    """
    st = LedgerState(state)
    if st in OPEN_STATES or st is LedgerState.INTERRUPTED:
        return EndReason.INTERRUPTED
    if st is LedgerState.FAILED:
        deadline = END_RULES[EndReason.DEADLINE].code
        return EndReason.DEADLINE if finish_reason == deadline else EndReason.FAILED
    return EndReason(st.value)  # finished, cancelled


def end_error(request_id: str, reason: EndReason, message: Optional[str]) -> PagewireError:
    """The error a request that did not finish is answered with over HTTP."""
    rule = END_RULES[reason]
    if rule.http_error is None:
        raise ValueError(f"request {request_id} finished; it has no error")
    text = rule.http_message.format(request_id=request_id, message=message or rule.message)
    return rule.http_error(text, code=rule.http_code)
