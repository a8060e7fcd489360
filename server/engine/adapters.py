"""An engine's LoRA adapters: `load_adapters` reads `lora_modules`, checks them against the base
model (ConfigError naming `lora_modules`) and loads them into one LoraSet; `adapter_slot` turns
a request's adapter name into its slot (ValueError naming `model` for an unknown name).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from server.engine.config import EngineConfig
from server.engine.errors import ConfigError
from server.models.config import ModelConfig
from server.models.lora import LoraSet
from server.models.lora_config import LoraError, check_base_model, read_lora_config
from server.models.protocol import CausalLM

logger = logging.getLogger("pagewire.engine")


def load_adapters(config: EngineConfig, model: CausalLM, model_config: ModelConfig, device: torch.device,
                  dtype: torch.dtype, embedding: bool) -> Optional[LoraSet]:
    """The LoRA adapters of `lora_modules`, checked against the model (None: none given);
    `embedding`: the model serves embeddings, which adapters do not apply to."""
    if not config.lora_modules:
        return None
    if embedding:
        raise ConfigError("lora_modules", "LoRA adapters apply to generation models, this one serves embeddings")
    try:
        check_base_model(model_config)
    except LoraError as e:
        raise ConfigError("lora_modules", str(e).removeprefix("--lora: ")) from None
    lora = LoraSet(model.lora_layout(), dtype, device, model_config.vocab_size)
    for name, path in config.adapters:
        cfg = read_lora_config(path)
        lora.load(name, cfg)
        logger.info("LoRA adapter %s: %s (r=%d, scale %g, %s)", name, path, cfg.rank, cfg.scale,
                    ", ".join(sorted(cfg.targets)) or cfg.target_regex)
    logger.info("LoRA: %d adapter(s)", len(lora.names))
    return lora


def adapter_slot(lora: Optional[LoraSet], name: Optional[str]) -> int:
    """The adapter's slot (0 for None); ValueError naming `model` for an unknown name."""
    if name is None:
        return 0
    names = lora.names if lora is not None else []
    if name not in names:
        have = f"the adapters are {', '.join(names)}" if names else "no LoRA adapters are loaded"
        raise ValueError(f"model: no LoRA adapter named {name!r}; {have}")
    assert lora is not None
    return lora.slot(name)
