"""CausalLM: what the engine, runner, draft proposer and autotune need of a model.

Every architecture's model class (server.models.registry resolves it) implements it, so nothing
outside server.models names a concrete class. Torch types only under TYPE_CHECKING: the protocol
module itself stays importable without torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional, Protocol

from server.models.config import ModelConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from server.kernels.quant import QuantizedWeight
    from server.kernels.quant_parts import QuantizedParts
    from server.models.attention import AttentionMetadata
    from server.models.lora import LoraStep, Slot
    from server.models.weights import WeightTarget


class CausalLM(Protocol):
    """A decoder over a flat batch of new tokens and a paged KV cache (see DecoderForCausalLM)."""

    config: ModelConfig
    dtype: "torch.dtype"
    device: "torch.device"
    # False forces the Python layers where a fused path exists (bench/decode_step.py times both).
    fused_decode: bool

    def __call__(self, input_ids: "torch.Tensor", positions: "torch.Tensor",
                 kv_caches: "list[tuple[torch.Tensor, torch.Tensor]]",
                 meta: "AttentionMetadata", lora: "LoraStep | None" = None) -> "torch.Tensor":
        """Run the step's tokens, writing their K/V; returns [T, hidden] final-normed states.
        lora: the step's LoRA terms for the rows that use an adapter (server.models.lora)."""
        ...

    def forward(self, input_ids: "torch.Tensor", positions: "torch.Tensor",
                kv_caches: "list[tuple[torch.Tensor, torch.Tensor]]",
                meta: "AttentionMetadata", lora: "LoraStep | None" = None) -> "torch.Tensor":
        """__call__ without nn.Module's hook handling (no pagewire model has hooks): what the runner
        calls each step, since Module.__call__ took 18 us right after a step's weight stream."""
        ...

    def lora_layout(self) -> "list[dict[str, Slot]]":
        """Per layer, the modules a LoRA adapter may target and where they land."""
        ...

    def compute_logits(self, hidden: "torch.Tensor", widen: bool = True) -> "torch.Tensor":
        """float32 logits [S, vocab] for rows of the forward's output; with widen=False in the
        lm_head's own dtype (a greedy step's argmax reads bf16 logits as they are)."""
        ...

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """One layer's key (and value) cache shape."""
        ...

    def kv_cache_bytes_per_token(self) -> int:
        ...

    def quantize_weights(self, quantization: str) -> None:
        ...

    def interleave_bf16(self, pack: Optional[bool] = None) -> None:
        """Move bf16 decoder matrices into the layout this CPU's bf16 kernel streams fastest (with
        `pack`, packed losslessly where that kernel family reads the packed layout)."""

    def linear_weights(self) -> "list[tuple[str, torch.Tensor | QuantizedWeight | QuantizedParts]]":
        ...

    def parameters(self, recurse: bool = True) -> "Iterator[torch.nn.Parameter]":
        ...

    def summary(self) -> str:
        """One line for the start-up log: the architecture, its layer kinds, how many run fused."""
        ...

    def checkpoint_tensors(self) -> "dict[str, WeightTarget]":
        """Every Hugging Face tensor name the loaders fill, mapped to where it is copied."""
        ...


class CausalLMClass(Protocol):
    """A model class as the registry names it: built from the config, weights uninitialised."""

    def __call__(self, config: ModelConfig, dtype: "torch.dtype", device: "torch.device | str" = "cpu",
                 tie_word_embeddings: bool | None = None) -> CausalLM:
        ...
