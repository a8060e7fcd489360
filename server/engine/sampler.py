"""The batched sampler: logits of one step -> one token per row, plus logprobs when asked.

`SamplingBatch.build` turns per-request SamplingParams into per-row tensors once per step on the
host ("plan"); `Sampler.__call__` runs batched tensor ops with no per-row Python loop ("run"),
except a loop over the seeded rows only, to draw their noise from their own generators.

Order of operations (as vLLM v1): penalties -> blocked tokens -> grammar bitmask -> greedy argmax | temperature ->
top-k -> top-p -> min-p -> sample. Logprobs are of the raw logits (before any of that).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch

from server.engine.sampling_params import SamplingParams
from server.kernels import batch_invariant, ops

if TYPE_CHECKING:  # pragma: no cover
    from server.engine.request import Sequence as Seq

# Temperatures this small are greedy: dividing by them only amplifies float noise (vLLM's rule).
GREEDY_EPS = 1e-5
# Exponential noise is clamped away from 0: a 0 would make probs / q = 0/0 = NaN for a filtered
# token, and argmax treats NaN as the maximum, so a filtered token could win.
_MIN_NOISE = 1e-20


@dataclass
class SamplingBatch:
    """Per-row sampling state for one step. S = rows (sequences), V = vocabulary.

    Tensors live on the logits' device. Optional fields are None when no row needs them, so the
    sampler skips that work entirely.

    greedy:          bool  [S]     row is greedy (only set when the batch mixes greedy and sampled)
    temperature:     float [S, 1]  1.0 on greedy rows (never divided by 0)
    top_k:           int64 [S]     0 = disabled for that row
    top_p / min_p:   float [S]     1.0 / 0.0 = disabled for that row
    repetition_penalty / presence_penalty / frequency_penalty: float [S, 1]
    output_counts:   float [S, V]  occurrences of each token in the row's output so far
    seen:            bool  [S, V]  token occurs in the prompt or output (repetition penalty)
    blocked_rows / blocked_cols: int64 [N]  (row, token) pairs forced to -inf
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    greedy: Optional[torch.Tensor] = None
    temperature: Optional[torch.Tensor] = None
    top_k: Optional[torch.Tensor] = None
    max_top_k: int = 0
    top_p: Optional[torch.Tensor] = None
    min_p: Optional[torch.Tensor] = None
    repetition_penalty: Optional[torch.Tensor] = None
    presence_penalty: Optional[torch.Tensor] = None
    frequency_penalty: Optional[torch.Tensor] = None
    output_counts: Optional[torch.Tensor] = None
    seen: Optional[torch.Tensor] = None
    blocked_rows: Optional[torch.Tensor] = None
    blocked_cols: Optional[torch.Tensor] = None
    max_num_logprobs: Optional[int] = None  # None: no row asked; else K = the largest request
    # Structured outputs: int32 [S, ceil(V'/32)] on the host, bit t = token t allowed (all bits
    # set on unconstrained rows); None when no row is constrained (server.engine.structured).
    token_bitmask: Optional[torch.Tensor] = None
    seeded: tuple[tuple[int, torch.Generator], ...] = ()

    @property
    def fast_greedy(self) -> bool:
        """All greedy, nothing to adjust, no logprobs: the whole step is one argmax."""
        return (
            self.all_greedy
            and self.repetition_penalty is None
            and self.presence_penalty is None
            and self.blocked_rows is None
            and self.max_num_logprobs is None
            and self.token_bitmask is None
        )

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[Optional[torch.Generator]],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        blocked_token_ids: Optional[Sequence[Sequence[int]]],
        vocab_size: int,
        device: torch.device | str,
        token_bitmask: Optional[torch.Tensor] = None,
    ) -> "SamplingBatch":
        """Plan one step. Every sequence argument has one entry per row, in row order.

        Token lists are only read for rows whose params need them (penalties), so callers may
        pass empty lists elsewhere. `generators[i]` is the row's own generator if its request has
        a seed, else None.
        """
        s = len(params)
        for name, seq in (("generators", generators), ("output_token_ids", output_token_ids),
                          ("prompt_token_ids", prompt_token_ids)):
            if len(seq) != s:
                raise ValueError(f"{name}: expected {s} rows (one per params), got {len(seq)}")
        if blocked_token_ids is not None and len(blocked_token_ids) != s:
            raise ValueError(f"blocked_token_ids: expected {s} rows, got {len(blocked_token_ids)}")
        dev = torch.device(device)
        v = vocab_size
        greedy = [p.temperature < GREEDY_EPS for p in params]
        batch = cls(num_rows=s, vocab_size=v, all_greedy=all(greedy), token_bitmask=token_bitmask)

        def col(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=dev).unsqueeze(1)

        if not batch.all_greedy:
            if any(greedy):
                batch.greedy = torch.tensor(greedy, dtype=torch.bool, device=dev)
            batch.temperature = col([1.0 if g else p.temperature for p, g in zip(params, greedy)])
            # top_k >= V keeps everything: treat as disabled so max_top_k stays small.
            ks = [p.top_k if 0 < p.top_k < v else 0 for p in params]
            if any(ks):
                batch.top_k = torch.tensor(ks, dtype=torch.int64, device=dev)
                batch.max_top_k = max(ks)
            if any(p.top_p < 1.0 for p in params):
                batch.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
            if any(p.min_p > 0.0 for p in params):
                batch.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
            batch.seeded = tuple(
                (i, g) for i, (g, gr) in enumerate(zip(generators, greedy)) if g is not None and not gr
            )

        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            batch.presence_penalty = col([p.presence_penalty for p in params])
            batch.frequency_penalty = col([p.frequency_penalty for p in params])
            rows = [list(o) if (p.presence_penalty or p.frequency_penalty) else []
                    for p, o in zip(params, output_token_ids)]
            batch.output_counts = _token_counts(rows, v, dev)
        if any(p.repetition_penalty != 1.0 for p in params):
            batch.repetition_penalty = col([p.repetition_penalty for p in params])
            rows = [list(pr) + list(o) if p.repetition_penalty != 1.0 else []
                    for p, pr, o in zip(params, prompt_token_ids, output_token_ids)]
            batch.seen = _token_counts(rows, v, dev) > 0

        if blocked_token_ids is not None and any(blocked_token_ids):
            r = [i for i, toks in enumerate(blocked_token_ids) for _ in toks]
            c = [t for toks in blocked_token_ids for t in toks]
            if min(c) < 0 or max(c) >= v:
                raise ValueError(f"blocked_token_ids: ids must be in [0, {v}), got {min(c)}..{max(c)}")
            batch.blocked_rows = torch.tensor(r, dtype=torch.int64, device=dev)
            batch.blocked_cols = torch.tensor(c, dtype=torch.int64, device=dev)

        asked = [p.logprobs for p in params if p.logprobs is not None]
        if asked:
            batch.max_num_logprobs = min(max(asked), v)
        return batch


