"""The proposer interface of speculative decoding, and the n-gram (prompt lookup) proposer.

SpecDecoder (engine/spec_decode.py) owns everything proposer-independent: which sequences may
speculate this step and how many tokens each (`room`), verification, acceptance tracking, and the
target's KV rollback. A proposer only answers "which tokens next, and with which distribution":

    propose(cands)  ->  Proposals
        cands: (sequence, at most k tokens) for each sequence that decodes this step.
    synced(seq)
        after verification: the sequence's verified tokens changed, roll back any state that
        depended on unverified proposals (the draft model's KV).

Proposals.probs is None for a deterministic proposer (the n-gram one: each proposal is a point
mass, q(d) = 1 in rejection sampling), else the distribution q each proposed token was drawn
from (one float32 [k_i, V] tensor per sequence), so rejection sampling stays exact for sampled
requests. Per-sequence proposer state is released when the target frees the sequence's KV
(finish, abort, preemption): KVCacheManager's free listeners.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from server.engine.request import Sequence
from server.kernels import ops


@dataclass
class Proposals:
    """tokens[i]: the tokens proposed for cands[i] (possibly fewer than asked, or none).
    probs: None (each proposal is a point mass) or, per candidate, float32 [len(tokens[i]), V]:
    row j is the distribution tokens[i][j] was drawn from."""

    tokens: list[list[int]]
    probs: Optional[list[Optional[torch.Tensor]]] = None


class Proposer(Protocol):
    """What SpecDecoder needs of a proposer (see the module docstring)."""

    def propose(self, cands: list[tuple[Sequence, int]]) -> Proposals: ...

    def synced(self, seq: Sequence) -> None: ...

    def accepts(self, seq: Sequence) -> bool:
        """Whether this proposer can speculate for `seq` at all (e.g. a draft model cannot propose
        for a sampled, grammar-constrained request without biasing it)."""
        ...


class _NgramState:
    """A sequence's tokens as the int64 buffer the C++ proposer reads (copied incrementally)."""

    __slots__ = ("buf", "n")

    def __init__(self, capacity: int) -> None:
        self.buf = torch.empty(capacity, dtype=torch.int64)
        self.n = 0  # tokens of seq.token_ids copied into buf


class NgramProposer:
    """Prompt lookup: the longest suffix n-gram (prompt_lookup_min..max) found earlier in the
    sequence's own prompt and output proposes the tokens that followed it (`server._C`
    ngram_propose, batched over the step)."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k = k
        self.min_n = min_n
        self.max_n = max_n
        self._state: dict[int, _NgramState] = {}

    def release(self, seq: Sequence) -> None:
        self._state.pop(seq.seq_id, None)

    def accepts(self, seq: Sequence) -> bool:
        return True

    def synced(self, seq: Sequence) -> None:
        return None  # stateless between steps apart from the token buffer, which only grows

    def propose(self, cands: list[tuple[Sequence, int]]) -> Proposals:
        if not cands:
            return Proposals([])
        bufs: list[torch.Tensor] = []
        lens: list[int] = []
        for seq, _ in cands:
            st = self._state.get(seq.seq_id)
            if st is None:
                st = self._state[seq.seq_id] = _NgramState(seq.request.max_total_tokens)
            if seq.num_tokens > st.n:  # token_ids only grow: copy the new tail
                st.buf[st.n : seq.num_tokens] = torch.tensor(seq.token_ids[st.n :], dtype=torch.int64)
                st.n = seq.num_tokens
            bufs.append(st.buf)
            lens.append(st.n)
        rows = ops.ngram_propose(
            bufs, torch.tensor(lens, dtype=torch.int64), self.k, self.min_n, self.max_n
        ).tolist()
        tokens: list[list[int]] = []
        for (_, kk), row in zip(cands, rows):
            toks: list[int] = []
            for t in row[:kk]:
                if t < 0:
                    break
                toks.append(t)
            tokens.append(toks)
        return Proposals(tokens)
