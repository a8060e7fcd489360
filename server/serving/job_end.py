"""How an accepted request's end is told: `end_event` decides its EndReason (by the rules of
server.serving.lifecycle: a cancel, a failure or a finish) and builds the EndEvent its
subscribers get; `terminal_row` is the ledger's terminal row for it, with as much of the text
as `--ledger-text` keeps. The request service decides when; this module only says what.
"""
from __future__ import annotations

import time
from typing import Optional

from server.engine.outputs import RequestDelta
from server.serving.jobs import Job
from server.serving.ledger import Terminal
from server.serving.lifecycle import CANCEL_ENDS, COMPLETE_REASONS, END_RULES, EndReason, FinishReason
from server.serving.streams import EndEvent


def end_event(job: Job, delta: Optional[RequestDelta]) -> EndEvent:
    """How `job` ended; `delta` (its final engine delta) is None when it never reached the engine
    or the engine refused it."""
    reasons = job.finish_reasons()
    # A request that completed in the same step its cancel arrived counts as finished.
    completed = delta is not None and bool(reasons) and all(r in COMPLETE_REASONS for r in reasons)
    message: Optional[str] = None
    if job.cancel_reason is not None and not completed:
        reason = CANCEL_ENDS[job.cancel_reason]
    elif job.error is not None or FinishReason.ERROR in reasons or delta is None:
        reason, message = EndReason.FAILED, job.error
    else:
        reason = EndReason.FINISHED
    if reason is not EndReason.FINISHED and message is None:
        message = END_RULES[reason].message
    return EndEvent(job.request_id, reason, reasons, job.usage(), job.stream.last_seq,
                    message=message, output=job.output())


def terminal_row(job: Job, end: EndEvent, ledger_text: str) -> Terminal:
    """The ledger's terminal row for `end`; usage is always kept, the text only with `all`."""
    text: Optional[str] = "".join(s.text for s in job.samples) if len(job.samples) == 1 else "\n".join(
        f"[{s.index}] {s.text}" for s in job.samples)
    output = end.output or {}
    if ledger_text != "all":
        text, output = None, {}
    return Terminal(
        state=end.state, finish_reason=end.finish_reason if end.finished else end.code,
        error=end.message, prompt_tokens=end.usage.prompt_tokens,
        completion_tokens=end.usage.completion_tokens, cached_tokens=end.usage.cached_tokens,
        output_text=text, output=output, first_token_at=job.first_token_wall,
        finished_at=time.time(), reasoning_tokens=end.usage.reasoning_tokens,
    )