def plain_greedy(seq: "Seq") -> bool:
    """The sequence's next token is its logits' argmax and nothing else: greedy, no logprobs, no
    penalties, no grammar, and nothing blocked (min_tokens reached, see OutputProcessor.blocked_tokens).
    A step whose rows all are needs no SamplingBatch (the per-row form of `fast_greedy`): the engine
    then takes one argmax (LLMEngine._sample_and_apply)."""
    p = seq.request.params
    return (p.temperature < GREEDY_EPS and p.logprobs is None and not p.needs_penalties and seq.grammar is None
            and len(seq.token_ids) - seq.num_prompt_tokens >= p.min_tokens)


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """float [S, V]: how often each token occurs in each row. Rows are padded with id V, counted
    into a spare column V, which is then dropped (so no per-row loop on the device)."""
    width = max((len(r) for r in rows), default=0)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    if width:
        padded = torch.tensor([r + [vocab_size] * (width - len(r)) for r in rows], dtype=torch.int64)
        if int(padded.min()) < 0 or int(padded.max()) > vocab_size:
            raise ValueError(f"token ids must be in [0, {vocab_size}) for penalties")
        padded = padded.to(device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """int64 [S]: each row's argmax, the first index on ties and NaN counting as the largest,
    as torch's. On the CPU through pagewire's op (server.kernels.ops.argmax_rows): vectorised, and
    each core scans the logits it just computed. torch's argmax took ~100 us a row over a 49k
    vocabulary on a Zen 3, numpy's 25-30 us cold after a step on a Xeon (half the row in the other
    core's cache), the op ~10 us; a share of a decode step either way (bench/RESULTS.md, session 23)."""
    if x.is_cpu and (x.dtype is torch.float32 or x.dtype is torch.bfloat16) and x.dim() == 2 and x.stride(-1) == 1 \
            and x.shape[-1] > 0:
        return ops.argmax_rows(x)
    return x.argmax(dim=-1)


@dataclass
class SamplerOutput:
    """token_ids:    int64 [S]     the chosen token per row
    logprobs:     float [S]     its logprob under the raw logits (None if no row asked)
    top_ids:      int64 [S, K]  top-K token ids by raw logprob, best first (None if K == 0)
    top_logprobs: float [S, K]  their logprobs; a row that asked for k < K reads a prefix
    """

    token_ids: torch.Tensor
    logprobs: Optional[torch.Tensor] = None
    top_ids: Optional[torch.Tensor] = None
    top_logprobs: Optional[torch.Tensor] = None


class Sampler:
    """Samples one token per row. Holds the generator that unseeded rows share (per device)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def shared_generator(self, device: torch.device) -> torch.Generator:
        """The generator unseeded rows draw from on `device` (speculative verification uses it too)."""
        return self._shared_generator(device)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generators[device] = g
        return g

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Args:
            logits: float [S, V] (not modified).
            batch: the step's SamplingBatch, S rows.
        Returns:
            SamplerOutput.
        """
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits: expected shape [{batch.num_rows}, V], got {tuple(logits.shape)}")
        if batch.fast_greedy:
            return SamplerOutput(argmax_rows(logits))
        raw = logits.float()
        x = apply_penalties(raw, batch)
        if batch.blocked_rows is not None:
            if x is raw:
                x = raw.clone()  # never write into the caller's logits
            x[batch.blocked_rows, batch.blocked_cols] = float("-inf")
        if batch.token_bitmask is not None:
            # Structured outputs: every row's grammar mask in one batched op (a new tensor).
            x = apply_token_bitmask(x, batch.token_bitmask)
        if batch.all_greedy:
            tokens = argmax_rows(x)
        else:
            sampled = self._sample(x, batch)
            tokens = sampled if batch.greedy is None else torch.where(batch.greedy, x.argmax(dim=-1), sampled)
        if batch.max_num_logprobs is None:
            return SamplerOutput(tokens)
        logprobs = torch.log_softmax(raw, dim=-1)
        token_lp = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        if batch.max_num_logprobs == 0:
            return SamplerOutput(tokens, token_lp)
        top_lp, top_ids = logprobs.topk(batch.max_num_logprobs, dim=-1)
        return SamplerOutput(tokens, token_lp, top_ids, top_lp)

    def _sample(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Temperature, filters, then the exponential race: argmax(p / q), q ~ Exp(1), draws
        exactly from p (a Gumbel-max variant) and lets each row's noise come from its own source."""
        # No renormalisation after min-p: argmax(p / q) ignores a per-row scale.
        probs = sampling_probs(x, batch, normalize=False)
        q = torch.empty_like(probs)
        if len(batch.seeded) < batch.num_rows:
            q.exponential_(generator=self._shared_generator(q.device))
        # The only per-row loop: each seeded row draws from its own generator, so its sample depends
        # only on its seed and its step count, never on the batch around it.
        for i, g in batch.seeded:
            if g.device == q.device:
                q[i].exponential_(generator=g)
            else:
                q[i] = torch.empty(q.shape[1], device=g.device).exponential_(generator=g).to(q.device)
        q.clamp_min_(_MIN_NOISE)
        return argmax_rows(probs.div_(q))


def sampling_probs(x: torch.Tensor, batch: SamplingBatch, normalize: bool = True) -> torch.Tensor:
    """The distribution a sampled row draws from: temperature, then top-k / top-p, softmax, min-p.

    `x` are logits after penalties and blocked tokens. With normalize=False the rows min-p
    filtered are left unnormalised (the sampler's race ignores the scale); speculative
    verification needs true probabilities (normalize=True).
    """
    assert batch.temperature is not None
    x = x / batch.temperature
    if batch.top_k is not None or batch.top_p is not None:
        x = _top_k_top_p(x, batch.top_k, batch.max_top_k, batch.top_p)
    probs = torch.softmax(x, dim=-1)
    if batch.min_p is not None:
        # Relative to the row's top probability, so unnormalised probs give the same mask.
        top = probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < top * batch.min_p.unsqueeze(1), 0.0)
        if normalize:
            probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set every disallowed logit to -inf, for all rows at once. `bitmask` is int32 [S, W] on the
    host (bit t % 32 of word t // 32 = token t allowed); columns beyond W * 32 are disallowed.
    Returns a new tensor (the caller's logits stay raw, for logprobs)."""
    s, v = logits.shape
    # Unpack on the host (numpy's unpackbits is one C loop; little-endian int32 words and
    # little bit order give token t at column t), then one masked_fill on the logits' device.
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits.view(np.bool_)).to(logits.device, non_blocking=True)
    if allowed.shape[1] >= v:
        allowed = allowed[:, :v]
    else:
        allowed = torch.cat([allowed, allowed.new_zeros((s, v - allowed.shape[1]))], dim=1)
    return logits.masked_fill(~allowed, float("-inf"))


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (HF: divide positive, multiply negative logits of seen tokens), then frequency
    and presence (OpenAI: subtract per output occurrence / once if present). Returns `logits`
    itself when no row has penalties, else a new tensor."""
    if batch.repetition_penalty is not None:
        assert batch.seen is not None
        rp = batch.repetition_penalty
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(batch.seen, penalised, logits)
    if batch.presence_penalty is not None:
        assert batch.output_counts is not None and batch.frequency_penalty is not None
        counts = batch.output_counts
        logits = logits - batch.frequency_penalty * counts - batch.presence_penalty * (counts > 0)
    return logits


def _top_k_top_p(
    x: torch.Tensor, top_k: Optional[torch.Tensor], max_top_k: int, top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """Mask (to -inf) logits outside each row's top-k and top-p set. Rows with k = 0 / p = 1 keep all.

    Top-k alone needs only torch.topk(max k); top-p needs a full sort, which then serves top-k too.
    """
    neg_inf = float("-inf")
    if top_p is None:
        assert top_k is not None
        kth = x.topk(max_top_k, dim=-1).values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
        kth = kth.masked_fill((top_k == 0).unsqueeze(1), neg_inf)
        return x.masked_fill(x < kth, neg_inf)
    # Ascending: the kept set is a suffix. Batch-invariant mode sorts stably, so tied logits keep
    # their vocabulary order and top-p's cut among them is a function of the row alone.
    sorted_x, order = x.sort(dim=-1, stable=batch_invariant.enabled())
    v = x.shape[1]
    if top_k is not None:
        kth_pos = torch.where(top_k > 0, v - top_k, torch.zeros_like(top_k))
        kth = sorted_x.gather(1, kth_pos.unsqueeze(1))
        sorted_x = sorted_x.masked_fill(sorted_x < kth, neg_inf)
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    # Drop the low tail whose total mass is at most 1 - p; the top token always stays.
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_x = sorted_x.masked_fill(drop, neg_inf)
    return torch.empty_like(x).scatter_(1, order, sorted_x)
