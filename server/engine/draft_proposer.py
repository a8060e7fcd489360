"""The draft-model proposer of speculative decoding: a second, smaller model proposes k tokens.

It owns the draft model, its own paged KV cache (a separate block allocator and KV tensors with as
many blocks as the target's, carved from the same KV budget by `kv_budget.kv_layout`), and one
*shadow* Sequence per target sequence it speculates for: the draft's view of that sequence (its
token ids, and how many of them have K/V in the draft's cache). Everything runs on the engine
thread, inside `SpecDecoder.propose`, before the target's step is scheduled.

A step, for the sequences that decode (one token to catch up in the target):
1. sync: the shadow keeps the K/V of the tokens it shares with the target's verified tokens and
   drops the rest (proposals the target rejected: the draft's rollback, as the target's);
2. catch up: the draft computes the verified tokens it has not seen yet through the same chunked
   path as the target's prefill (ModelRunner over a flat batch, at most max_num_batched_tokens
   per step; a sequence that needs more catches up over several steps, speculating only once it
   is up to date). Its last position's logits give the first proposal;
3. k - 1 more single-token forwards of the whole batch give the other proposals. Greedy requests
   take the draft's argmax; sampled ones draw from the draft's distribution q (temperature,
   top-k/top-p/min-p of the request), with the request's own generator when seeded, and hand q to
   rejection sampling, so the emitted tokens are distributed exactly as the target's.

The draft's KV is a cache, never needed for correctness: when its pool is short, a sequence simply
proposes fewer tokens (or none) this step. Its blocks go back when the target frees the sequence
(finish, abort, preemption: a preempted sequence's draft K/V is recomputed with it, helped by the
draft's own prefix cache). n > 1 samples fork sample 0's draft blocks (copy-on-write), as the
target's do. Forks and registration in the draft's prefix cache cover verified tokens only.

The draft must share the target's vocabulary: `check_vocabulary` compares the logits width, every
token string and the EOS ids at start-up and names the first difference.

Its pool keeps every layer's K/V for the whole sequence (no sliding-window groups: a draft's
rollbacks and forks may reach further back than a window). A draft whose layers differ in K/V size
or read another layer's KV (Gemma 4) is packed by the same KV-groups machinery as the target's
(`draft_kv_groups`, server/engine/kv_groups.py): one block table per size kind, all full.
"""
from __future__ import annotations

from typing import Optional

import torch

from server.engine.config import ConfigError, EngineConfig, Quantization
from server.engine.kv_budget import kv_bytes_per_token
from server.engine.kv_cache_manager import KVCacheManager
from server.engine.kv_groups import KVGroupLayout, kv_groups, kv_layer_groups
from server.engine.proposer import Proposals
from server.engine.request import Sequence
from server.engine.runner import ModelRunner
from server.engine.sampler import GREEDY_EPS, SamplingBatch, sampling_probs
from server.engine.scheduler import ScheduledSeq, SchedulerOutput
from server.engine.spec_config import SpeculativeConfig
from server.models.config import ModelConfig
from server.models.gguf_file import is_gguf_path
from server.models.loader import load_model
from server.models.protocol import CausalLM
from server.models.registry import kv_shape, read_model_config
from server.text.loader import load_tokenizer
from server.text.tokenizer import Tokenizer

_FIELD = "speculative_config.model"


