"""Prompt preparation for admission: chat template, tokenisation (off the loop when long), the
context-length check, and the final SamplingParams.

Long prompts are a way for one client to stall everyone (issue 29: two 7.5 MB prompts pushed
/health to 10.9 s; sixteen made the server unresponsive for minutes). Three defences, in order:

* **A cheap length bound first.** A prompt whose character count alone proves that it cannot fit
  `max_model_len` (at most `Tokenizer.max_chars_per_token` characters per token) is refused with
  `context_length_exceeded` before any tokenising: no multi-megabyte prompt is tokenised only to
  be refused.
* **Off the loop, without the GIL.** Prompts above `offload_chars` are tokenised on their own
  daemon thread, through the tokenizers library's batch path, which releases the GIL (its plain
  `encode` holds it, so a thread alone did not free the loop). Daemon threads: a shutdown does
  not wait for a tokenisation nobody will use.
* **A bound on the work in flight.** `TokenizeBudget`: characters being tokenised off the loop,
  per client (the admission fairness key: the API key, else the peer) and in total; beyond it a
  request gets 429 `tokenizer_busy` with a retry-after. Each thread's characters are returned
  when the thread ends, not when its caller gives up.

After a large tokenisation, once nothing is being tokenised, freed memory is handed back to the
OS (`heap.trim`). Short prompts stay on the loop, where a thread hop would cost more than the work.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any, Callable, Optional, TypeVar

from server import heap
from server.engine.errors import RequestTooLongError, check_context
from server.engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from server.serving.errors import InvalidRequest, Overloaded
from server.serving.grammar_worker import GrammarWorker
from server.serving.jobs import GenerationSpec
from server.serving.tool_render import fit_to_template
from server.serving.truncation import truncate_ids, truncation_limit
from server.text.tokenizer import ChatTemplateError, Tokenizer
from server.text.vocab import TokenIdError, check_token_ids

log = logging.getLogger("pagewire")
T = TypeVar("T")

# After a tokenisation of at least this many characters, trim the heap once the tokenizer is idle.
TRIM_AFTER_CHARS = 1 << 20


def _content_chars(messages: list[dict[str, Any]]) -> int:
    n = 0
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            n += len(c)
        elif isinstance(c, list):
            n += sum(len(p.get("text") or "") for p in c if isinstance(p, dict))
    return n


# Template variables a request's `chat_template_kwargs` may not set: the renderer's own.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                    "unk_token", "pad_token"})


def check_template_kwargs(kwargs: Any, field: str = "chat_template_kwargs") -> dict[str, Any]:
    """A request's extra chat-template variables (e.g. {"enable_thinking": false}); InvalidRequest
    naming the field for anything but an object of plain names."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest(f"{field}: must be an object", param=field)
    for k in kwargs:
        if not isinstance(k, str) or not k.isidentifier():
            raise InvalidRequest(f"{field}: {k!r} is not a template variable name", param=field)
        if k in RESERVED_TEMPLATE_VARS:
            raise InvalidRequest(f"{field}.{k}: set by the server, not by the request", param=f"{field}.{k}")
    return dict(kwargs)


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: Optional[list[dict[str, Any]]] = None, tool_format: str = "none",
                template_kwargs: Optional[dict[str, Any]] = None, continue_final_message: bool = False) -> str:
    """A conversation's prompt text (ChatTemplateError if the template fails). Tool parts go to
    the template as transformers passes them; a template that lacks a tool feature gets them
    rewritten into plain messages (server.serving.tool_render). `template_kwargs` are extra
    template variables (`chat_template_kwargs`). `continue_final_message` leaves the last
    (assistant) message open, so the model continues it (`open_final_message`)."""
    if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        source = tokenizer.template_source(tools)
        messages, tools = fit_to_template(messages, tools, source, tool_format)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt and not
                                         continue_final_message, tools=tools or None, **(template_kwargs or {}))
    return open_final_message(text, messages) if continue_final_message else text


