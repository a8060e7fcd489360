"""OutputProcessor: applies sampled tokens to sequences, decides when they stop, builds deltas.

It runs on the engine thread right after sampling, so stop strings end a sequence in the same
step they appear (no over-generation, exact usage) and the text that leaves the engine is already
detokenised: never broken UTF-8, never past a stop string.

`emit` is the one way a sampled token joins a sequence, for plain decoding (the engine's sampler
rows) and speculative decoding (each accepted position, engine/spec_decode.py) alike: the grammar
accepts it, it is appended with every stop check, and a complete grammar stops the sample.
"""
from __future__ import annotations

import time
from typing import Iterable, Optional

from server.engine.outputs import FinishReason, RequestDelta, SampleDelta, TokenLogprob
from server.engine.request import Request, Sequence
from server.text.detokenizer import SampleText
from server.text.tokenizer import Tokenizer


def _text(seq: Sequence) -> SampleText:
    state = seq.text_state
    assert state is not None, "OutputProcessor.init_sequence was not called for this sequence"
    return state


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def init_sequence(self, seq: Sequence) -> None:
        p = seq.request.params
        stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or ())  # validate() made it a list
        seq.text_state = SampleText(self.tokenizer, seq.token_ids, p.skip_special_tokens, stop,
                                    p.include_stop_str_in_output)

    def blocked_tokens(self, seq: Sequence, ahead: int = 0) -> list[int]:
        """Tokens the sampler must not pick yet: EOS and stop ids until min_tokens is reached.

        `ahead`: for the position that many tokens past the sequence's end (speculative
        verification scores positions after proposed tokens)."""
        p = seq.request.params
        if seq.num_output_tokens + ahead >= p.min_tokens:
            return []
        return [*self.eos_token_ids, *p.stop_token_ids]

    def emit(self, seq: Sequence, token: int, logprob: Optional[TokenLogprob]) -> bool:
        """Emit one sampled token to `seq`. Returns False when the token was not emitted: the
        sequence's grammar rejected it (unreachable while its mask was applied), which ends the
        sample as a grammar dead end rather than emit a token outside the grammar.

        Otherwise the token is appended and every stop condition checked (`append_token`); a
        grammar that is then complete (nothing but EOS may follow) stops the sample as EOS would,
        also over a `length` stop that landed on the same token."""
        grammar = seq.grammar
        if grammar is not None and not grammar.consume(token):
            self.finish(seq, FinishReason.GRAMMAR_DEAD_END)
            return False
        self.append_token(seq, token, logprob)
        if grammar is not None and grammar.is_complete:
            if seq.finish_reason is None:
                self.finish(seq, FinishReason.STOP)
            elif seq.finish_reason == FinishReason.LENGTH:
                seq.finish_reason = FinishReason.STOP
        return True

    def append_token(self, seq: Sequence, token: int, logprob: Optional[TokenLogprob]) -> None:
        """Add one sampled token to `seq` and finish it if a stop condition holds (no grammar:
        `emit` is the caller's entry point)."""
        p = seq.request.params
        state = _text(seq)
        seq.token_ids.append(token)
        seq.new_token_ids.append(token)
        if logprob is not None:
            seq.new_logprobs.append(logprob)
        n_out = seq.num_output_tokens
        may_stop = n_out >= p.min_tokens
        if may_stop and token in p.stop_token_ids:
            self._finish(seq, FinishReason.STOP, token)
            return
        if may_stop and not p.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, FinishReason.STOP, None)
            return
        text = state.detok.add_token(token)
        # Stop strings count only once min_tokens are out (vLLM's rule, like EOS and stop ids).
        if state.stops is not None and may_stop:
            emit, stopped, matched = state.stops.feed(text)
            state.pending += emit
            if stopped:
                self._finish(seq, FinishReason.STOP, matched, flush=False)
                return
        else:
            state.pending += text
        if (p.max_tokens is not None and n_out >= p.max_tokens) or (
            seq.num_tokens >= seq.request.max_total_tokens
        ):
            self._finish(seq, FinishReason.LENGTH, None)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: Optional[int | str] = None) -> None:
        """End `seq` for a reason decided outside this class (structured outputs: the grammar is
        complete, or allows nothing), releasing any text held back."""
        self._finish(seq, reason, stop_reason)

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: Optional[int | str],
                flush: bool = True) -> None:
        state = _text(seq)
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
            state = _text(seq)
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
            embedding=req.embedding if req.finished else None,
        )

