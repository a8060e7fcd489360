"""resolve_dtype: the torch dtype a model is served in, from the --dtype option and its config."""
from __future__ import annotations

import torch

from server.models.config import ModelConfig, ModelLoadError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, config: ModelConfig) -> torch.dtype:
    """"auto" -> the checkpoint's dtype (config dtype/torch_dtype, default float32); else the named dtype."""
    name = config.torch_dtype if dtype == "auto" else dtype
    if name not in _DTYPES:
        raise ModelLoadError(f"dtype: must be 'auto' or one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[name]