def open_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """Cut the rendered prompt right after the final message's content, dropping the turn end the
    template wrote, so generation continues that message (transformers' continue_final_message:
    Anthropic's prefill, vLLM's `continue_final_message`). ChatTemplateError when the final
    message has no text, or the template does not write it verbatim."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message needs a final message with text content")
    at = text.rfind(content.strip())
    if at < 0:
        raise ChatTemplateError("the chat template does not reproduce the final message's content, so it "
                                "cannot be continued")
    return text[: at + len(content.strip())]


class TokenizeBudget:
    """Characters being tokenised off the loop, per client and in total (event loop only)."""

    def __init__(self, per_client: int, total: int) -> None:
        self.per_client = per_client
        self.total = total
        self.in_flight = 0
        self._by_client: dict[str, int] = {}

    def take(self, client: str, chars: int) -> None:
        """Reserve `chars` for `client` or raise Overloaded (429). One prompt larger than the
        per-client bound is still let through when the client has nothing in flight (the body
        limit already bounds it), so no valid prompt is refused for good."""
        mine = self._by_client.get(client, 0)
        if mine and mine + chars > self.per_client or self.in_flight and self.in_flight + chars > self.total:
            raise Overloaded(
                f"too much prompt text is being tokenised ({mine} characters for this client, "
                f"{self.in_flight} in all); retry once earlier requests are admitted",
                code="tokenizer_busy", retry_after_s=1.0)
        self._by_client[client] = mine + chars
        self.in_flight += chars

    def give(self, client: str, chars: int) -> None:
        left = self._by_client.get(client, 0) - chars
        if left > 0:
            self._by_client[client] = left
        else:
            self._by_client.pop(client, None)
        self.in_flight -= chars


def _with_field(exc: SamplingParamsError, spec: GenerationSpec) -> InvalidRequest:
    name = spec.max_tokens_field if exc.field == "max_tokens" else spec.field_names.get(exc.field, exc.field)
    return InvalidRequest(f"{name}: {exc.message}", param=name)


class PromptPreparer:
    """Turns a spec into (prompt token ids, SamplingParams), or raises InvalidRequest naming the field."""

    def __init__(
        self, tokenizer: Tokenizer, offload_chars: int = 2048, sampling_defaults: Optional[dict[str, Any]] = None,
        budget: Optional[TokenizeBudget] = None, grammar_timeout_s: float = 10.0,
    ) -> None:
        """sampling_defaults: the model's suggested SamplingParams values (generation_config.json or
        GGUF metadata), used for every field a request leaves unset, as vLLM does. budget: the
        bound on characters tokenised off the loop (default: 8 M per client, 32 M in all)."""
        self.tokenizer = tokenizer
        self.offload_chars = offload_chars
        self.budget = budget or TokenizeBudget(8 << 20, 32 << 20)
        self.chars_per_token = tokenizer.max_chars_per_token()
        self._peak = 0  # the largest tokenisation since the last trim
        self._waits: set[asyncio.Future[Any]] = set()  # callers awaiting a tokenising thread
        defaults = dict(sampling_defaults or {})
        self.default_max_tokens: Optional[int] = defaults.pop("max_tokens", None)
        self.sampling_defaults = defaults
        self._grammar_compiler: Any = None  # server.engine.grammar.GrammarCompiler, on first use
        self._grammar_worker = GrammarWorker()
        self.grammar_timeout_s = grammar_timeout_s

    def tokenizer_has_special(self, *token_ids: int) -> bool:
        """Whether any of these ids is a special token (which decoding would drop)."""
        special = set(self.tokenizer.all_special_ids)
        return any(t in special for t in token_ids)

    def _sampling(self, spec: GenerationSpec) -> dict[str, Any]:
        return {**self.sampling_defaults, **spec.sampling}

    def check_sampling(self, spec: GenerationSpec) -> SamplingParams:
        """Validate the sampling fields before any tokenising work (max_tokens set later)."""
        try:
            params = SamplingParams(max_tokens=spec.max_tokens or 1, **self._sampling(spec))
        except SamplingParamsError as e:
            raise _with_field(e, spec) from None
        except TypeError as e:  # an unexpected keyword: a programming error at the edge
            raise InvalidRequest(str(e)) from None
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:  # it could never be produced, so the stop would silently never fire
            name = "params.stop_token_ids" if spec.api == "ws" else "stop_token_ids"
            raise InvalidRequest(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})", param=name)
        return params

    async def compile_structured(self, params: SamplingParams, spec: GenerationSpec) -> None:
        """Compile the request's grammar (structured outputs) now, at admission, so that a
        schema llguidance cannot compile is a 400 naming the field, and the engine thread only
        ever copies compiled grammars. A cache hit stays on the loop; a compile (and the first
        use's tokenizer conversion) runs on the grammar worker's low-priority thread, within
        `grammar_timeout_s` (server.serving.grammar_worker)."""
        so = params.structured_outputs
        if so is None or isinstance(so, dict):
            return
        if self._grammar_compiler is not None:
            hit = self._grammar_compiler.lookup(so)
            if hit is not None:
                so.compiled = hit
                return
        fut = self._grammar_worker.submit(lambda: self._compile(so))
        try:
            await asyncio.wait_for(asyncio.wrap_future(fut), self.grammar_timeout_s)
        except SamplingParamsError as e:  # GrammarError: the field and llguidance's reason
            raise _with_field(e, spec) from None
        except asyncio.TimeoutError:
            fut.cancel()  # dropped if it had not started; else it finishes and is cached
            raise _with_field(SamplingParamsError(
                f"structured_outputs.{so.kind}",
                f"the constraint did not compile within {self.grammar_timeout_s:g}s (it is too large, or the "
                "grammar compiler is busy with others); simplify it or retry later"), spec) from None

    def _compile(self, so: StructuredOutputsParams) -> None:
        from server.engine.grammar import compile_params, compiler_for

        self._grammar_compiler = compiler_for(self.tokenizer)
        compile_params(self.tokenizer, so)

    async def _run(self, client: str, chars: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`: on the loop when short, else on a daemon thread within the budget."""
        if chars <= self.offload_chars:
            return fn(*args)
        self.budget.take(client, chars)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def ended(result: Any, exc: Optional[BaseException]) -> None:  # on the loop
            self.budget.give(client, chars)
            self._peak = max(self._peak, chars)
            if self.budget.in_flight == 0 and self._peak >= TRIM_AFTER_CHARS:
                self._peak = 0
                threading.Thread(target=heap.trim, name="pagewire-trim", daemon=True).start()
            if fut.done():  # the caller went away
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        def work() -> None:
            result: Any = None
            exc: Optional[BaseException] = None
            try:
                result = fn(*args)
            except BaseException as e:  # handed to the awaiting task
                exc = e
            try:
                loop.call_soon_threadsafe(ended, result, exc)
            except RuntimeError:  # the loop has closed: the server is exiting
                pass

        threading.Thread(target=work, name="pagewire-tokenize", daemon=True).start()
        self._waits.add(fut)
        try:
            return await fut
        finally:
            self._waits.discard(fut)

    def abort_waits(self, exc: BaseException) -> None:
        """Fail every caller still waiting for a tokenising thread with `exc` (shutdown). The
        threads themselves run on as daemons; their characters return to the budget as they end."""
        for fut in list(self._waits):
            if not fut.done():
                fut.set_exception(exc)

    def check_fits(self, chars: int, field: str, max_model_len: Optional[int]) -> None:
        """Refuse, before tokenising, a prompt of `chars` characters that cannot fit the context
        (see the module docstring). Exact for what it refuses: it needs more than max_model_len
        tokens whatever they are."""
        per = self.chars_per_token
        if per is None or not max_model_len:
            return
        at_least = chars // per
        if at_least >= max_model_len:
            raise InvalidRequest(
                f"{field}: the prompt is {chars} characters, so at least {at_least} tokens, which does not fit "
                f"this model's maximum context length of {max_model_len} tokens (at least one output token "
                "is needed)", param=field, code="context_length_exceeded")

    async def encode_text(self, text: str, client: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (/tokenize), off the loop and within the budget when long."""
        return await self._run(client, len(text), self.tokenizer.encode, text, add_special_tokens)

    def _render_chat(self, spec: GenerationSpec) -> list[int]:
        text = render_chat(self.tokenizer, spec.messages or [], spec.add_generation_prompt, spec.tools,
                           spec.tool_format, spec.chat_template_kwargs, spec.continue_final_message)
        # Templates add BOS themselves; adding special tokens again would double it.
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def token_ids(self, spec: GenerationSpec, max_model_len: Optional[int] = None) -> list[int]:
        """The prompt's token ids; with `max_model_len`, a prompt that cannot fit it is refused
        before it is tokenised (`check_fits`)."""
        if spec.kind == "chat":
            if not spec.messages:
                raise InvalidRequest(f"{spec.messages_field}: must be a non-empty list", param=spec.messages_field)
            content = _content_chars(spec.messages)
            self.check_fits(content, spec.messages_field, max_model_len)
            tools_chars = len(json.dumps(spec.tools)) if spec.tools else 0
            try:
                ids: list[int] = await self._run(spec.client, content + tools_chars, self._render_chat, spec)
            except ChatTemplateError as e:
                raise InvalidRequest(f"{spec.messages_field}: {e}", param=spec.messages_field) from None
            field = spec.messages_field
        elif isinstance(spec.prompt, list):
            field = spec.prompt_field
            ids = list(spec.prompt)
            try:
                check_token_ids(ids, self.tokenizer.vocab_size, field)
            except TokenIdError as e:
                raise InvalidRequest(str(e), param=field) from None
            if spec.truncate is not None and max_model_len:  # token ids are all the input's own
                ids = truncate_ids(ids, truncation_limit(spec.truncate, max_model_len), spec.truncate.keep_end,
                                   field=field)
        elif isinstance(spec.prompt, str):
            field = spec.prompt_field
            if spec.truncate is None:
                self.check_fits(len(spec.prompt), field, max_model_len)
            # A truncated input is tokenised whole (within the tokenize budget, and the body limit
            # bounds it): cutting the text first could change the tokens at the cut.
            ids = await self._run(spec.client, len(spec.prompt), self.tokenizer.encode, spec.prompt)
            if spec.truncate is not None and max_model_len and ids:
                lead, trail = self.tokenizer.special_ends()
                ids = truncate_ids(ids, truncation_limit(spec.truncate, max_model_len), spec.truncate.keep_end,
                                   lead, trail, field)
        else:
            raise InvalidRequest(f"{spec.prompt_field}: is required", param=spec.prompt_field)
        if not ids:
            raise InvalidRequest(f"{field}: must not be empty", param=field)
        return ids

    def finalize(self, spec: GenerationSpec, n_prompt: int, max_model_len: int) -> SamplingParams:
        """The context check (the engine's own `check_context`; both numbers in the message, never
        truncation) and the final params."""
        field = spec.messages_field if spec.kind == "chat" else spec.prompt_field
        room = max_model_len - n_prompt
        max_tokens: Optional[int] = spec.max_tokens
        try:
            check_context(n_prompt, max_tokens, max_model_len)
        except RequestTooLongError as e:
            raise _context_error(e, field, spec.max_tokens_field) from None
        if max_tokens is None:
            default = spec.default_max_tokens if spec.default_max_tokens is not None else self.default_max_tokens
            max_tokens = room if default is None else min(default, room)
        try:
            return SamplingParams(max_tokens=max_tokens, **self._sampling(spec))
        except SamplingParamsError as e:
            raise _with_field(e, spec) from None


def _context_error(e: RequestTooLongError, prompt_field: str, max_tokens_field: str) -> InvalidRequest:
    """The engine's refusal, worded with the edge's field names (`messages`, `params.max_tokens`)."""
    n, limit = e.num_prompt_tokens, e.max_model_len
    if e.max_tokens is None or n >= limit:
        return InvalidRequest(
            f"{prompt_field}: the prompt is {n} tokens, which does not fit this model's maximum "
            f"context length of {limit} tokens (at least one output token is needed)",
            param=prompt_field, code="context_length_exceeded",
        )
    return InvalidRequest(
        f"{max_tokens_field}: this model's maximum context length is {limit} tokens, but "
        f"{n + e.max_tokens} were requested ({n} in the prompt + {e.max_tokens} for the completion); "
        f"reduce {max_tokens_field} to at most {limit - n}",
        param=max_tokens_field, code="context_length_exceeded",
    )
