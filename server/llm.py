"""LLM: the offline batch API, shaped like vLLM's (`LLM(model).generate(prompts, params)`).

It drives an LLMEngine on the caller's thread: submit everything, step until done, collect.
"""
from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence, Union, cast

from server.engine.config import EngineConfig
from server.engine.outputs import CompletionOutput, RequestDelta, RequestOutput, fold_delta
from server.engine.sampling_params import SamplingParams

PromptType = Union[str, Sequence[int]]


class LLM:
    """Offline generation.

    Example:
        >>> llm = LLM("path/to/hf-model", dtype="bfloat16", max_model_len=2048)
        >>> out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
        >>> out[0].outputs[0].text

    Args: `model` is a Hugging Face model folder; every other keyword is an EngineConfig field
    (dtype, max_model_len, kv_cache_tokens, kv_cache_memory_gb, block_size, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, num_threads, seed, quantization).
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        from server.engine.engine import LLMEngine

        unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s): {', '.join(sorted(unknown))}")
        self.config = EngineConfig(model=str(model), **kwargs)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        use_tqdm: bool = False,
        priority: Optional[Sequence[int]] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); outputs keep input order."""
        prompt_list: list[PromptType]
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompt_list = [cast(PromptType, prompts)]  # one prompt: a str or token ids
        else:
            prompt_list = list(cast(Sequence[PromptType], prompts))
        prompts = prompt_list
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} for {len(prompts)} prompts"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} values for {len(prompts)} prompts")

        tok = self.engine.tokenizer
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        # Tokenise and validate everything before queueing anything, so a bad prompt fails fast.
        staged = []
        for i, (p, sp) in enumerate(zip(prompt_list, params_list)):
            text = p if isinstance(p, str) else None
            ids: list[int] = tok.encode(p) if isinstance(p, str) else [int(t) for t in p]
            staged.append((text, ids, sp, priority[i] if priority is not None else 0))
        try:
            for text, ids, sp, prio in staged:
                rid = str(next(self._ids))
                self.engine.add_request(rid, ids, sp, priority=prio)
                order.append(rid)
                results[rid] = RequestOutput(rid, text, ids, [
                    CompletionOutput(i, "", [], None, logprobs=[] if sp.logprobs is not None else None)
                    for i in range(sp.n)
                ], finished=False)
        except Exception:
            for rid in order:
                self.engine.abort_request(rid)
            self.engine.step()
            raise

        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="generate", unit="req")
        while self.engine.has_unfinished_requests():
            deltas = self.engine.step()
            if not self.engine.last_step_progressed:
                # add_request refuses what can never run, so this is an engine bug; fail loudly
                # rather than spin through empty steps.
                self.engine.abort_all()
                raise RuntimeError("engine made no progress with requests pending; aborted them")
            for delta in deltas:
                if delta.request_id in results:
                    _apply(results[delta.request_id], delta)
                    if delta.finished and bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[r] for r in order]


def _apply(out: RequestOutput, delta: RequestDelta) -> None:
    out.num_cached_tokens = delta.num_cached_tokens
    fold_delta(out.outputs, delta.samples)
    if delta.error is not None:
        raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
    out.finished = delta.finished
