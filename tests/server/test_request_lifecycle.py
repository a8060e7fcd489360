"""The request lifecycle table: every way of ending maps to one ledger state, error code, HTTP
error and WebSocket frame, and a ledger row maps back to the same reason from its columns alone."""
from __future__ import annotations

import pytest

from server.serving.errors import PagewireError
from server.serving.jobs import end_from_record
from server.serving.ledger import RequestRecord
from server.serving.lifecycle import (
    CANCEL_ENDS,
    END_RULES,
    CancelReason,
    EndReason,
    LedgerState,
    end_error,
    end_reason_of_row,
)


def _row(state: str, finish_reason: str | None, error: str | None) -> RequestRecord:
    return RequestRecord("req-1", None, "completion", "http", "c", "demo", state, 0, None, None, 0.0,
                         None, None, None, 3, 2, 0, finish_reason, error, "ab", None)


def test_every_end_reason_has_one_rule_and_the_wire_values_are_the_ledger_values() -> None:
    assert set(END_RULES) == set(EndReason)
    assert set(CANCEL_ENDS) == set(CancelReason)
    table = {r: (END_RULES[r].state, END_RULES[r].code, END_RULES[r].http_status, END_RULES[r].ws_frame)
             for r in EndReason}
    assert table == {
        EndReason.FINISHED: ("finished", None, 200, "done"),
        EndReason.CANCELLED: ("cancelled", "cancelled", 409, "done"),
        EndReason.DEADLINE: ("failed", "deadline_exceeded", 504, "error"),
        EndReason.INTERRUPTED: ("interrupted", "interrupted", 409, "error"),
        EndReason.FAILED: ("failed", "generation_failed", 500, "error"),
        # The output was produced but its terminal row could not be committed (disk full): the
        # client is told so, and the ledger keeps retrying the write (tests/faults/test_disk_full.py).
        EndReason.UNRECORDED: ("failed", "ledger_write_failed", 500, "error"),
    }
    assert f"{LedgerState.FINISHED}" == "finished" and str(EndReason.DEADLINE) == "deadline"


@pytest.mark.parametrize("reason", [r for r in EndReason if r is not EndReason.FINISHED])
def test_a_request_that_did_not_finish_answers_with_its_rules_error(reason: EndReason) -> None:
    rule = END_RULES[reason]
    err = end_error("req-9", reason, "why")
    assert isinstance(err, PagewireError)
    assert err.status == rule.http_status and err.code == rule.http_code and "req-9" in err.message


@pytest.mark.parametrize("state, finish_reason, error, reason", [
    ("finished", "length", None, EndReason.FINISHED),
    ("cancelled", "cancelled", "cancelled by the client", EndReason.CANCELLED),
    # The deadline is known from the stored code, whatever the message says.
    ("failed", "deadline_exceeded", "some other words", EndReason.DEADLINE),
    ("failed", "generation_failed", "deadline-like words in an engine error", EndReason.FAILED),
    ("interrupted", None, "server stopped before the request finished", EndReason.INTERRUPTED),
    ("running", None, None, EndReason.INTERRUPTED),  # left open by a process that died
])
def test_a_ledger_row_maps_back_to_its_end_reason(state: str, finish_reason: str | None, error: str | None,
                                                  reason: EndReason) -> None:
    assert end_reason_of_row(state, finish_reason) is reason
    end = end_from_record(_row(state, finish_reason, error))
    assert end.reason is reason and end.state == END_RULES[reason].state
    if reason is EndReason.FINISHED:
        assert end.message is None
    else:
        assert end.message == (error or END_RULES[reason].message)
