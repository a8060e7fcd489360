"""OutputProcessor: applies sampled tokens to sequences, decides when they stop, builds deltas.

It runs on the engine thread right after sampling, so stop strings end a sequence in the same
step they appear (no over-generation, exact usage) and the text that leaves the engine is already
detokenised: never broken UTF-8, never past a stop string.
"""
from __future__ import annotations

import time
from typing import Iterable, Optional

from server.engine.outputs import RequestDelta, SampleDelta, TokenLogprob
from server.engine.request import Request, Sequence
from server.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
from server.text.tokenizer import Tokenizer


class _TextState:
    """Per-sample detokenizer + stop-string matcher and the text not yet emitted."""

    __slots__ = ("detok", "stops", "pending", "reported")

    def __init__(self, tokenizer: Tokenizer, seq: Sequence) -> None:
        p = seq.request.params
        self.detok = IncrementalDetokenizer(
            tokenizer, seq.token_ids, skip_special_tokens=p.skip_special_tokens
        )
        self.stops: Optional[StopStringMatcher] = (
            StopStringMatcher(list(p.stop), p.include_stop_str_in_output) if p.stop else None
        )
        self.pending = ""
        self.reported = False  # the finish_reason has been sent (exactly once)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def init_sequence(self, seq: Sequence) -> None:
        seq.text_state = _TextState(self.tokenizer, seq)

    def blocked_tokens(self, seq: Sequence) -> list[int]:
        """Tokens the sampler must not pick yet: EOS and stop ids until min_tokens is reached."""
        p = seq.request.params
        if seq.num_output_tokens >= p.min_tokens:
            return []
        return [*self.eos_token_ids, *p.stop_token_ids]

    def append_token(self, seq: Sequence, token: int, logprob: Optional[TokenLogprob]) -> None:
        """Add one sampled token to `seq` and finish it if a stop condition holds."""
        p = seq.request.params
        state: _TextState = seq.text_state  # type: ignore[assignment]
        seq.token_ids.append(token)
        seq.new_token_ids.append(token)
        if logprob is not None:
            seq.new_logprobs.append(logprob)
        n_out = seq.num_output_tokens
        may_stop = n_out >= p.min_tokens
        if may_stop and token in p.stop_token_ids:
            self._finish(seq, "stop", token)
            return
        if may_stop and not p.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, "stop", None)
            return
        text = state.detok.add([token])
        # Stop strings count only once min_tokens are out (vLLM's rule, like EOS and stop ids).
        if state.stops is not None and may_stop:
            emit, stopped, matched = state.stops.feed(text)
            state.pending += emit
            if stopped:
                self._finish(seq, "stop", matched, flush=False)
                return
        else:
            state.pending += text
        if (p.max_tokens is not None and n_out >= p.max_tokens) or (
            seq.num_tokens >= seq.request.max_total_tokens
        ):
            self._finish(seq, "length", None)

    def finish(self, seq: Sequence, reason: str, stop_reason: Optional[int | str] = None) -> None:
        """End `seq` for a reason decided outside this class (structured outputs: the grammar is
        complete, or allows nothing), releasing any text held back."""
        self._finish(seq, reason, stop_reason)

    def _finish(self, seq: Sequence, reason: str, stop_reason: Optional[int | str], flush: bool = True) -> None:
        state: _TextState = seq.text_state  # type: ignore[assignment]
        if flush:
            # Release what was held back: an incomplete UTF-8 tail, or a possible stop prefix.
            tail = state.detok.flush()
            if state.stops is not None:
                emit, stopped, matched = state.stops.feed(tail)
                tail = emit if stopped else emit + state.stops.flush()
            state.pending += tail
        # The engine sees finish_reason and hands the sequence to Scheduler.finish, which frees
        # its blocks and marks it FINISHED.
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def make_delta(self, req: Request, now: Optional[float] = None) -> Optional[RequestDelta]:
        """Drain every sample's news into one RequestDelta (None if there is nothing to say)."""
        samples: list[SampleDelta] = []
        for seq in req.sequences:
            state: _TextState = seq.text_state  # type: ignore[assignment]
            finishing = seq.is_finished and not state.reported
            if not seq.new_token_ids and not state.pending and not finishing:
                continue
            samples.append(
                SampleDelta(
                    index=seq.index,
                    token_ids=seq.new_token_ids,
                    text=state.pending,
                    logprobs=seq.new_logprobs if seq.request.params.logprobs is not None else None,
                    finish_reason=seq.finish_reason if seq.is_finished else None,
                    stop_reason=seq.stop_reason if seq.is_finished else None,
                )
            )
            seq.new_token_ids = []
            seq.new_logprobs = []
            state.pending = ""
            if seq.is_finished:
                state.reported = True
        if not samples and not req.finished:
            return None
        t = now if now is not None else time.time()
        return RequestDelta(
            request_id=req.request_id,
            samples=samples,
            finished=req.finished,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=req.num_cached_tokens,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finished_time=t if req.finished else None,
            error=req.error,
        )

