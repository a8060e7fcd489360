"""The batch-invariance checker the determinism tests share: run one target request in many
situations and report every situation whose tokens or logprobs differ from the target run alone.

Situations (docs/determinism.md lists what each guarantees):
- "batch-N": among N other random requests (random prompt and output lengths, so the step's
  composition changes as they prefill and finish), the target at a random position;
- "prefix-hit": after a request sharing the target's first blocks filled the prefix cache;
- "budget-B": max_num_batched_tokens = B with a few other requests, so the target's prefill is
  chunked differently and shares steps with decodes;
- "preempted": the target is preempted by a higher-priority arrival and recomputed;
- "ngram-spec": n-gram speculation on (only for greedy targets).

Comparisons are exact: token ids and float logprobs (the chosen token's and its top alternatives').
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from server.engine.sampling_params import SamplingParams

# (token ids, [(logprob, top alternatives)]) of the target request.
Result = tuple[list[int], list[tuple[float, tuple[tuple[int, float], ...]]]]


@dataclass
class Situation:
    name: str
    config: dict[str, Any]
    others: int = 0
    shared_prefix: bool = False
    preempt: bool = False
    rounds: int = 1


@dataclass
class CheckReport:
    reference: Result
    mismatches: dict[str, str] = field(default_factory=dict)
    evidence: dict[str, int] = field(default_factory=dict)  # e.g. prefix hits, preemptions, drafts


def default_situations(greedy: bool, batch_sizes: tuple[int, ...] = (2, 7, 16, 64),
                       budgets: tuple[int, ...] = (16, 64, 512)) -> list[Situation]:
    out = [Situation(f"batch-{n}", {}, others=n) for n in batch_sizes]
    out.append(Situation("prefix-hit", {"enable_prefix_caching": True}, others=3, shared_prefix=True))
    out += [Situation(f"budget-{b}", {"max_num_batched_tokens": b}, others=5) for b in budgets]
    out.append(Situation("preempted", {"max_num_seqs": 2}, preempt=True))
    if greedy:
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
        out.append(Situation("ngram-spec", {"speculative_config": spec}, others=3))
    return out


class DeterminismChecker:
    """Runs a target (prompt, params) in each Situation on engines built from `base_config`."""

    def __init__(self, model_dir: Path, base_config: dict[str, Any], vocab_size: int, seed: int = 0) -> None:
        self.model_dir = model_dir
        self.base = {"max_model_len": 256, "kv_cache_tokens": 8192, "enable_prefix_caching": False, **base_config}
        self.vocab = vocab_size
        self.rng = random.Random(seed)

    def engine(self, **overrides: Any) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(self.model_dir), **{**self.base, **overrides}))

    def random_prompt(self, lo: int, hi: int) -> list[int]:
        return [self.rng.randrange(4, self.vocab) for _ in range(self.rng.randint(lo, hi))]

    def _other_params(self, target: SamplingParams) -> SamplingParams:
        # Others mix greedy and sampled rows, with and without logprobs, so the sampler's batched
        # paths (top-p sort, logprobs) run over rows that differ from the target's.
        kind = self.rng.randrange(3)
        n = self.rng.randint(1, 6)
        if kind == 0:
            return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        if kind == 1:
            return SamplingParams(temperature=1.0, top_p=0.7, top_k=20, max_tokens=n, ignore_eos=True, logprobs=2)
        return SamplingParams(temperature=0.8, top_p=0.9, seed=self.rng.randrange(1 << 30), max_tokens=n,
                              ignore_eos=True)

    @staticmethod
    def _collect(engine: LLMEngine, target_id: str, steps_before: Optional[int] = None) -> Result:
        tokens: list[int] = []
        lps: list[tuple[float, tuple[tuple[int, float], ...]]] = []
        while engine.has_unfinished_requests():
            for d in engine.step():
                if d.request_id != target_id:
                    continue
                assert d.error is None, d.error
                s = d.samples[0]
                tokens.extend(s.token_ids)
                for lp in s.logprobs or []:
                    lps.append((lp.logprob, tuple(lp.top)))
        return tokens, lps

    def run_alone(self, prompt: list[int], params: SamplingParams) -> Result:
        engine = self.engine()
        engine.add_request("target", prompt, params)
        return self._collect(engine, "target")

    def run(self, sit: Situation, prompt: list[int], params: SamplingParams, evidence: dict[str, int]) -> Result:
        engine = self.engine(**sit.config)
        if sit.shared_prefix:
            # Two full blocks of the target's prompt (block_size 16) land in the cache first.
            warm = prompt[:32] + self.random_prompt(5, 10)
            engine.add_request("warm", warm, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
            self._collect(engine, "warm")
        if sit.preempt:
            # max_num_seqs = 2: the target and a filler run, then an urgent arrival preempts the
            # latest-arrived lowest-priority sequence, the target, which recomputes later.
            filler = SamplingParams(temperature=0.0, max_tokens=params.max_tokens or 16, ignore_eos=True)
            engine.add_request("filler", self.random_prompt(10, 20), filler, priority=5)
            engine.add_request("target", prompt, params, priority=5)
            before: list[int] = []
            befores: list[tuple[float, tuple[tuple[int, float], ...]]] = []
            for _ in range(3):
                for d in engine.step():
                    if d.request_id == "target":
                        before.extend(d.samples[0].token_ids)
                        befores.extend((lp.logprob, tuple(lp.top)) for lp in d.samples[0].logprobs or [])
            engine.add_request("urgent", self.random_prompt(10, 20), filler, priority=0)
            preempted_before = engine.scheduler.num_preemptions
            engine.step()
            running = {s.request.request_id for s in engine.scheduler.running}
            assert "target" not in running and engine.scheduler.num_preemptions > preempted_before, (
                "the preemption situation did not preempt the target")
            evidence["preemptions"] = evidence.get("preemptions", 0) + 1
            tokens, lps = self._collect(engine, "target")
            return before + tokens, befores + lps
        n = sit.others
        pos = self.rng.randint(0, n)
        for i in range(n + 1):
            if i == pos:
                engine.add_request("target", prompt, params)
            else:
                p = self.random_prompt(3, 60)
                if sit.shared_prefix:
                    p = prompt[: self.rng.randint(0, 40)] + p
                engine.add_request(f"o{i}", p, self._other_params(params))
        result = self._collect(engine, "target")
        if sit.shared_prefix:
            evidence["prefix_hit_tokens"] = evidence.get("prefix_hit_tokens", 0) + engine.stats().prefix_hit_tokens
        if engine.spec is not None:
            evidence["spec_proposed"] = evidence.get("spec_proposed", 0) + engine.spec.stats.num_proposed
        return result

    def check(self, prompt: list[int], params: SamplingParams, situations: list[Situation]) -> CheckReport:
        report = CheckReport(reference=self.run_alone(prompt, params))
        ref_tokens, ref_lps = report.reference
        for sit in situations:
            tokens, lps = self.run(sit, prompt, params, report.evidence)
            if tokens != ref_tokens:
                first = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
                report.mismatches[sit.name] = f"tokens differ from position {first}"
            elif lps != ref_lps:
                first = next((i for i, (a, b) in enumerate(zip(lps, ref_lps)) if a != b), len(lps))
                report.mismatches[sit.name] = f"logprobs differ from position {first}"
        return report
