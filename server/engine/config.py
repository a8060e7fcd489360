"""EngineConfig: the engine's knobs, one dataclass shared by the offline API, the CLI and the server.

Torch-free, so the CLI can build it (and read PAGEWIRE_* variables) before importing torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from server.engine.errors import ConfigError  # re-exported: the settings' error type
from server.strenum import StrEnum

if TYPE_CHECKING:
    from server.engine.spec_config import SpeculativeConfig

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")


class Quantization(StrEnum):
    """How the weights are kept (`EngineConfig.quantization`, `--quantization`); str-valued, so
    the CLI's strings and the model loader's table keys are these values."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"
    GGUF = "gguf"
    # GGUF on a CPU given a .gguf file, NONE otherwise; resolved by EngineConfig (`pagewire serve`'s default).
    AUTO = "auto"


SUPPORTED_QUANTIZATIONS = tuple(q.value for q in Quantization)


@dataclass
class EngineConfig:
    """Args:
    model: path to a Hugging Face model folder.
    dtype: "auto" (the checkpoint's torch_dtype), "float32", "bfloat16" or "float16".
    max_model_len: longest prompt + output in tokens; default: the model's max_position_embeddings.
    kv_cache_tokens: KV capacity in tokens; default derived from kv_cache_memory_gb.
    kv_cache_memory_gb: KV budget used when kv_cache_tokens is not given: the pool is what
        max_num_seqs sequences of max_model_len need, capped by this (engine/kv_budget.py).
    block_size: tokens per KV block.
    max_num_seqs: most sequences in one step.
    max_num_batched_tokens: token budget per step (prefill chunks + decodes). On a CPU a step's
        time grows with its prefill tokens, so this bounds inter-token latency while prompts
        prefill. 256 here (offline throughput); `pagewire serve` defaults to 128 (latency).
    enable_prefix_caching: reuse full KV blocks across requests by content hash.
    num_threads: intra-op CPU threads (0 = torch's default).
    seed: base seed for unseeded sampling.
    quantization: "none" (weights in dtype; a GGUF file is dequantised), "int8" / "int4" (every
        decoder and lm_head matrix quantised at load to GGUF Q8_0 / Q4_0 blocks and kept so), or
        "gguf" (a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL/IQ4_XS/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K matrices kept in
        their own blocks, IQ3_XXS/IQ3_S/IQ2_XXS/IQ2_XS/IQ2_S/IQ1_S/IQ1_M/TQ1_0/TQ2_0 ones rewritten exactly into blocks a kernel
        reads, the rest dequantised; GGUF files only). All but "none" run on CPU only. "auto" (`pagewire serve`'s
        default) is "gguf" for a .gguf file on the CPU and "none" otherwise: a Q4 file runs from its
        blocks, as llama.cpp and Ollama run it, not dequantised to its float dtype (3-4x slower to
        decode: bench/RESULTS.md, session 21); the config holds the resolved value.
    speculative_config: None (off), or a SpeculativeConfig, a dict or a JSON object string in
        vLLM's shape ({"method": "ngram", "num_speculative_tokens": 4, ...}); see spec_config.py.
    deterministic: batch-invariant inference: a request's tokens and logprobs do not depend on the
        other requests in its steps, its position among them, prefix-cache hits, prefill chunking
        or preemption (server.kernels.batch_invariant; guarantees and cost: docs/determinism.md).
        None (auto, the default): on where it was measured to cost under 5 %, which is CPU bf16
        and fp32 weights on AVX2 CPUs and bf16 on AVX512-BF16 CPUs without AMX
        (batch_invariant.cheap_here); LLMEngine.deterministic is the outcome.
    autotune: time linear's two paths (pagewire kernel or torch) per weight shape and row-count
        bucket at start-up and follow the faster (server.kernels.autotune, about 1-2 s). None
        (auto, the default): on for CPU, off on CUDA (no CPU kernels there). Never in
        deterministic mode, whose path must not depend on the row count.
    adapt_threads: follow other processes' load on the CPU cores (server.engine.thread_governor): while
        decode steps run several times slower than their own best because the cores are crowded,
        steps run on half the threads where that is measured faster, and go back when it no longer
        is. None (auto, the default): on for CPU with two or more threads, except on CPUs without
        AVX2 in deterministic mode (there a GEMM's reduction may split by thread count).
    itl_target_ms: inter-token latency target in milliseconds, or None (off, the default here):
        while sequences decode, each step's prefill chunk is sized from an online estimate of the
        step's cost so that the step stays within it (server.engine.step_budget); a step with
        nothing decoding still takes max_num_batched_tokens. `pagewire serve` defaults to 50.
    itl_target_factor: with itl_target_ms, a step with decodes may also take up to this many times
        the decodes' own (decode-only) step, where that is longer than itl_target_ms (up to twice
        itl_target_ms; server.engine.step_budget measures that step): on a CPU whose
        batch-8 decode step is already most of the fixed target, prefill beside it would otherwise
        crawl while the streams keep a cadence far below their own. 0 (the default here): the
        fixed target alone. `pagewire serve` defaults to 3.
    task: "generate", "embed" (prefill-only requests pooled into vectors: server.models.pooling)
        or "auto" (embed when the folder has a sentence-transformers pooling config).
    lora_modules: LoRA adapters over the model, (name, PEFT folder) pairs or a {name: folder}
        mapping (`--lora NAME=PATH`); a request names one with add_request's `lora`
        (server.models.lora). Generation models only.
    """

    model: str
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    kv_cache_tokens: Optional[int] = None
    kv_cache_memory_gb: float = 2.0
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    enable_prefix_caching: bool = True
    num_threads: int = 0
    seed: int = 0
    device: str = "cpu"
    quantization: Quantization = Quantization.NONE  # a plain string of one of its values is accepted
    speculative_config: "SpeculativeConfig | dict[str, Any] | str | None" = None
    deterministic: Optional[bool] = None
    autotune: Optional[bool] = None
    adapt_threads: Optional[bool] = None
    task: str = "auto"
    itl_target_ms: Optional[float] = None
    itl_target_factor: float = 0.0
    lora_modules: "tuple[tuple[str, str], ...] | dict[str, str]" = ()

    @property
    def adapters(self) -> tuple[tuple[str, str], ...]:
        """lora_modules as (name, folder) pairs."""
        m = self.lora_modules
        return tuple(m.items()) if isinstance(m, dict) else m

    def __post_init__(self) -> None:
        if self.deterministic is not None and not isinstance(self.deterministic, bool):
            raise ConfigError("deterministic", f"must be true, false or None (auto), got {self.deterministic!r}")
        if self.autotune is not None and not isinstance(self.autotune, bool):
            raise ConfigError("autotune", f"must be true, false or None (auto), got {self.autotune!r}")
        if self.adapt_threads is not None and not isinstance(self.adapt_threads, bool):
            raise ConfigError("adapt_threads", f"must be true, false or None (auto), got {self.adapt_threads!r}")
        if self.speculative_config is not None:
            from server.engine.spec_config import SpeculativeConfig  # (it imports ConfigError from here)

            self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        try:
            self.quantization = Quantization(self.quantization)
        except ValueError:
            raise ConfigError(
                "quantization", f"must be one of {', '.join(SUPPORTED_QUANTIZATIONS)}, got {self.quantization!r}"
            ) from None
        if self.quantization is Quantization.AUTO:
            from server.models.gguf_file import is_gguf_path

            on_cpu_gguf = self.device == "cpu" and is_gguf_path(self.model)
            self.quantization = Quantization.GGUF if on_cpu_gguf else Quantization.NONE
        if self.quantization is not Quantization.NONE and self.device != "cpu":
            raise ConfigError("quantization", f"{self.quantization.value!r} runs on CPU only, got device {self.device!r}")
        if self.quantization is Quantization.GGUF:
            from server.models.gguf_file import is_gguf_path

            if not is_gguf_path(self.model):
                raise ConfigError(
                    "quantization", f"'gguf' keeps a GGUF file's quantised blocks; {self.model!r} is not a .gguf file"
                )
        pairs = self.lora_modules.items() if isinstance(self.lora_modules, dict) else self.lora_modules
        self.lora_modules = tuple((str(n), str(p)) for n, p in pairs)
        if len({n for n, _ in self.lora_modules}) != len(self.lora_modules):
            raise ConfigError("lora_modules", "an adapter name is given twice")
        if self.task not in ("auto", "generate", "embed"):
            raise ConfigError("task", f"must be one of auto, generate, embed, got {self.task!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ConfigError("dtype", f"must be one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(name, f"must be a positive integer, got {v!r}")
        if self.itl_target_ms is not None and not self.itl_target_ms > 0:
            raise ConfigError("itl_target_ms", f"must be a positive number of milliseconds, got {self.itl_target_ms!r}")
        if not (isinstance(self.itl_target_factor, (int, float)) and self.itl_target_factor >= 0):
            raise ConfigError("itl_target_factor", f"must be a number >= 0, got {self.itl_target_factor!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len", f"must be positive, got {self.max_model_len}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ConfigError(
                "kv_cache_tokens", f"must hold at least one block ({self.block_size}), got {self.kv_cache_tokens}"
            )
        if self.kv_cache_memory_gb <= 0:
            raise ConfigError("kv_cache_memory_gb", f"must be positive, got {self.kv_cache_memory_gb}")
