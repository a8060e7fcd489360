"""Speculative decoding in the engine: propose k tokens per decoding sequence, score them in the
step's flat batch, accept exactly, emit 1..k+1 tokens, roll rejected positions' KV back.

One step with speculation (the engine's hooks, in order):
1. `SpecDecoder.propose(running)`, before scheduling: each running sequence that is decoding (one
   token to catch up) gets up to k proposed tokens in `seq.spec_token_ids`, from the configured
   proposer (engine/proposer.py: the n-gram proposer, `server._C` ngram_propose batched over the
   step; or engine/draft_proposer.py: a draft model, which also returns the distribution q each
   proposal was drawn from). None when the batch is at least
   `disable_by_batch_size` (compute-bound: verifying costs real time there), or for a sequence
   whose acceptance stayed below `min_acceptance_rate`. Proposals never reach past the request's
   max_tokens / max_model_len bound.
2. The scheduler gives such a decode 1 + k tokens of the step's budget (trimming or dropping the
   proposals first when budget or KV runs short); the runner feeds them after the last verified
   token and returns 1 + k logits rows: row j scores the position after proposal j.
3. `SpecDecoder.verify(...)`, after the forward: every row is processed exactly as the sampler
   would process that position without speculation (penalties counting the proposals before it
   as output, min_tokens blocking by its own output count, temperature, top-k/top-p/min-p), then
   `server._C` rejection_sample accepts: greedy rows the longest prefix equal to the target's
   argmax plus the target's next token; sampled rows by rejection sampling (accept proposal d with
   probability min(1, p(d) / q(d)), an n-gram proposal being a point mass, q(d) = 1; on rejection
   draw from the residual max(p - q, 0);
   after k acceptances draw the bonus token), so emitted tokens are distributed as the target's.
   Uniform draws come from the request's own generator when it has a seed.
4. Emitted tokens go through the OutputProcessor one at a time (`emit`, the same path as the
   ordinary sampler's tokens), so EOS, stop ids, stop strings,
   min_tokens and max_tokens act at exactly the position they would without speculation (a stop
   inside an accepted run truncates there); logprobs are per emitted position, of its raw logits.
5. Rollback: `num_computed_tokens` becomes the verified length, the KVCacheManager truncates the
   blocks that only rejected positions used, and registers the newly verified full blocks in the
   prefix cache (proposed tokens are never registered: the scheduler registers verified tokens
   only). The proposer then rolls back its own state (`Proposer.synced`: the draft model's KV).

Everything here runs on the engine thread, between the scheduler and the output processor.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Optional
from typing import Sequence as Seq

import torch

from server.engine.kv_cache_manager import KVCacheManager
from server.engine.output_processor import OutputProcessor
from server.engine.outputs import TokenLogprob
from server.engine.proposer import NgramProposer, Proposer
from server.engine.request import Request, Sequence, SpecState
from server.engine.sampler import (
    GREEDY_EPS,
    Sampler,
    SamplingBatch,
    apply_penalties,
    apply_token_bitmask,
    argmax_rows,
    sampling_probs,
)
from server.engine.spec_config import SpeculativeConfig
from server.engine.structured import StructuredDecoder
from server.kernels import ops

logger = logging.getLogger("pagewire.engine.spec")


@dataclass
class SpecStats:
    """Cumulative speculative-decoding counters (never decrease).

    num_verified: sequence-steps that scored at least one proposed token.
    num_emitted: tokens those steps emitted (accepted proposals + the target's own token, minus
        any cut off by a stop). mean accepted length = 1 + num_accepted / num_verified.
    proposed_by_position[j] / accepted_by_position[j]: proposals at lookahead position j (0-based)
        and how many of them were accepted; their ratio is the acceptance rate by position.
    steps_off_batch: steps that proposed nothing because the batch was at least disable_by_batch_size.
    seqs_off_acceptance: sequences for which speculation was switched off for low acceptance.
    """

    num_proposed: int = 0
    num_accepted: int = 0
    num_emitted: int = 0
    num_verified: int = 0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    steps_off_batch: int = 0
    seqs_off_acceptance: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verified sequence-step if no stop cut them: 1 + accepted / verified."""
        return 1.0 + self.num_accepted / self.num_verified if self.num_verified else 0.0

    def snapshot(self) -> "SpecStats":
        return replace(
            self,
            proposed_by_position=list(self.proposed_by_position),
            accepted_by_position=list(self.accepted_by_position),
        )


