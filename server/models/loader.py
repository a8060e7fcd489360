"""load_model: turn a Hugging Face model folder (config.json + safetensors) or a GGUF file into a runnable model.

It owns finding the weight files (single or sharded with an index), reading them memory-mapped,
checking every tensor's presence and shape against what the model expects, and copying each
into the model's fused parameters with the requested dtype and device. A GGUF file is handed to
`server.models.gguf_loader`.
"""
from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from server.models import load_progress
from server.models.config import ModelConfig, ModelFileNotFoundError, ModelLoadError, UnsupportedModelError
from server.models.dtype import resolve_dtype
from server.models.gguf_file import is_gguf_path
from server.models.protocol import CausalLM
from server.models.registry import hf_config_from_dir, model_class
from server.models.weights import WeightTarget

SINGLE_FILE = "model.safetensors"
WRAPPED_PREFIX = "model.language_model."  # a multimodal checkpoint's language model
INDEX_FILE = "model.safetensors.index.json"

__all__ = ["load_model", "resolve_dtype", "ModelLoadError", "UnsupportedModelError", "ModelFileNotFoundError"]


def load_model(
    model_dir: str | Path, dtype: str = "auto", device: str | torch.device = "cpu", keep_gguf_blocks: bool = False,
    headless: bool = False,
) -> tuple[CausalLM, ModelConfig]:
    """Load a checkpoint folder or GGUF file of any registered family (server.models.registry).

    Args:
        model_dir: folder with config.json and model.safetensors, or model-0000x-of-0000y.safetensors
            shards listed in model.safetensors.index.json; or a .gguf file (see gguf_loader).
        dtype: "auto", "float32", "bfloat16" or "float16".
        device: where the parameters live.
        keep_gguf_blocks: for a GGUF file, keep its Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL/IQ4_XS/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K
            (and, rewritten, IQ3_XXS/IQ3_S/IQ2_XXS/IQ2_XS/IQ2_S/IQ1_S/IQ1_M/TQ1_0/TQ2_0) matrices quantised (`--quantization
            gguf`, see gguf_blocks); a ValueError for a Hugging Face folder.
        headless: the model serves embeddings (server.models.pooling), so its LM head is never
            used: a checkpoint without lm_head.weight loads with the head tied to the embedding
            table, and one saved as a base model (transformers' AutoModel: `layers.0...` without
            the `model.` prefix, as sentence-transformers folders are) is read under that prefix.
    Returns:
        (model, config); the model is in eval mode with requires_grad off.
    Raises:
        ModelFileNotFoundError naming a missing folder/file, UnsupportedModelError,
        ModelLoadError naming the tensor and file for missing, unexpected or mis-shaped tensors.
    """
    model_dir = Path(model_dir)
    if is_gguf_path(model_dir):
        from server.models.gguf_loader import load_gguf_model

        # One stage, bytes not counted; a missing file is GGUFFile.open's ModelFileNotFoundError.
        load_progress.stage("read and dequantise", model_dir.stat().st_size if model_dir.is_file() else 0)
        from server.models.gguf_file import forget_open_files

        try:
            return load_gguf_model(model_dir, dtype, device, keep_quantized=keep_gguf_blocks)
        finally:
            forget_open_files()  # the weights are copied out; the map would keep the file's pages resident
    if keep_gguf_blocks:
        raise ValueError(f"quantization: 'gguf' keeps a GGUF file's quantised blocks; {model_dir} is not a GGUF file")
    config = hf_config_from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype, config)
    files, index_map = _weight_files(model_dir)

    with ExitStack() as stack:
        handles = [(path, _open(path, stack)) for path in files]
        # transformers 5 unties a tied config whose checkpoint still stores lm_head.weight (and
        # uses that matrix); we do the same, then re-tie below if the two are equal anyway.
        has_lm_head = any("lm_head.weight" in h.keys() for _, h in handles)
        tied = (config.tie_word_embeddings or headless) and not has_lm_head
        model = model_class(config)(config, torch_dtype, torch.device(device), tie_word_embeddings=tied)
        targets = model.checkpoint_tensors()
        # Tensors the checkpoint may carry that the model does not use (Gemma 4's shared-KV layers).
        ignored: frozenset[str] = getattr(model, "ignored_checkpoint_tensors", frozenset)()
        names = [k for _, h in handles for k in h.keys()]
        if any(k.startswith(WRAPPED_PREFIX) for k in names):
            # A multimodal checkpoint (Gemma4ForConditionalGeneration): its language model is ours,
            # stored under model.language_model.; the vision and audio towers are not loaded.
            def wrapped(name: str) -> str:
                return WRAPPED_PREFIX + name.removeprefix("model.") if name.startswith("model.") else name

            targets = {wrapped(name): t for name, t in targets.items()}
            towers = {k for k in names if not k.startswith(WRAPPED_PREFIX) and k != "lm_head.weight"}
            ignored = frozenset(wrapped(name) for name in ignored) | frozenset(towers)
        # Parts of a checkpoint the model does not run, by prefix (Qwen3-Next's and Qwen3.5's MTP head).
        skipped: tuple[str, ...] = getattr(model, "ignored_checkpoint_prefixes", ())
        loaded: set[str] = set(ignored) | {k for k in names if skipped and k.startswith(skipped)}
        base_model = not any(k.startswith("model.") for _, h in handles for k in h.keys()) and \
            any(k == "embed_tokens.weight" for _, h in handles for k in h.keys())
        if base_model and not headless:
            raise ModelLoadError(f"{model_dir}: the checkpoint is a base model without an LM head (tensors named "
                                 "`layers.*`, not `model.layers.*`), as embedding models are saved; serve it "
                                 "with --task embed")
        if base_model:
            # A base-model checkpoint: the same tensors, named without the causal LM's prefix.
            targets = {name.removeprefix("model."): t for name, t in targets.items()}
        with torch.no_grad():
            _copy_tensors(handles, targets, loaded, config)

    missing = [name for name in targets if name not in loaded]
    if missing:
        name = missing[0]
        where = _expected_file(name, model_dir, index_map)
        more = ""
        if len(missing) > 1:
            more = f" (and {len(missing) - 1} more: {', '.join(missing[1:4])}{', ...' if len(missing) > 4 else ''})"
        raise ModelLoadError(f"tensor {name!r} not found in {where}{more}")
    lm_head, embed = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    if (config.tie_word_embeddings and has_lm_head and isinstance(lm_head, torch.Tensor)
            and isinstance(embed, torch.Tensor) and torch.equal(lm_head, embed)):
        model.tie_lm_head()  # type: ignore[attr-defined]
    return model, config