def check_vocabulary(target_config: ModelConfig, target_tok: Tokenizer, draft_config: ModelConfig,
                     draft_tok: Tokenizer, draft_path: str) -> None:
    """Raise ConfigError (field speculative_config.model) unless the draft can propose tokens the
    target reads as the same tokens: equal logits width, equal token strings id for id, equal EOS."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ConfigError(_FIELD, f"the draft model {draft_path!r} has vocab_size {draft_config.vocab_size}, the "
                                  f"target has {target_config.vocab_size}; a draft model must share the target's vocabulary")
    if draft_tok.vocab_size != target_tok.vocab_size:
        raise ConfigError(_FIELD, f"the draft model's tokenizer has {draft_tok.vocab_size} tokens, the target's "
                                  f"{target_tok.vocab_size}; a draft model must share the target's vocabulary")
    ids = range(target_tok.vocab_size)
    for i, a, b in zip(ids, target_tok.convert_ids_to_tokens(ids), draft_tok.convert_ids_to_tokens(ids)):
        if a != b:
            raise ConfigError(_FIELD, f"token id {i} is {b!r} in the draft model's tokenizer but {a!r} in the "
                                      "target's; a draft model must share the target's vocabulary")
    t_eos = set(target_tok.eos_token_ids) | set(target_config.eos_token_ids)
    d_eos = set(draft_tok.eos_token_ids) | set(draft_config.eos_token_ids)
    if t_eos != d_eos:
        raise ConfigError(_FIELD, f"the draft model's EOS token ids {sorted(d_eos)} differ from the target's "
                                  f"{sorted(t_eos)}")


def _read_config(path: str) -> ModelConfig:
    """A model's config without its weights: config.json, or a GGUF file's metadata."""
    return read_model_config(path)


def check_draft_model(spec: SpeculativeConfig, target: str) -> None:
    """The start-up check `pagewire serve` runs before it starts (configs and tokenizers only, no
    weights): raises ConfigError naming speculative_config.model when the draft cannot be read or
    does not share the target's vocabulary. A no-op unless the method is draft_model."""
    if spec.method != "draft_model" or spec.model is None:
        return
    try:
        draft_config, draft_tok = _read_config(spec.model), load_tokenizer(spec.model)
    except (OSError, ValueError) as e:
        raise ConfigError(_FIELD, f"cannot load the draft model {spec.model!r}: {e}") from None
    check_vocabulary(_read_config(target), load_tokenizer(target), draft_config, draft_tok, spec.model)


def load_draft_model(spec: SpeculativeConfig, config: EngineConfig, target_config: ModelConfig,
                     target_tok: Tokenizer) -> tuple[CausalLM, ModelConfig]:
    """Load the draft model of `spec` (HF folder or GGUF) in the engine's dtype and device, and check
    its vocabulary against the target's. Load errors are reported as speculative_config.model."""
    assert spec.model is not None  # SpeculativeConfig requires it for method draft_model
    try:
        # With --quantization gguf a GGUF draft keeps its blocks too; a folder draft is float then.
        keep = config.quantization is Quantization.GGUF and is_gguf_path(spec.model)
        model, mc = load_model(spec.model, config.dtype, config.device, keep_gguf_blocks=keep)
        tok = load_tokenizer(spec.model)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:  # missing files, unsupported architectures, bad tensors
        raise ConfigError(_FIELD, f"cannot load the draft model {spec.model!r}: {e}") from None
    check_vocabulary(target_config, target_tok, mc, tok, spec.model)
    if config.quantization in (Quantization.INT8, Quantization.INT4):
        model.quantize_weights(config.quantization)
    return model, mc


def draft_kv_groups(mc: ModelConfig) -> KVGroupLayout:
    """The draft's KV groups: every layer full (see the module docstring); layers of different
    K/V sizes, or reading another layer's KV, packed into slots as the target's are."""
    shape = kv_shape(mc)
    full: list[int | None] = [None] * mc.num_layers
    if "layer_elems" in shape:
        return kv_layer_groups(full, shape["layer_elems"], shape["layer_sources"])
    return kv_groups(full)


def draft_block_bytes_per_token(groups: KVGroupLayout, mc: ModelConfig, element_size: int) -> int:
    """Bytes of one draft block per token it holds (kv_layout's draft_bytes_per_token): every
    layer's K and V with one group, a block's slots with several."""
    if groups.slot_elems:
        return 2 * groups.group_size * groups.slot_elems * element_size
    return kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, element_size)


class _Draft:
    """The draft's state for one target sequence: its shadow Sequence, and how many of the shadow's
    leading tokens are known to equal the target's verified tokens."""

    __slots__ = ("shadow", "verified")

    def __init__(self, shadow: Sequence, verified: int) -> None:
        self.shadow = shadow
        self.verified = verified


