"""A bad LoRA adapter is refused with an error naming the file and the field or tensor: the folder
and adapter_config.json (torch-free, before `pagewire serve` binds), the tensors against the model
(when it loads), and `--lora` itself."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from server.cli import main
from server.engine.config import ConfigError, EngineConfig
from server.models.loader import load_model
from server.models.lora import LoraSet
from server.models.lora_config import LoraError, parse_lora_arg, read_lora_config
from server.serving.model_names import ModelNames
from tests.lora_adapters import make_lora_adapter

KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def base_and_adapter(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    model = tiny_model("llama")
    return model, make_lora_adapter(model, tmp_path_factory.mktemp("lv") / "adapter", r=4)


def _copy(adapter: Path, tmp: Path, **config: object) -> Path:
    out = tmp / "copy"
    shutil.copytree(adapter, out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg.update(config)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("value, message", [
    ("noequals", "--lora: expected NAME=PATH (a PEFT adapter folder), got 'noequals'"),
    ("=path", "--lora: expected NAME=PATH"),
    ("name=", "--lora: expected NAME=PATH"),
    ("bad name=/x", "--lora: adapter name 'bad name' must be"),
])
def test_lora_argument(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_lora_arg(value)
    assert parse_lora_arg("sql=/a/b=c") == ("sql", "/a/b=c")


def test_folder_and_files(base_and_adapter: tuple[Path, Path], tmp_path: Path) -> None:
    _, adapter = base_and_adapter
    with pytest.raises(LoraError, match=f"{tmp_path / 'none'}: not a folder"):
        read_lora_config(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="empty/adapter_config.json: missing"):
        read_lora_config(tmp_path / "empty")
    bad = _copy(adapter, tmp_path)
    (bad / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraError, match="adapter_config.json: not readable JSON"):
        read_lora_config(bad)
    shutil.rmtree(bad)
    nowt = _copy(adapter, tmp_path)
    (nowt / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraError, match="copy/adapter_model.safetensors: missing"):
        read_lora_config(nowt)


@pytest.mark.parametrize("field, message", [
    ({"r": 0}, "adapter_config.json: r: must be a positive integer, got 0"),
    ({"r": "8"}, "adapter_config.json: r: must be a positive integer, got '8'"),
    ({"lora_alpha": -1}, "adapter_config.json: lora_alpha: must be a positive number, got -1"),
    ({"peft_type": "IA3"}, "adapter_config.json: peft_type: only LORA adapters are supported, got 'IA3'"),
    ({"target_modules": ["q_proj", "lm_head"]}, "adapter_config.json: target_modules: lm_head not supported"),
    ({"target_modules": []}, "adapter_config.json: target_modules: must be a non-empty list"),
    ({"use_dora": True}, "adapter_config.json: use_dora: True is not supported"),
    ({"bias": "all"}, "adapter_config.json: bias: 'all' is not supported"),
    ({"modules_to_save": ["lm_head"]}, "adapter_config.json: modules_to_save: not supported"),
    ({"rank_pattern": {"q_proj": 8}}, "adapter_config.json: rank_pattern: not supported"),
])
def test_config_fields(field: dict[str, object], message: str, base_and_adapter: tuple[Path, Path],
                       tmp_path: Path) -> None:
    with pytest.raises(LoraError, match=message.replace("(", r"\(")):
        read_lora_config(_copy(base_and_adapter[1], tmp_path, **field))


def _load(model_dir: Path, adapter: Path) -> None:
    model, _ = load_model(model_dir, dtype="float32")
    LoraSet(model.lora_layout(), model.dtype, model.device, model.config.vocab_size).load("a", read_lora_config(adapter))


def test_tensors_against_the_model(base_and_adapter: tuple[Path, Path], tmp_path: Path) -> None:
    model, adapter = base_and_adapter
    _load(model, adapter)  # the good one loads
    # A rank that is not the config's r.
    down = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"  # (the first in name order)
    with pytest.raises(LoraError, match=rf"adapter_model.safetensors: {down}: shape \[4, 128\], expected "
                                        r"\[8, 128\] \(r = 8 in adapter_config.json; down_proj of layer 0 maps 128 -> 64\)"):
        _load(model, _copy(adapter, tmp_path, r=8))
    shutil.rmtree(tmp_path / "copy")
    # A module the config does not target.
    with pytest.raises(LoraError, match=f"{KEY}: q_proj is not in .*adapter_config.json's target_modules"):
        _load(model, _copy(adapter, tmp_path, target_modules=["k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                              "down_proj"]))
    for edit, message in [
        (lambda t: t.pop(KEY.replace("lora_A", "lora_B")),
         KEY.replace("lora_A", "lora_B") + r": missing \(its lora_A is there\)"),
        (lambda t: t.update({KEY.replace("layers.0", "layers.7"): t[KEY]}),
         KEY.replace("layers.0", "layers.7") + r": layer 7 does not exist \(the model has 2\)"),
        (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": t[KEY]}),
         "base_model.model.lm_head.lora_A.weight: not a LoRA tensor of a decoder projection"),
        (lambda t: t.update({KEY: t[KEY][:, :32]}), rf"{KEY}: shape \[4, 32\], expected \[4, 64\]"),
    ]:
        shutil.rmtree(tmp_path / "copy")
        bad = _copy(adapter, tmp_path)
        tensors = load_file(str(bad / "adapter_model.safetensors"))
        edit(tensors)
        save_file({k: v.clone() for k, v in tensors.items()}, str(bad / "adapter_model.safetensors"))
        with pytest.raises(LoraError, match=message):
            _load(model, bad)
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(LoraError, match="adapter_model.safetensors: not a readable safetensors file"):
        _load(model, bad)


def test_names_and_engine_config(base_and_adapter: tuple[Path, Path]) -> None:
    names = ModelNames("base", ["sql", "chat"])
    assert names.all() == [("base", None), ("sql", "base"), ("chat", "base")]
    with pytest.raises(ValueError, match="--lora: adapter name 'base' is the served model's own name"):
        ModelNames("base", ["base"])
    with pytest.raises(ConfigError, match="lora_modules: an adapter name is given twice"):
        EngineConfig(model="m", lora_modules=(("a", "/x"), ("a", "/y")))
    assert EngineConfig(model="m", lora_modules={"a": "/x"}).adapters == (("a", "/x"),)
    assert torch.get_default_dtype() == torch.float32


def test_serve_refuses_a_bad_adapter_before_binding(base_and_adapter: tuple[Path, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    model, adapter = base_and_adapter
    bad = _copy(adapter, tmp_path, r=-2)
    assert main(["serve", str(model), "--lora", f"sql={bad}", "--db", str(tmp_path / "l.db")]) == 2
    assert capsys.readouterr().err.strip() == (f"pagewire: {bad / 'adapter_config.json'}: r: must be a positive "
                                               "integer, got -2")
    with pytest.raises(SystemExit):  # argparse's own exit 2, with the message
        main(["serve", str(model), "--lora", "sql", "--db", str(tmp_path / "l.db")])
    assert "--lora: expected NAME=PATH (a PEFT adapter folder), got 'sql'" in capsys.readouterr().err


def test_a_hybrid_base_model_refuses_adapters(tiny_model: Callable[..., Path], base_and_adapter: tuple[Path, Path],
                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """LFM2's short convolutions have no low-rank path: `serve` refuses before binding, the
    offline engine at load, each naming the layer kind (never a failure per request)."""
    from server.engine.engine import LLMEngine

    _, adapter = base_and_adapter
    hybrid = tiny_model("lfm2")
    assert main(["serve", str(hybrid), "--lora", f"sql={adapter}", "--db", str(tmp_path / "h.db")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("pagewire: --lora: Lfm2ForCausalLM has recurrent-state layers (short_conv)"), err
    with pytest.raises(ConfigError, match=r"lora_modules: .*recurrent-state layers \(short_conv\)"):
        LLMEngine(EngineConfig(model=str(hybrid), lora_modules={"sql": str(adapter)}, max_model_len=64,
                               autotune=False))


def test_lora_flag_and_env_reach_the_engine_config() -> None:
    import argparse

    from server.serving.settings import add_serve_arguments, settings_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    ns = p.parse_args(["m", "--lora", "a=/x", "--lora", "b=/y"])
    s = settings_from_args(ns, environ={"PAGEWIRE_LORA": "c=/z"})
    assert s.lora == (("a", "/x"), ("b", "/y"))  # the flags win over the variable
    assert s.engine_config("m").adapters == (("a", "/x"), ("b", "/y"))
    s = settings_from_args(p.parse_args(["m"]), environ={"PAGEWIRE_LORA": "c=/z, d=/w"})
    assert s.lora == (("c", "/z"), ("d", "/w"))
    with pytest.raises(ValueError, match="PAGEWIRE_LORA: --lora: expected NAME=PATH"):
        settings_from_args(p.parse_args(["m"]), environ={"PAGEWIRE_LORA": "oops"})