def _weight_files(model_dir: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files to read, and the index's tensor -> file map when sharded."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index_path}: cannot read 'weight_map': {e}") from e
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: 'weight_map' must be a non-empty object")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelFileNotFoundError(f, f"weights shard listed in {index_path}")
        return files, weight_map
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single], None
    raise ModelFileNotFoundError(single, f"model weights (neither it nor {index_path.name} exists)")


def _expected_file(name: str, model_dir: Path, index_map: dict[str, str] | None) -> Path:
    if index_map is None:
        return model_dir / SINGLE_FILE
    if name in index_map:
        return model_dir / index_map[name]
    return model_dir / INDEX_FILE


def _open(path: Path, stack: ExitStack) -> Any:
    """A memory-mapped safetensors handle, closed when `stack` exits."""
    try:
        return stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ModelLoadError(f"{path}: cannot open as safetensors: {e}") from e


def _copy_tensors(
    handles: list[tuple[Path, Any]], targets: dict[str, WeightTarget], loaded: set[str], config: ModelConfig
) -> None:
    """Read every tensor of every file into its target, checking the shape first."""
    total = sum(len(h.keys()) for _, h in handles)
    load_progress.stage("read", sum(p.stat().st_size for p, _ in handles))
    bar = tqdm(total=total, desc="Loading weights", unit="tensor", file=sys.stderr, disable=not sys.stderr.isatty())
    with bar:
        for path, h in handles:
            for name in h.keys():
                _copy_one(path, h, name, targets, loaded, config)
                bar.update(1)


_QK_NAMES = ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias")


def _copy_one(
    path: Path, handle: Any, name: str, targets: dict[str, WeightTarget], loaded: set[str], config: ModelConfig
) -> None:
    # HF once saved RoPE frequency buffers; we rebuild them from the config.
    if name.endswith("rotary_emb.inv_freq") or (name in loaded and name not in targets):
        return
    target = targets.get(name)
    if target is None:
        raise ModelLoadError(
            f"unexpected tensor {name!r} in {path}: the config ({config.architecture}) does not use it"
        )
    # Check the header's shape before reading any data.
    shape = tuple(handle.get_slice(name).get_shape())
    if shape != target.shape:
        raise ModelLoadError(f"tensor {name!r} in {path} has shape {list(shape)}, expected {list(target.shape)}")
    tensor = handle.get_tensor(name)
    load_progress.advance(tensor.numel() * tensor.element_size())
    if target.convert is not None:  # a checkpoint layout that is not dest's (gpt-oss's experts)
        tensor = target.convert(tensor)
    if config.rope_interleaved_checkpoint and name.endswith(_QK_NAMES):  # Ernie 4.5: GPT-J-style pairs
        from server.models.gguf_blocks import unpermute_qk

        layer = int(name.split(".")[2])
        tensor = unpermute_qk(tensor, config.num_heads if ".q_proj." in name else config.kv_heads_of(layer))
    # copy_ converts dtype and device, and broadcasts per-head norm vectors over their rows.
    target.dest.copy_(tensor)
    if target.offset:  # Gemma's norms scale by 1 + w: added once here, in the serving dtype
        target.dest.add_(target.offset)
    loaded.add(name)
    if target.after is not None:
        target.after()