class DraftModelProposer:
    """Proposes with a draft model (see the module docstring); implements proposer.Proposer."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device,
                 max_num_batched_tokens: int, enable_prefix_caching: bool, target_kv: KVCacheManager,
                 groups: Optional[KVGroupLayout] = None) -> None:
        """groups: the draft's KV groups (draft_kv_groups; None: one group of every layer)."""
        self.model = model
        groups = groups if groups is not None else draft_kv_groups(model.config)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, groups.windows)
        kv_dtype = next(model.parameters()).dtype
        self.runner = ModelRunner(model, num_blocks, block_size, self.kv, device, kv_dtype, groups)
        self.device = device
        self.budget = max_num_batched_tokens
        self._drafts: dict[int, _Draft] = {}  # target seq_id -> its draft state
        # The draft's K/V of a sequence lives exactly as long as the target's.
        target_kv.add_free_listener(self.release)
        self.num_draft_tokens = 0  # tokens the draft computed (catch-up + proposal forwards)

    # -- the Proposer interface -------------------------------------------------------------------
    def accepts(self, seq: Sequence) -> bool:
        # A sampled grammar-constrained request: its proposals would be cut where the grammar
        # rejects them, and a cut that depends on the drawn token biases rejection sampling.
        return seq.grammar is None or seq.request.params.temperature < GREEDY_EPS

    def release(self, seq: Sequence) -> None:
        d = self._drafts.pop(seq.seq_id, None)
        if d is not None:
            self.kv.free(d.shadow)

    def synced(self, seq: Sequence) -> None:
        d = self._drafts.get(seq.seq_id)
        if d is not None:
            self._sync(seq, d)

    def propose(self, cands: list[tuple[Sequence, int]]) -> Proposals:
        tokens: list[list[int]] = [[] for _ in cands]
        probs: list[Optional[torch.Tensor]] = [None for _ in cands]
        known = set(self._drafts)  # drafts from earlier steps: only those can be forked this step
        active: list[tuple[int, Sequence, _Draft, int]] = []  # (cand index, seq, draft, k)
        for i, (seq, kk) in enumerate(cands):
            d = self._drafts.get(seq.seq_id)
            if d is None:
                d = self._start(seq, known)
                if d is None:
                    continue
            else:
                self._sync(seq, d)
            active.append((i, seq, d, kk))
        if not active:
            return Proposals(tokens, probs)

        # Catch up (chunked, within the step budget); the sequences brought up to date propose.
        budget = self.budget
        shares: list[ScheduledSeq] = []
        ready: list[tuple[int, Sequence, _Draft, int]] = []
        for i, seq, d, kk in active:
            sh = d.shadow
            pending = sh.num_tokens - sh.num_computed_tokens
            n = min(pending, budget)
            if n <= 0:
                continue
            copies = self.kv.allocate(sh, n)
            if copies is None:  # the draft's pool is short: no proposal for it this step
                continue
            self.kv.register_full_blocks(sh, n)  # catch-up tokens are verified ones
            shares.append(ScheduledSeq(sh, n, copies))
            budget -= n
            if n == pending:
                ready.append((i, seq, d, kk))
        if not shares:
            return Proposals(tokens, probs)
        logits = self._forward(shares)
        # Rows come for the shares that reach their last token: exactly `ready`, in order.
        live: list[tuple[int, Sequence, _Draft, int]] = []
        q_rows: dict[int, list[torch.Tensor]] = {}
        for (i, seq, d, kk), row in zip(ready, self._draw(logits, [s for _, s, _, _ in ready])):
            tok, q = row
            tokens[i].append(tok)
            if q is not None:
                q_rows[i] = [q]
            d.shadow.token_ids.append(tok)
            if kk > 1:
                live.append((i, seq, d, kk))
        # k - 1 more forwards: each feeds the latest proposal and draws the next.
        while live:
            shares = []
            fed: list[tuple[int, Sequence, _Draft, int]] = []
            for i, seq, d, kk in live:
                sh = d.shadow
                copies = self.kv.allocate(sh, 1)
                if copies is None:
                    continue
                shares.append(ScheduledSeq(sh, 1, copies))
                fed.append((i, seq, d, kk))
            if not shares:
                break
            logits = self._forward(shares)
            live = []
            for (i, seq, d, kk), (tok, q) in zip(fed, self._draw(logits, [s for _, s, _, _ in fed])):
                tokens[i].append(tok)
                if q is not None:
                    q_rows[i].append(q)
                d.shadow.token_ids.append(tok)
                if len(tokens[i]) < kk:
                    live.append((i, seq, d, kk))
        for i, rows in q_rows.items():
            probs[i] = torch.stack(rows)
        return Proposals(tokens, probs)

    # -- internals --------------------------------------------------------------------------------
    def _forward(self, shares: list[ScheduledSeq]) -> torch.Tensor:
        """One flat draft forward; advances each shadow's computed count. Returns the logits rows
        of the shares that reach their shadow's last token, in order."""
        logits = self.runner.execute(SchedulerOutput(shares, []))
        for s in shares:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.num_draft_tokens += s.num_new_tokens
        return logits

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, Optional[torch.Tensor]]]:
        """The next proposal of each sequence from its draft logits row: argmax for greedy
        requests, else a draw from q (returned with it)."""
        out: list[tuple[int, Optional[torch.Tensor]]] = []
        if not seqs:
            return out
        greedy = [s.request.params.temperature < GREEDY_EPS for s in seqs]
        argmax = logits.argmax(dim=-1).tolist()
        sampled = [j for j, g in enumerate(greedy) if not g]
        q_all: Optional[torch.Tensor] = None
        if sampled:
            x = logits.index_select(0, torch.tensor(sampled, dtype=torch.int64, device=logits.device)).float()
            params = [seqs[j].request.params for j in sampled]
            batch = SamplingBatch.build(
                params=params, generators=[None] * len(params), output_token_ids=[[] for _ in params],
                prompt_token_ids=[[] for _ in params], blocked_token_ids=None, vocab_size=x.shape[-1],
                device=x.device,
            )
            q_all = sampling_probs(x, batch).contiguous()
        pos = {j: r for r, j in enumerate(sampled)}
        for j, seq in enumerate(seqs):
            if greedy[j] or q_all is None:
                out.append((argmax[j], None))
                continue
            q = q_all[pos[j]]
            gen = seq.generator
            tok = int(torch.multinomial(q, 1, generator=gen).item()) if gen is not None else int(
                torch.multinomial(q, 1).item())
            out.append((tok, q))
        return out

    def _start(self, seq: Sequence, known: set[int]) -> Optional[_Draft]:
        """A sequence's first draft state: a fork of sample 0's draft (n > 1) once that exists,
        else a fresh shadow that attaches the draft's cached prefix. None: not this step (sample 0's
        draft is being built in this same step)."""
        req = seq.request
        parent = req.sequences[0] if seq.index > 0 else None
        shadow = Sequence(req, seq.index, [])
        if parent is not None:
            pd = self._drafts.get(parent.seq_id)
            if pd is None or parent.seq_id not in known:
                return None
            ps = pd.shadow
            common = 0
            limit = min(pd.verified, ps.num_computed_tokens, seq.num_tokens)
            while common < limit and ps.token_ids[common] == seq.token_ids[common]:
                common += 1
            shadow.token_ids = list(seq.token_ids)
            self.kv.fork(ps, shadow)
            shadow.num_computed_tokens = common
            self.kv.rollback(shadow)
        else:
            shadow.token_ids = list(seq.token_ids)
            shadow.num_computed_tokens = self.kv.match_prefix(shadow)
        d = _Draft(shadow, seq.num_tokens)
        self._drafts[seq.seq_id] = d
        return d

    def _sync(self, seq: Sequence, d: _Draft) -> None:
        """Keep the draft's K/V of the tokens it shares with the target's, drop the rest (the
        rejected proposals), and append the target's newer verified tokens."""
        sh = d.shadow
        common = min(d.verified, sh.num_tokens, seq.num_tokens)
        limit = min(sh.num_tokens, seq.num_tokens)
        while common < limit and sh.token_ids[common] == seq.token_ids[common]:
            common += 1
        # Truncate the rejected tail, and register the full blocks of the verified tokens (the
        # proposal forwards never register: their tokens were unverified then).
        sh.num_computed_tokens = min(common, sh.num_computed_tokens)
        self.kv.rollback(sh)
        del sh.token_ids[common:]
        sh.token_ids.extend(seq.token_ids[common:])
        d.verified = seq.num_tokens
