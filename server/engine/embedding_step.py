"""What an engine does differently for an embedding model (models/pooling.py): which requests it
takes (`check_task`: embedding requests only, and generation ones only on a generation model;
`dimensions` at most the model's width), and how a step ends them (`fold_pooled`: each share's
pooled rows folded into its request, the last one ending it with its vector). Prefill-only: an
embedding request samples nothing.
"""
from __future__ import annotations

import time
from typing import Optional

import torch.nn.functional as F

from server.engine.outputs import FinishReason
from server.engine.request import Request
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import ScheduledSeq
from server.models.pooling import Pooler, PoolingMethod


def check_task(params: SamplingParams, pooler: Optional[Pooler], model: str, width: int) -> None:
    """An embedding request needs an embedding model (`pooler` not None) and the other way round
    (ValueError naming `model`), and `dimensions` at most the model's width."""
    if pooler is None and params.embedding is not None:
        raise ValueError(f"model: {model} is served for generation, not embeddings")
    if pooler is not None and params.embedding is None:
        raise ValueError(f"model: {model} is an embedding model; it answers embedding requests only")
    dims = getattr(params.embedding, "dimensions", None)
    if dims is not None and not 1 <= dims <= width:
        raise ValueError(f"dimensions: must be between 1 and {width} (this model's embedding size), got {dims}")


def fold_pooled(scheduled: list[ScheduledSeq], touched: dict[str, Request]) -> None:
    """Fold each embedding share's rows (the runner's `ScheduledSeq.pooled`) into its request;
    a share that brings the prompt up to date ends it with the vector (`Request.embedding`)
    and finish_reason stop. Runs before the engine's `_advance`, so `share.samples` still reads
    the pre-step `num_computed_tokens`."""
    for share in scheduled:
        req = share.seq.request
        pooler = req.pooler
        if pooler is None:
            continue
        part = share.pooled
        share.pooled = None
        if part is not None:
            # Mean: a share from position 0 starts the sum afresh (a preempted request
            # recomputes its whole prompt, never from a prefix hit: see the scheduler).
            if pooler.method is PoolingMethod.MEAN and share.seq.num_computed_tokens > 0 and req.pooled is not None:
                req.pooled = req.pooled + part  # (inference tensors: no in-place add outside the forward)
            else:
                req.pooled = part
        if not share.samples:
            continue
        vec = req.pooled
        assert vec is not None, "an embedding request's last share pools its prompt"
        if pooler.method is PoolingMethod.MEAN:
            vec = vec / len(req.prompt_token_ids)
        dims = getattr(req.params.embedding, "dimensions", None)
        if dims is not None:
            vec = vec[:dims]  # Matryoshka: the leading dimensions, normalised again below
        if pooler.normalize:
            vec = F.normalize(vec, p=2.0, dim=0)  # sentence-transformers' Normalize module
        req.embedding = vec.tolist()
        req.pooled = None
        seq = share.seq
        seq.finish_reason = FinishReason.STOP
        touched[req.request_id] = req
        if req.first_token_time is None:
            req.first_token_time = time.time()
