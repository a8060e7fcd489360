"""ModelLane: one declared model's serving parts, loaded or not.

What every model has from start-up on, torch-free: its tokenizer and prompt preparer, its
sampling defaults, reasoning parser and pooling recipe (what requests need to be checked,
tokenised and committed before the weights exist), its footprint in the memory budget (weights,
activations and KV pool, from `pagewire plan`'s arithmetic on its config) and its own admission
queue, paused while the model is not loaded, so a request for an unloaded model is accepted and
waits there while the model pool loads it (server.serving.model_pool).

What exists only while loaded: its EngineBridge (one engine thread, one KV pool).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from server.engine.plan import make_plan, read_model_config
from server.models.generation_defaults import generation_defaults
from server.models.load_progress import LoadProgress
from server.models.pooling import Pooler, resolve_pooler
from server.serving.admission import AdmissionQueue
from server.serving.bridge import EngineBridge
from server.serving.model_catalog import ModelEntry
from server.serving.prompts import PromptPreparer
from server.serving.settings import ServeSettings
from server.strenum import StrEnum
from server.text.loader import load_tokenizer
from server.text.reasoning import ReasoningFormat, detect_reasoning_parser, reasoning_format
from server.text.tokenizer import ChatTemplateError, Tokenizer

log = logging.getLogger("pagewire")


def _encoder(tokenizer: Tokenizer) -> Callable[[str], list[int]]:
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def pick_reasoning_format(tokenizer: Tokenizer, name: str) -> Optional[ReasoningFormat]:
    """The reasoning parser (`--reasoning-parser`): the one named, or with `auto` the one the chat
    template implies. A named parser whose tags are not single tokens is a start-up error (a
    ValueError naming the option); `auto` then serves without one."""
    if name == "none":
        return None
    if name == "auto":
        try:
            source: Optional[str] = tokenizer.template_source()
        except ChatTemplateError:
            source = None
        detected = detect_reasoning_parser(source)
        if detected is None:
            return None
        try:
            fmt = reasoning_format(detected, tokenizer.token_to_id, _encoder(tokenizer))
        except ValueError as e:
            log.info("reasoning parser: none (the template looks like %s, but %s)", detected, e)
            return None
        log.info("reasoning parser: %s (from the chat template)", fmt.parser)
        return fmt
    try:
        fmt = reasoning_format(name, tokenizer.token_to_id, _encoder(tokenizer))
    except ValueError as e:
        raise ValueError(f"--reasoning-parser {name}: {e}") from None
    log.info("reasoning parser: %s (--reasoning-parser)", fmt.parser)
    return fmt


class LaneState(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


class ModelLane:
    def __init__(self, entry: ModelEntry, tokenizer: Tokenizer, sampling_defaults: dict[str, Any],
                 reasoning: Optional[ReasoningFormat], pooler: Optional[Pooler], embedding_width: Optional[int],
                 footprint: int, planned_max_model_len: int, settings: ServeSettings) -> None:
        self.entry = entry
        self.name = entry.name
        self.tokenizer = tokenizer
        self.sampling_defaults = sampling_defaults
        self.reasoning = reasoning
        self.pooler = pooler
        self.embedding_width = embedding_width
        self.footprint = footprint  # bytes in the memory budget while loaded
        self.planned_max_model_len = planned_max_model_len
        self.preparer = PromptPreparer(tokenizer, settings.offload_chars, sampling_defaults,
                                       grammar_timeout_s=settings.grammar_compile_timeout)
        self.admission: AdmissionQueue[Any] = AdmissionQueue(
            max_queued=settings.max_queue, max_queued_per_client=settings.max_queue_per_client or settings.max_queue,
            max_in_engine=settings.in_engine_limit, submit=self._submit_unwired)
        self.admission.paused = True
        self.bridge: Optional[EngineBridge] = None
        self.state = LaneState.UNLOADED
        self.reserved = False  # its footprint is counted in the budget (loading or loaded)
        self.live = 0  # accepted requests for it that have not ended
        self.last_used = time.monotonic()
        self.keep_alive_s: Optional[float] = None  # a request's keep_alive (None: --keep-alive)
        self.expires_at: Optional[float] = None  # wall time an idle model unloads (None: not scheduled)
        self.load_seconds: Optional[float] = None  # the latest load's duration
        self.load_error: Optional[str] = None  # why the latest load failed
        self.loads = 0
        self.stage: Optional[str] = None  # "waiting for memory" or "loading" while it loads
        self.progress: Optional[LoadProgress] = None  # the engine thread's stages (server.models.load_progress)
        # Counters for /metrics (server.serving.model_metrics), kept here so they survive unloads.
        self.load_seconds_total = 0.0
        self.unloads = 0
        self.ended: dict[str, int] = {}  # requests ended, by ledger state
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def count_end(self, state: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.ended[state] = self.ended.get(state, 0) + 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    def _submit_unwired(self, job: Any) -> None:
        raise RuntimeError("admission is not wired to the service")

    @property
    def ready(self) -> bool:
        return self.state is LaneState.LOADED and self.bridge is not None and self.bridge.ready

    @property
    def max_model_len(self) -> int:
        """The engine's once loaded; before that the same figure from the plan (kv_budget)."""
        if self.bridge is not None and self.bridge.ready:
            return self.bridge.max_model_len
        return self.planned_max_model_len

    def stage_text(self) -> Optional[str]:
        """What the load is doing now (`read 12.0/48.0 MiB, 1.2 s`), None when not loading."""
        if self.state is LaneState.LOADING and self.stage == "loading" and self.progress is not None \
                and self.progress.stage is not None:
            return self.progress.describe()
        return self.stage if self.state is LaneState.LOADING else None

    def describe(self) -> dict[str, Any]:
        """/v1/models' and /health's view of this model."""
        return {"state": self.state.value, "footprint_bytes": self.footprint, "live_requests": self.live,
                "load_seconds": self.load_seconds, "load_error": self.load_error, "stage": self.stage_text(),
                "expires_at": self.expires_at}


def open_lane(settings: ServeSettings, entry: ModelEntry) -> ModelLane:
    """A model's torch-free parts (blocking: run off the loop). Raises ValueError/ModelLoadError."""
    tokenizer = load_tokenizer(entry.path)
    defaults = generation_defaults(entry.path)
    reasoning = pick_reasoning_format(tokenizer, settings.reasoning_parser)
    pooler = resolve_pooler(settings.task, entry.path)
    mc = read_model_config(entry.path)
    width = mc.hidden_size if pooler is not None else None
    plan = make_plan(entry.name, mc, settings.engine_config(str(entry.path)), None, None)
    footprint = plan.weights.total + plan.activations + plan.layout.total_bytes
    return ModelLane(entry, tokenizer, defaults, reasoning, pooler, width, footprint,
                     plan.layout.max_model_len, settings)
