"""Tokenizer behaves like transformers' fast tokenizer on the same folder: ids, text, chat prompts."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.models.demo_model import BOS_TOKEN, EOS_TOKEN, IM_END, build_tokenizer
from server.text.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "Hello world",
    " leading space and trailing space ",
    "Tabs\tand\nnew\n\nlines\r\n",
    "The café served crème brûlée; naïve façade.",
    "東京は晴れです。北京欢迎你。서울 날씨",
    "emoji: 🎉🚀 family 👨‍👩‍👧 flags 🇫🇷",
    "code: def f(x):\n    return x ** 2  # square",
    "numbers 1234567890 3.14159 -42 1,000,000",
    f"{BOS_TOKEN}special tokens inline{IM_END} and {EOS_TOKEN}",
    "Ω≈ç√∫˜µ≤≥÷ ¡™£¢∞§¶•ªº–≠ 𝕳𝖊𝖑𝖑𝖔",
    "   multiple    spaces   ",
]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there! 東京?"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": "two"}]},
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def ours(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="module")
def hf(demo_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(demo_dir))


def _copy_with_config(src: Path, dst: Path, **changes: object) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours: Tokenizer, hf, text: str) -> None:
    for special in (True, False):
        assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
    ids = ours.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_arbitrary_unicode_round_trips_like_transformers(ours: Tokenizer, hf, text: str) -> None:
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_vocabulary_views_match_transformers(ours: Tokenizer, hf) -> None:
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_id == hf.eos_token_id
    ids = ours.encode("Tokens like café and 🎉")
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.id_to_token(ids[1]) == hf.convert_ids_to_tokens(ids[1])
    assert ours.id_to_token(10**9) is None
    assert set(hf.all_special_ids) <= ours.all_special_ids
    assert ours.token_to_id(IM_END) in ours.all_special_ids


def test_eos_ids_come_from_generation_config(ours: Tokenizer) -> None:
    assert ours.eos_token_ids == {ours.token_to_id(EOS_TOKEN), ours.token_to_id(IM_END)}
    assert ours.model_max_length == 2048


def test_eos_ids_fall_back_to_config_json(demo_dir: Path, tmp_path: Path) -> None:
    d = _copy_with_config(demo_dir, tmp_path / "m", eos_token=None)
    (d / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    tok = Tokenizer.from_dir(d)
    assert tok.eos_token_ids == {3}
    assert tok.eos_token_id is None


@pytest.mark.parametrize("add_bos", [True, False])
def test_bos_follows_config_when_post_processor_adds_none(demo_dir: Path, tmp_path: Path, add_bos: bool) -> None:
    # A tokenizer.json whose post-processor adds nothing, plus add_bos_token and an AddedToken-dict
    # bos_token. (transformers 5 ignores add_bos_token whenever tokenizer.json exists; we honour it,
    # as transformers 4's Llama tokenizers did, but never add a second BOS.)
    d = _copy_with_config(
        demo_dir, tmp_path / "m", add_bos_token=add_bos,
        bos_token={"__type": "AddedToken", "content": BOS_TOKEN, "special": True},
    )
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(tj))
    tok = Tokenizer.from_dir(d)
    bos = tok.bos_token_id
    body = tok.encode("plain words", add_special_tokens=False)
    assert tok.encode("plain words") == ([bos] if add_bos else []) + body
    assert tok.encode("") == ([bos] if add_bos else [])
    assert tok.encode(f"{BOS_TOKEN}x").count(bos) == 1


@pytest.mark.parametrize("add_eos", [True, False])
def test_eos_follows_add_eos_token(demo_dir: Path, tmp_path: Path, add_eos: bool) -> None:
    # gte-Qwen2's tokenizer_config sets add_eos_token (its last-token pooling reads that EOS).
    d = _copy_with_config(demo_dir, tmp_path / "m", add_eos_token=add_eos, add_bos_token=False)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(tj))
    tok = Tokenizer.from_dir(d)
    eos = tok.eos_token_id
    assert eos is not None
    body = tok.encode("plain words", add_special_tokens=False)
    assert tok.encode("plain words") == body + ([eos] if add_eos else [])
    assert tok.encode(f"x{EOS_TOKEN}").count(eos) == 1
    assert tok.encode("plain words", add_special_tokens=False) == body  # chat prompts: never added
    bad = _copy_with_config(demo_dir, tmp_path / "bad", add_eos_token="yes")
    with pytest.raises(TokenizerError, match="add_eos_token"):
        Tokenizer.from_dir(bad)


def test_bos_from_post_processor_is_not_doubled(ours: Tokenizer, hf) -> None:
    # The demo tokenizer's post-processor adds BOS and its config sets add_bos_token too.
    for text in ["plain words", ""]:
        ids = ours.encode(text)
        assert ids == hf.encode(text)
        assert ids[0] == ours.bos_token_id and ids[1:2] != [ours.bos_token_id]
    # A BOS written in the text is text like any other (that is why chat prompts, whose template
    # writes BOS, are encoded with add_special_tokens=False), exactly as in transformers.
    assert ours.encode(f"{BOS_TOKEN}x") == hf.encode(f"{BOS_TOKEN}x")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours: Tokenizer, hf, add_generation_prompt: bool) -> None:
    got = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    want = hf.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert got == want
    assert got.startswith(BOS_TOKEN + "<|im_start|>system\n")
    assert got.endswith("<|im_start|>assistant\n") is add_generation_prompt


def test_chat_template_tools_render_as_plain_json_like_transformers(ours: Tokenizer, hf) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "description": "<b>&'quotes' ü"}}]
    got = ours.apply_chat_template(MESSAGES[:2], tools=tools)
    assert got == hf.apply_chat_template(MESSAGES[:2], tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"<b>&\'quotes\' ü"' in got  # tojson: no HTML escaping, no ASCII escaping


def test_none_valued_message_keys_are_dropped(ours: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "hi", "name": None}]
    assert ours.apply_chat_template(msgs) == ours.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_helpers_and_errors(ours: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    year = ours.apply_chat_template(msgs, chat_template="{{ strftime_now('%Y') }}")
    assert len(year) == 4 and year.isdigit()
    with pytest.raises(ChatTemplateError, match="only user roles"):
        ours.apply_chat_template(msgs, chat_template="{{ raise_exception('only user roles') }}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ours.apply_chat_template(msgs, chat_template="{% for %}")
    # The sandbox refuses attribute access to Python internals.
    with pytest.raises(ChatTemplateError):
        ours.apply_chat_template(msgs, chat_template="{{ messages.__class__.__mro__ }}")
    assert ours.apply_chat_template(
        msgs, chat_template="{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    ) == "hi"


def test_model_without_template_raises_clear_error(demo_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_copy_with_config(demo_dir, tmp_path / "m", chat_template=None))
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template; use /v1/completions or pass a template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="{{ messages[0].content }}") == "hi"


def test_named_templates_and_jinja_file(demo_dir: Path, tmp_path: Path) -> None:
    named = [{"name": "default", "template": "D{{ messages|length }}"},
             {"name": "tool_use", "template": "T{{ tools|length }}"}]
    tok = Tokenizer.from_dir(_copy_with_config(demo_dir, tmp_path / "a", chat_template=named))
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "D1"
    assert tok.apply_chat_template(msgs, tools=[{"a": 1}, {"b": 2}]) == "T2"
    assert tok.apply_chat_template(msgs, chat_template="tool_use", tools=[]) == "T0"
    only_tools = [{"name": "tool_use", "template": "T"}]
    tok2 = Tokenizer.from_dir(_copy_with_config(demo_dir, tmp_path / "b", chat_template=only_tools))
    with pytest.raises(ChatTemplateError, match="tool_use"):
        tok2.apply_chat_template(msgs)
    d = _copy_with_config(demo_dir, tmp_path / "c", chat_template=None)
    (d / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    assert Tokenizer.from_dir(d).apply_chat_template(msgs) == "Jhi"


def test_missing_or_malformed_files_name_the_path(demo_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not found"):
        Tokenizer.from_dir(tmp_path)
    d = _copy_with_config(demo_dir, tmp_path / "m")
    (d / "generation_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"generation_config\.json"):
        Tokenizer.from_dir(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "two"}))
    with pytest.raises(TokenizerError, match="eos_token_id"):
        Tokenizer.from_dir(d)
    _copy_with_config(demo_dir, d, bos_token=5)
    (d / "generation_config.json").unlink()
    with pytest.raises(TokenizerError, match="bos_token"):
        Tokenizer.from_dir(d)


@pytest.mark.parametrize("keep_end", [False, True])
def test_truncation_keeps_the_special_tokens_as_transformers_does(ours: Tokenizer, demo_dir: Path,
                                                                  keep_end: bool) -> None:
    # The demo tokenizer's post-processor puts BOS first; truncation cuts the text's own tokens
    # and keeps it, as transformers' `truncation=True, max_length=k` does from either side.
    from transformers import AutoTokenizer

    from server.serving.truncation import truncate_ids

    assert ours.special_ends() == (1, 0)
    hf_side = AutoTokenizer.from_pretrained(demo_dir, truncation_side="left" if keep_end else "right")
    text = "the quick brown fox jumps over the lazy dog, " * 4
    ids = ours.encode(text)
    for k in (2, 5, 17, len(ids) - 1, len(ids), len(ids) + 3):
        want = hf_side(text, truncation=True, max_length=k)["input_ids"]
        assert truncate_ids(ids, k, keep_end, *ours.special_ends()) == want, k


def test_special_ends_count_a_configured_eos(demo_dir: Path, tmp_path: Path) -> None:
    d = _copy_with_config(demo_dir, tmp_path / "m", add_eos_token=True)
    tok = Tokenizer.from_dir(d)
    assert tok.special_ends() == (1, 1)
    from server.serving.errors import InvalidRequest
    from server.serving.truncation import truncate_ids

    ids = tok.encode("one two three four five six")
    assert truncate_ids(ids, 4, keep_end=True, lead=1, trail=1) == ids[:1] + ids[-3:-1] + ids[-1:]
    with pytest.raises(InvalidRequest, match="leaves none of its text"):
        truncate_ids(ids, 2, keep_end=False, lead=1, trail=1, field="input[3]")
