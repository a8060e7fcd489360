"""A LoRA adapter's folder as PEFT saves it, read and checked without torch: `adapter_config.json`
(rank, alpha, target modules) beside `adapter_model.safetensors`.

Torch-free, so the CLI checks `--lora NAME=PATH` before binding a port or loading the model; the
tensors themselves are checked against the model when the engine loads them (server.models.lora).
Every error names the file and the field (LoraError, a ValueError).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The decoder projections an adapter may target (PEFT's module names) and the fused matrix each
# lands in (server.models.decoder_layer: one qkv and one gate_up matrix per layer).
TARGETS: dict[str, str] = {
    "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
    "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down",
}
# The prefix cache keeps adapters apart by a namespace per loaded adapter (engine/kv_cache_manager.py):
# at most this many adapters per server.
MAX_ADAPTERS = 127
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}$")


class LoraError(ValueError):
    """A bad adapter folder, file or field; the message names it."""


@dataclass(frozen=True)
class LoraConfig:
    """What pagewire reads of adapter_config.json.

    Args:
        path: the adapter folder.
        rank: `r`; every targeted module has this rank.
        scale: lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), the factor PEFT multiplies
            B·A·x by.
        targets: the PEFT module names it targets (keys of TARGETS), as a set of names or, when
            target_modules is a regular expression, matched against full module names later.
        target_regex: target_modules when PEFT was given a string (a full-match regex), else None.
        base_model: base_model_name_or_path, as saved (informational).
    """

    path: Path
    rank: int
    scale: float
    targets: frozenset[str]
    target_regex: str | None
    base_model: str | None

    @property
    def weights_path(self) -> Path:
        return self.path / WEIGHTS_FILE

    def targets_module(self, layer: int, module: str) -> bool:
        """Whether layer `layer`'s `module` (e.g. "q_proj") carries this adapter, by PEFT's rule:
        a list matches a module name's last part, a string is a regex over the full name."""
        if self.target_regex is None:
            return module in self.targets
        kind = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        return re.fullmatch(self.target_regex, f"model.layers.{layer}.{kind}.{module}") is not None


def parse_lora_arg(text: str) -> tuple[str, str]:
    """`NAME=PATH` (a `--lora` value) -> (name, path); ValueError naming `--lora` otherwise."""
    name, sep, path = text.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
        raise ValueError(f"--lora: expected NAME=PATH (a PEFT adapter folder), got {text!r}")
    if not _NAME.match(name):
        raise ValueError(f"--lora: adapter name {name!r} must be 1-128 letters, digits or ._:/@- "
                         "(it is what requests send as `model`)")
    return name, path


def _field(cfg: dict[str, Any], key: str, where: str) -> Any:
    if key not in cfg:
        raise LoraError(f"{where}: {key}: missing")
    return cfg[key]


def read_lora_config(path: str | Path) -> LoraConfig:
    """Read and check a PEFT LoRA folder's adapter_config.json (and that the weights file exists).

    Raises LoraError naming the folder, file or field: a missing folder or file, a peft_type other
    than LORA, a rank that is not a positive integer, an alpha that is not a positive number,
    target modules pagewire cannot apply (anything but the decoder's q/k/v/o and MLP projections),
    and the PEFT features it does not implement (DoRA, bias training, modules_to_save, per-module
    rank or alpha patterns, layers_to_transform, fan_in_fan_out)."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoraError(f"{folder}: not a folder (a LoRA adapter is a PEFT folder with {CONFIG_FILE} "
                        f"and {WEIGHTS_FILE})")
    cfg_path = folder / CONFIG_FILE
    where = str(cfg_path)
    if not cfg_path.is_file():
        raise LoraError(f"{where}: missing (a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"{where}: not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{where}: must hold a JSON object")
    if not (folder / WEIGHTS_FILE).is_file():
        extra = " (adapter_model.bin is not read: save with safe_serialization=True)" \
            if (folder / "adapter_model.bin").is_file() else ""
        raise LoraError(f"{folder / WEIGHTS_FILE}: missing{extra}")
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"{where}: peft_type: only LORA adapters are supported, got {peft_type!r}")
    rank = _field(cfg, "r", where)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise LoraError(f"{where}: r: must be a positive integer, got {rank!r}")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise LoraError(f"{where}: lora_alpha: must be a positive number, got {alpha!r}")
    scale = alpha / rank**0.5 if cfg.get("use_rslora") else alpha / rank
    unsupported = {"use_dora": False, "fan_in_fan_out": False}
    for key, want in unsupported.items():
        if cfg.get(key, want) != want:
            raise LoraError(f"{where}: {key}: {cfg[key]!r} is not supported (only {want!r})")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{where}: bias: {cfg['bias']!r} is not supported (only 'none': no trained biases)")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform", "layer_replication"):
        if cfg.get(key):
            raise LoraError(f"{where}: {key}: not supported (got {cfg[key]!r}); pagewire applies one rank and "
                            "alpha to every targeted decoder projection")
    # PEFT variants that change the computation itself (trained biases, extra tokens, activated
    # LoRA, quantisation-aware, block-diagonal and other LoRA flavours, parameter targets).
    for key in ("lora_bias", "trainable_token_indices", "target_parameters", "alora_invocation_tokens",
                "use_qalora", "use_bdlora", "arrow_config", "kasa_config", "velora_config"):
        if cfg.get(key):
            raise LoraError(f"{where}: {key}: not supported (got {cfg[key]!r})")
    raw = _field(cfg, "target_modules", where)
    regex: str | None = None
    if isinstance(raw, str):
        if raw == "all-linear":
            targets = frozenset(TARGETS)
        else:
            try:
                re.compile(raw)
            except re.error as e:
                raise LoraError(f"{where}: target_modules: not a valid regular expression: {e}") from None
            regex, targets = raw, frozenset()
    elif isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw):
        names = [t.rsplit(".", 1)[-1] for t in raw]
        bad = sorted(set(names) - set(TARGETS))
        if bad:
            raise LoraError(f"{where}: target_modules: {', '.join(bad)} not supported; an adapter may target "
                            f"{', '.join(TARGETS)}")
        targets = frozenset(names)
    else:
        raise LoraError(f"{where}: target_modules: must be a non-empty list of module names or a regex string, "
                        f"got {raw!r}")
    base = cfg.get("base_model_name_or_path")
    return LoraConfig(folder, rank, float(scale), targets, regex, base if isinstance(base, str) else None)


def check_base_model(config: "ModelConfig") -> None:
    """LoraError unless adapters can run over this model: a hybrid's recurrent layers (LFM2's
    short convolutions, Qwen3-Next's DeltaNet) have no low-rank path (issue 28 meets issue 30)."""
    from server.models.state_specs import ATTENTION

    kinds = sorted({t for t in config.layer_types if t != ATTENTION})
    if kinds:
        raise LoraError(f"--lora: {config.architecture} has recurrent-state layers ({', '.join(kinds)}), which "
                        "take no LoRA adapter; adapters run over attention-only models")
