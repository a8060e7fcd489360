"""Fitting a request to the model lane its `model` routes to, at intake: the route's LoRA adapter
goes on the request, a request for the task the lane's model does not serve (generation vs
embedding, an embedding's `dimensions` past the model's width) is a 400 naming the field, and a
reasoning chat's sampling params are set for the lane's reasoning format.
"""
from __future__ import annotations

from server.engine.sampling_params import ReasoningGate, SamplingParams
from server.serving.errors import InvalidRequest
from server.serving.jobs import GenerationSpec
from server.serving.model_pool import Route
from server.serving.prompts import PromptPreparer
from server.text.reasoning import ReasoningFormat


def fit_to_lane(spec: GenerationSpec, route: Route) -> None:
    """Put the route's adapter on `spec` (the pool's names decide: an adapter's name runs its base
    model with it), and refuse a request the route's model cannot serve."""
    lane = route.lane
    if route.adapter is not None and spec.kind == "embedding":
        raise InvalidRequest(f"model: '{spec.model}' is a LoRA adapter; adapters are served on generation APIs "
                             f"(chat, completions, responses, messages, Ollama's and the WebSocket's); "
                             f"this API serves '{lane.name}'", param="model")
    spec.lora = route.adapter
    # A 400 naming the model when a request is for the task the model does not serve: every
    # edge's generation request to an embedding model, and embeddings from a generation model.
    if spec.kind == "embedding" and lane.embedding_width is None:
        raise InvalidRequest(f"model: '{spec.model}' is a text-generation model, not an embedding model, so it "
                             "cannot answer embedding requests; serve an embedding model (--task embed)",
                             param="model", code="not_embedding_model")
    if spec.kind != "embedding" and lane.embedding_width is not None:
        raise InvalidRequest(f"model: '{spec.model}' is an embedding model; it answers embedding requests "
                             "(/v1/embeddings, /api/embed) only, not text generation",
                             param="model", code="not_generation_model")
    dims = (spec.sampling.get("embedding") or {}).get("dimensions") if spec.kind == "embedding" else None
    width = lane.embedding_width
    if isinstance(dims, int) and width is not None and not 1 <= dims <= width:
        raise InvalidRequest(f"dimensions: must be between 1 and {width} (this model's embedding size), "
                             f"got {dims}", param="dimensions")


def gate_reasoning(fmt: ReasoningFormat, ids: list[int], params: SamplingParams,
                   preparer: PromptPreparer) -> None:
    """A reasoning chat: its structured output (a schema, a forced tool call) applies after the
    thinking (the engine's ReasoningGate), and the tags stay in the text to be split even
    where the tokenizer marks them special."""
    if params.structured_outputs is not None:
        params.reasoning_gate = ReasoningGate.for_format(fmt, ids)
    if preparer.tokenizer_has_special(fmt.start_token_id, fmt.end_token_id):
        params.skip_special_tokens = False
