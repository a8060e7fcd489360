"""How the engine's steps run on this machine, decided once at start-up (pace_steps): whether they
are batch-invariant (deterministic mode), the linear paths' autotune table, the ITL target's
prefill budget, and the CPU thread governor. LLMEngine builds a StepPacing once its model and KV
pool are in, and its step() follows it."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from server.engine.config import EngineConfig
from server.engine.step_budget import StepBudget
from server.engine.thread_governor import ThreadGovernor
from server.kernels import autotune, batch_invariant
from server.kernels.linear_route import Q8_KERNEL_MAX_ROWS
from server.kernels.ops import cpu_isa
from server.models import load_progress
from server.models.protocol import CausalLM

__all__ = ["StepPacing", "pace_steps"]

logger = logging.getLogger("pagewire.engine")


@dataclass(frozen=True)
class StepPacing:
    deterministic: bool  # every step batch-invariant (server.kernels.batch_invariant)
    linear_table: Optional[autotune.LinearTable]  # the autotuned linear paths (None: the fixed rules)
    step_budget: Optional[StepBudget]  # the ITL target's chunk policy (None: no target)
    thread_governor: Optional[ThreadGovernor]  # the steps' thread count under a crowd (None: fixed)


def pace_steps(config: EngineConfig, model: CausalLM, draft: Optional[CausalLM], kv_dtype: torch.dtype) -> StepPacing:
    """The pacing for an engine of `config` over `model` (and its draft model), timing the
    autotune's candidates on them now."""
    # Deterministic mode: as configured, or (None, "auto") on where it is cheap.
    deterministic = (
        config.deterministic if config.deterministic is not None
        else batch_invariant.cheap_here(config.device, str(kv_dtype).replace("torch.", ""),
                                        config.quantization, cpu_isa())
    )
    logger.info("deterministic mode: %s%s", "on" if deterministic else "off",
                " (auto)" if config.deterministic is None else "")
    load_progress.stage("autotune")
    table = _autotune_linears(config, model, draft, deterministic)
    # The ITL target's chunk-size policy: it times every step and limits prefill chunks beside
    # decodes (None: off, every step takes what max_num_batched_tokens holds).
    budget: Optional[StepBudget] = None
    if config.itl_target_ms is not None:
        budget = StepBudget(config.itl_target_ms / 1e3, config.max_num_batched_tokens,
                            fused_rows=Q8_KERNEL_MAX_ROWS if config.device == "cpu" else 0,
                            factor=config.itl_target_factor)
        logger.info("ITL target: %.0f ms per step while sequences decode%s", config.itl_target_ms,
                    f", or {config.itl_target_factor:g}x their own step where longer"
                    if config.itl_target_factor else "")
    return StepPacing(deterministic, table, budget, _thread_governor(config, deterministic))


def _autotune_linears(config: EngineConfig, model: CausalLM, draft: Optional[CausalLM],
                      deterministic: bool) -> Optional[autotune.LinearTable]:
    """The linear paths' table for the engine's steps (server.kernels.autotune), or None (fixed rules)."""
    on = config.autotune if config.autotune is not None else config.device == "cpu"
    if not on or deterministic:
        # Deterministic mode's linear takes one batch-invariant path for every row count.
        logger.info("linear autotune: off%s", " (deterministic mode)" if on else "")
        return None
    sites = [s for name, w in model.linear_weights() for s in autotune.sites_of(name, w, model.dtype)]
    if draft is not None:
        sites += [s for name, w in draft.linear_weights() for s in autotune.sites_of("draft." + name, w, draft.dtype)]
    return autotune.tune(sites, max_rows=config.max_num_batched_tokens)


def _thread_governor(config: EngineConfig, deterministic: bool) -> Optional[ThreadGovernor]:
    """The thread count's governor (server.engine.thread_governor), or None where it stays fixed."""
    threads = torch.get_num_threads()
    on = config.adapt_threads if config.adapt_threads is not None else config.device == "cpu"
    if not on or config.device != "cpu" or threads < 2:
        return None
    if deterministic and cpu_isa() == "portable":
        # Without AVX2 the linears fall back to ATen's GEMM, whose reduction may split by thread
        # count (docs/determinism.md): a count that follows the load would change the bits.
        logger.info("adaptive CPU threads: off (deterministic mode on a CPU without AVX2)")
        return None
    return ThreadGovernor(threads)