@dataclass
class _Scored:
    """A step's verification batch (`SpecDecoder._score`): the proposing sequences with their
    logits rows, the target's raw logits per position, those logits processed as the sampler
    would (`x`), and the draft tokens in order with their per-sequence offsets (`cu`)."""

    spec: list[tuple[int, Sequence]]
    raw: torch.Tensor
    x: torch.Tensor
    batch: SamplingBatch
    drafts: list[int]
    cu: list[int]
    greedy: list[bool]


class SpecDecoder:
    """Proposes (through a Proposer) and verifies speculative tokens for the engine; see the module
    docstring. `proposer` defaults to the n-gram proposer of `config`."""

    def __init__(
        self,
        config: SpeculativeConfig,
        kv_cache: KVCacheManager,
        outputs: OutputProcessor,
        sampler: Sampler,
        device: torch.device,
        proposer: Optional[Proposer] = None,
    ) -> None:
        self.config = config
        if proposer is None:
            ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
            kv_cache.add_free_listener(ngram.release)
            proposer = ngram
        self.proposer: Proposer = proposer
        # The distribution each sequence's proposals were drawn from this step (draft model,
        # sampled requests): float32 [k, V], kept to hand to rejection sampling.
        self._draft_probs: dict[int, torch.Tensor] = {}
        # Set by the engine: grammar masks for the positions of constrained sequences' drafts.
        self.structured: Optional[StructuredDecoder] = None
        self.kv_cache = kv_cache
        self.outputs = outputs
        self.sampler = sampler
        self.device = device
        k = config.num_speculative_tokens
        self.stats = SpecStats(proposed_by_position=[0] * k, accepted_by_position=[0] * k)
        self._batch_off = False
        source = (f"n-gram {config.prompt_lookup_min}..{config.prompt_lookup_max}" if config.method == "ngram"
                  else f"draft model {config.model}")
        logger.info(
            "speculative decoding: %s, k=%d; off for batches >= %s; per sequence off "
            "below %.0f%% acceptance over %d proposed tokens",
            source, k, config.disable_by_batch_size or "never", 100 * config.min_acceptance_rate,
            config.acceptance_window,
        )

    # -- 1. propose -------------------------------------------------------------------------------
    def propose(self, running: Seq[Sequence]) -> None:
        """Set `spec_token_ids` of the running sequences that decode this step (see module doc)."""
        cfg = self.config
        for seq in running:  # proposals are per step: none carries over (unscheduled, or trimmed)
            if seq.spec_token_ids:
                seq.spec_token_ids = []
        self._draft_probs.clear()
        off = 0 < cfg.disable_by_batch_size <= len(running)
        if off != self._batch_off:
            self._batch_off = off
            logger.info(
                "speculative decoding %s for the batch: %d running sequence(s), threshold %d",
                "off" if off else "back on", len(running), cfg.disable_by_batch_size,
            )
        if off:
            self.stats.steps_off_batch += 1
            return
        k = cfg.num_speculative_tokens
        cands: list[tuple[Sequence, int]] = []
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens != 1:  # a prefill chunk or recompute
                continue
            # Grammar-constrained sequences speculate only once nothing is blocked by min_tokens:
            # then every position a validated draft reaches allows at least one token (a complete
            # grammar allows EOS), so verification never meets a row with nothing allowed.
            if seq.grammar is not None and self.outputs.blocked_tokens(seq):
                continue
            # Nor while a grammar waits for the end of a reasoning block: a run could carry the
            # block's end and then tokens verified without the grammar it switches on.
            if seq.grammar is not None and seq.grammar.gate is not None:
                continue
            # The target's own token follows the proposals, so k proposals may emit k + 1 tokens.
            room = seq.request.max_total_tokens - seq.num_tokens - 1
            if room <= 0:
                continue
            if self._state(seq).off or not self.proposer.accepts(seq):
                continue
            cands.append((seq, min(k, room)))
        if not cands:
            return
        proposals = self.proposer.propose(cands)
        for i, ((seq, _), toks) in enumerate(zip(cands, proposals.tokens)):
            if toks and seq.grammar is not None:  # only the prefix the grammar accepts is scored
                toks = toks[: StructuredDecoder.validate_draft(seq, toks)]
            seq.spec_token_ids = toks
            q = proposals.probs[i] if proposals.probs is not None else None
            if toks and q is not None:
                self._draft_probs[seq.seq_id] = q

    def _state(self, seq: Sequence) -> SpecState:
        if seq.spec_state is None:
            seq.spec_state = SpecState()
        return seq.spec_state

    # -- 3-5. verify, emit, roll back -------------------------------------------------------------
    def verify(
        self, logits: torch.Tensor, rows: list[tuple[int, Sequence]], touched: dict[str, Request], now: float
    ) -> tuple[list[tuple[int, Sequence]], int]:
        """Verify the sequences among `rows` (logits row, seq) that carry proposals; apply their
        tokens. Returns the rows left for the ordinary sampler and the number of tokens emitted."""
        spec = [(r, s) for r, s in rows if s.spec_token_ids]
        if not spec:
            return rows, 0
        plain = [(r, s) for r, s in rows if not s.spec_token_ids]
        scored = self._score(logits, spec)
        out, num_emitted = self._rejection_sample(scored)
        return plain, self._apply(scored, out, num_emitted, touched, now)

    def _score(self, logits: torch.Tensor, spec: list[tuple[int, Sequence]]) -> _Scored:
        """The verification batch: every position of every proposing sequence (its 1 + k rows)
        processed exactly as the sampler would process that position without speculation."""
        idx: list[int] = []
        params = []
        outs: list[list[int]] = []
        prompts: list[list[int]] = []
        blocked: list[list[int]] = []
        drafts: list[int] = []
        cu = [0]
        greedy: list[bool] = []
        for r, s in spec:
            k = len(s.spec_token_ids)
            idx.extend(range(r, r + k + 1))
            p = s.request.params
            out_ids = s.output_token_ids if p.needs_penalties else []
            for j in range(k + 1):
                params.append(p)
                outs.append(out_ids + s.spec_token_ids[:j] if p.needs_penalties else [])
                prompts.append(s.request.prompt_token_ids if p.needs_penalties else [])
                blocked.append(self.outputs.blocked_tokens(s, j))
            drafts.extend(s.spec_token_ids)
            cu.append(len(drafts))
            greedy.append(p.temperature < GREEDY_EPS)
        raw = logits.index_select(0, torch.tensor(idx, dtype=torch.int64, device=logits.device)).float()
        batch = SamplingBatch.build(
            params=params,
            generators=[None] * len(params),
            output_token_ids=outs,
            prompt_token_ids=prompts,
            blocked_token_ids=blocked,
            vocab_size=raw.shape[-1],
            device=raw.device,
        )
        # Exactly the sampler's processing of each position (sampler.py: penalties -> blocked ->
        # argmax | temperature -> top-k -> top-p -> min-p).
        x = apply_penalties(raw, batch)
        if batch.blocked_rows is not None:
            if x is raw:
                x = raw.clone()
            x[batch.blocked_rows, batch.blocked_cols] = float("-inf")
        # Grammar-constrained sequences: each position's logits masked by the grammar state after
        # the draft tokens before it, as the ordinary sampler masks its one position, so accepted
        # and bonus tokens are exactly what masked sampling could have produced.
        constrained: list[tuple[Sequence, int, list[int]]] = []
        first = 0
        for _, s in spec:
            if s.grammar is not None and s.grammar.gate is None:
                constrained.append((s, first, s.spec_token_ids))
            first += len(s.spec_token_ids) + 1
        if constrained and self.structured is not None:
            x = apply_token_bitmask(x, self.structured.draft_masks(constrained, x.shape[0]))
        return _Scored(spec, raw, x, batch, drafts, cu, greedy)

    def _rejection_sample(self, v: _Scored) -> tuple[list[list[int]], list[int]]:
        """Accept exactly (server._C rejection_sample, see the module doc): per sequence, the
        tokens it emits (accepted proposals, then the target's own or residual token) and how many."""
        probs = None if v.batch.all_greedy else sampling_probs(v.x, v.batch).contiguous()
        uniforms: list[torch.Tensor] = []
        for (_, s), g in zip(v.spec, v.greedy):
            n = len(s.spec_token_ids) + 1
            if g:
                uniforms.append(torch.zeros(n, dtype=torch.float64))
            else:
                gen = s.generator if s.generator is not None else self.sampler.shared_generator(v.raw.device)
                uniforms.append(torch.rand(n, dtype=torch.float64, generator=gen, device=gen.device).cpu())
        dev = v.raw.device
        draft_ids = torch.tensor(v.drafts, dtype=torch.int64, device=dev)
        out, num_emitted = ops.rejection_sample(
            draft_ids,
            torch.tensor(v.cu, dtype=torch.int64, device=dev),
            self._gather_draft_probs(v.spec, draft_ids, v.raw.shape[-1]) if probs is not None else None,
            probs,
            argmax_rows(v.x),
            torch.tensor(v.greedy, dtype=torch.bool, device=dev),
            torch.cat(uniforms).to(dev),
        )
        return out.tolist(), num_emitted.tolist()

    def _apply(self, v: _Scored, out: list[list[int]], num_emitted: list[int], touched: dict[str, Request],
               now: float) -> int:
        """Emit each sequence's tokens through the OutputProcessor, one position at a time (a stop
        inside an accepted run ends it there), count acceptance and roll the rest back. Returns
        the number of tokens emitted."""
        lps = top_ids = top_lps = None
        if v.batch.max_num_logprobs is not None:
            lp_all = torch.log_softmax(v.raw, dim=-1)  # logprobs are of each position's raw logits
            lps = lp_all
            if v.batch.max_num_logprobs > 0:
                top_lps, top_ids = lp_all.topk(v.batch.max_num_logprobs, dim=-1)
        emitted_total = 0
        base = 0
        st_stats = self.stats
        for i, (_, s) in enumerate(v.spec):
            k = len(s.spec_token_ids)
            n = num_emitted[i]
            accepted = n - 1
            req = s.request
            nlp = req.params.logprobs
            for j, t in enumerate(out[i][:n]):
                lp: Optional[TokenLogprob] = None
                if nlp is not None and lps is not None:
                    row = base + j
                    top = (
                        list(zip(top_ids[row, :nlp].tolist(), top_lps[row, :nlp].tolist()))
                        if (nlp and top_ids is not None and top_lps is not None)
                        else []
                    )
                    lp = TokenLogprob(t, float(lps[row, t]), top)
                if not self.outputs.emit(s, t, lp):  # a dead end: unreachable, every position was masked
                    break
                emitted_total += 1
                st_stats.num_emitted += 1
                if s.finish_reason is not None:  # a stop inside the accepted run ends it there
                    break
            base += k + 1
            st_stats.num_proposed += k
            st_stats.num_accepted += accepted
            st_stats.num_verified += 1
            for j in range(k):
                st_stats.proposed_by_position[j] += 1
                if j < accepted:
                    st_stats.accepted_by_position[j] += 1
            # Rollback: K/V is valid up to the last accepted proposal; the last emitted token's is
            # computed next step, like any sampled token's.
            s.num_computed_tokens = s.num_tokens - 1
            self.kv_cache.rollback(s)
            self.proposer.synced(s)
            s.spec_token_ids = []
            self._track_acceptance(s, k, accepted)
            if req.first_token_time is None:
                req.first_token_time = now
            touched[req.request_id] = req
        return emitted_total

    def _gather_draft_probs(self, spec: list[tuple[int, Sequence]], draft_ids: torch.Tensor,
                            vocab: int) -> Optional[torch.Tensor]:
        """q for rejection sampling: float32 [num_drafts, V] in draft order, or None when every
        proposal is a point mass. A sequence without q (greedy: never read; n-gram) gets one-hot
        rows; a sequence's q is cut to the proposals the scheduler kept."""
        if not self._draft_probs:
            return None
        rows: list[torch.Tensor] = []
        start = 0
        for _, s in spec:
            k = len(s.spec_token_ids)
            q = self._draft_probs.get(s.seq_id)
            if q is not None:
                rows.append(q[:k].to(device=draft_ids.device, dtype=torch.float32))
            else:
                one_hot = torch.zeros(k, vocab, dtype=torch.float32, device=draft_ids.device)
                one_hot[torch.arange(k, device=draft_ids.device), draft_ids[start : start + k]] = 1.0
                rows.append(one_hot)
            start += k
        return torch.cat(rows).contiguous()

    def _track_acceptance(self, seq: Sequence, proposed: int, accepted: int) -> None:
        st = seq.spec_state
        if st is None:
            return
        st.win_proposed += proposed
        st.win_accepted += accepted
        cfg = self.config
        if st.win_proposed < cfg.acceptance_window:
            return
        rate = st.win_accepted / st.win_proposed
        if rate < cfg.min_acceptance_rate:
            st.off = True
            self.stats.seqs_off_acceptance += 1
            logger.info(
                "speculative decoding off for request %s sample %d: accepted %d of %d proposed tokens (%.0f%% < %.0f%%)",
                seq.request.request_id, seq.index, st.win_accepted, st.win_proposed, 100 * rate,
                100 * cfg.min_acceptance_rate,
            )
        st.win_proposed = st.win_accepted = 0
