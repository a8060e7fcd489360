"""LLM: the offline batch API, shaped like vLLM's (`LLM(model).generate(prompts, params)` and
`LLM(model).chat(messages, params)`).

It drives an LLMEngine on the caller's thread: submit everything, step until done, collect. With no
sampling params given it uses the model's own defaults (generation_config.json or GGUF metadata),
as vLLM does.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

from server.engine.config import EngineConfig
from server.engine.outputs import CompletionOutput, RequestDelta, RequestOutput, fold_delta
from server.engine.sampling_params import EmbeddingParams, SamplingParams

if TYPE_CHECKING:
    from server.chat_reading import ChatReader

PromptType = Union[str, Sequence[int]]
Conversation = Sequence[Mapping[str, Any]]


class LLM:
    """Offline generation.

    Example:
        >>> llm = LLM("path/to/hf-model", dtype="bfloat16", max_model_len=2048)
        >>> out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
        >>> out[0].outputs[0].text

    Args: `model` is a Hugging Face model folder or a .gguf file; every other keyword is an EngineConfig field
    (dtype, max_model_len, kv_cache_tokens, kv_cache_memory_gb, block_size, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, num_threads, seed, quantization, speculative_config:
    e.g. {"method": "ngram", "num_speculative_tokens": 4}, see docs/speculative_decoding.md;
    deterministic=True/False: batch-invariant results, default None = on where cheap, see
    docs/determinism.md; autotune=True/False: time linear's paths per weight shape at start-up,
    default None = on for CPU; lora_modules={"name": "path/to/peft-adapter"}: LoRA adapters that
    generate's `lora` selects, per prompt).
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        from server.engine.engine import LLMEngine

        unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s): {', '.join(sorted(unknown))}")
        self.config = EngineConfig(model=str(model), **kwargs)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()
        from server.models.generation_defaults import generation_defaults

        self.sampling_defaults: dict[str, Any] = generation_defaults(self.config.model)
        self._reader: Optional["ChatReader"] = None  # built on the first chat()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's suggested values (generation_config.json / GGUF
        general.sampling.*) over pagewire's defaults; what generate() and chat() use when given none."""
        return SamplingParams(**self.sampling_defaults)

    def chat(
        self,
        messages: Union[Conversation, Sequence[Conversation]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        use_tqdm: bool = False,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict[str, Any]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a batch of them, as vLLM's `LLM.chat`.

        Args:
            messages: [{"role", "content"}, ...], or a list of such conversations.
            sampling_params: one for all, or one per conversation; default: the model's defaults.
            chat_template: a template source (or the name of one of the model's templates).
            add_generation_prompt: end the prompt with the assistant header so the model replies.
            continue_final_message: leave the last (assistant) message open so the model continues
                it; exclusive with add_generation_prompt.
            tools: tool definitions passed to the template; with a tool-call format detected from the
                template (harmony, Hermes, Llama 3 JSON), each output's `tool_calls` holds the calls
                (`tool_choice: auto`).
            chat_template_kwargs: extra template variables (e.g. {"enable_thinking": False}).
        Returns:
            One RequestOutput per conversation, in order; `prompt` is the rendered template text.
            Each output's `text` is the raw reply; `reasoning_content`, `content` and `tool_calls`
            are what the chat APIs read from it (server.chat_reading).
        Raises:
            ValueError naming the argument; ChatTemplateError when the template rejects a conversation.
        """
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=True")
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
            raise ValueError("messages: must be a non-empty list of messages or of conversations")
        batch = isinstance(messages[0], Sequence) and not isinstance(messages[0], (str, bytes, Mapping))
        conversations: list[Any] = list(messages) if batch else [messages]
        tok = self.engine.tokenizer
        texts: list[str] = []
        for i, conv in enumerate(conversations):
            if not conv or not all(isinstance(m, Mapping) for m in conv):
                raise ValueError(f"messages[{i}]: must be a non-empty list of message objects")
            msgs: list[dict[str, Any]] = [dict(m) for m in conv]
            text = tok.apply_chat_template(
                msgs, add_generation_prompt=add_generation_prompt, tools=tools,
                chat_template=chat_template, **(chat_template_kwargs or {}),
            )
            if continue_final_message:
                text = _open_final_message(text, msgs, i)
            texts.append(text)
        # Templates write BOS and the turn markers themselves; encoding must not add them again.
        prompts: list[tuple[Optional[str], list[int]]] = [(t, tok.encode(t, add_special_tokens=False)) for t in texts]
        # The reply is read as the chat APIs read it (server.chat_reading): reasoning, content and
        # tool calls beside the raw text.
        if self._reader is None:
            from server.chat_reading import ChatReader

            self._reader = ChatReader(tok)
        plan = self._reader.plan(tools)
        params = [self._reader.prepare(sp, ids, plan)
                  for sp, (_, ids) in zip(self._params_list(sampling_params, len(prompts)), prompts)]
        outs = self._run(prompts, params, use_tqdm, None)
        for out in outs:
            for o in out.outputs:
                o.reasoning_content, o.content, o.tool_calls = self._reader.read(
                    o.text, o.token_ids, out.prompt_token_ids, plan, out.request_id, o.index)
        return outs

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        use_tqdm: bool = False,
        priority: Optional[Sequence[int]] = None,
        lora: Union[None, str, Sequence[Optional[str]]] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); outputs keep input order.
        lora: a LoRA adapter's name (of lora_modules) for every prompt, or one per prompt (None:
        the base model)."""
        items: list[Any]
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            items = [prompts]
        else:
            items = list(prompts)
        tok = self.engine.tokenizer
        staged: list[tuple[Optional[str], list[int]]] = [
            (p, tok.encode(p)) if isinstance(p, str) else (None, list(p)) for p in items
        ]
        return self._run(staged, sampling_params, use_tqdm, priority, lora)

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        dimensions: Optional[int] = None,
    ) -> list[RequestOutput]:
        """Embed every prompt (a string or a list of token ids) with an embedding model (served
        with task "embed", or a folder with a pooling config: server.models.pooling); each
        output's `embedding` is its vector. Outputs keep input order."""
        items: list[Any]
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            items = [prompts]
        else:
            items = list(prompts)
        tok = self.engine.tokenizer
        staged: list[tuple[Optional[str], list[int]]] = [
            (p, tok.encode(p)) if isinstance(p, str) else (None, list(p)) for p in items
        ]
        # One "output token" bounds the context check; nothing is sampled.
        params = SamplingParams(max_tokens=1, embedding=EmbeddingParams(dimensions))
        return self._run(staged, params, False, None)

    def _params_list(self, sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]],
                     n: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params_list = list(sampling_params)
        if len(params_list) != n:
            raise ValueError(f"sampling_params: got {len(params_list)} for {n} prompts")
        return params_list

    def _run(
        self,
        prompts: list[tuple[Optional[str], list[int]]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]],
        use_tqdm: bool,
        priority: Optional[Sequence[int]],
        lora: Union[None, str, Sequence[Optional[str]]] = None,
    ) -> list[RequestOutput]:
        """Queue every (text, token ids) prompt, step the engine until all finish, keep input order."""
        params_list = self._params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} values for {len(prompts)} prompts")
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"lora: got {len(loras)} names for {len(prompts)} prompts")

        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        # Everything is tokenised before anything is queued, so a bad prompt fails fast.
        staged = [(text, ids, sp, priority[i] if priority is not None else 0, loras[i])
                  for i, ((text, ids), sp) in enumerate(zip(prompts, params_list))]
        try:
            for text, ids, sp, prio, name in staged:
                rid = str(next(self._ids))
                self.engine.add_request(rid, ids, sp, priority=prio, lora=name)
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
        # The step's thread modes held across the steps, as the engine thread holds them: each
        # step then enters nothing (LLMEngine.step_modes).
        with self.engine.step_modes():
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


def _open_final_message(text: str, messages: list[dict[str, Any]], index: int) -> str:
    """`prompts.open_final_message`, its refusal a ValueError naming the conversation."""
    from server.serving.prompts import open_final_message
    from server.text.tokenizer import ChatTemplateError

    try:
        return open_final_message(text, messages)
    except ChatTemplateError as e:
        raise ValueError(f"messages[{index}]: {e}") from None


def _apply(out: RequestOutput, delta: RequestDelta) -> None:
    out.num_cached_tokens = delta.num_cached_tokens
    fold_delta(out.outputs, delta.samples)
    if delta.error is not None:
        raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
    out.finished = delta.finished
    if delta.embedding is not None:
        out.embedding = delta.embedding
