"""make_lora_adapter: write a tiny random LoRA adapter folder with PEFT itself (no downloads), and
peft_greedy: transformers + PEFT's own greedy tokens with it, the reference LoRA tests compare with.

Every A and B is drawn at random (B nonzero, unlike PEFT's training init), large enough that an
adapter changes a tiny model's greedy tokens.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_lora_adapter(model_dir: str | Path, out_dir: str | Path, *, targets: Optional[list[str]] = None,
                      r: int = 4, alpha: float = 8.0, seed: int = 1, std: float = 0.15,
                      **config: Any) -> Path:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) over the model in
    `model_dir`; `config`: other LoraConfig fields (use_rslora=True, ...)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, init_lora_weights=False,
                     **config)
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


_MODELS: dict[tuple[str, Optional[str]], Any] = {}


def peft_model(model_dir: str | Path, adapter: Optional[str | Path]) -> Any:
    """transformers' float32 model, with PEFT's adapter applied (not merged) when one is given."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    key = (str(model_dir), str(adapter) if adapter is not None else None)
    if key not in _MODELS:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        _MODELS[key] = PeftModel.from_pretrained(base, str(adapter)).eval() if adapter is not None else base
    return _MODELS[key]


def peft_greedy(model_dir: str | Path, adapter: Optional[str | Path], prompt: list[int], max_new: int) -> list[int]:
    """The new tokens of greedy `generate` for one prompt (no padding), base model or base + adapter."""
    import torch

    model = peft_model(model_dir, adapter)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
