"""Model-suggested sampling defaults (generation_config.json, GGUF general.sampling.*) are read as
vLLM reads them and fill exactly the fields a request leaves unset."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.engine.sampling_params import SamplingParams
from server.models import ModelLoadError
from server.models.generation_defaults import generation_defaults
from server.serving.jobs import GenerationSpec
from server.serving.prompts import PromptPreparer
from tests.gguf_files import write_gguf


def test_hf_generation_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 256,
         "eos_token_id": [1, 2], "repetition_penalty": None}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 256}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ModelLoadError, match=r"generation_config\.json: temperature"):
        generation_defaults(tmp_path)
    assert generation_defaults(tmp_path / "nothing-here") == {}


def test_gguf_sampling_metadata(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", tiny_model_dirs["llama"], extra_metadata={
        "general.sampling.temp": 0.7, "general.sampling.top_k": 40, "general.sampling.min_p": 0.05})
    got = generation_defaults(path)
    assert got == {"temperature": pytest.approx(0.7), "top_k": 40, "min_p": pytest.approx(0.05)}
    assert isinstance(got["top_k"], int)


def test_prompt_preparer_fills_only_unset_fields() -> None:
    class _Tok:
        vocab_size = 100

        def max_chars_per_token(self) -> int:
            return 16

    prep = PromptPreparer(_Tok(), sampling_defaults={"temperature": 0.6, "top_k": 20, "max_tokens": 50})  # type: ignore[arg-type]
    spec = GenerationSpec(kind="completion", api="http", client="c", model="m", prompt=[1, 2],
                          sampling={"temperature": 0.0})
    sp = prep.finalize(spec, n_prompt=2, max_model_len=1000)
    assert (sp.temperature, sp.top_k, sp.max_tokens) == (0.0, 20, 50)  # the request's temperature wins
    spec.default_max_tokens = 16  # an endpoint default (completions) still wins over the model's
    assert prep.finalize(spec, n_prompt=2, max_model_len=1000).max_tokens == 16
    assert PromptPreparer(_Tok()).finalize(spec, 2, 1000).top_k == SamplingParams().top_k  # type: ignore[arg-type]
