"""Tokenizer: text <-> token ids and chat-template rendering for one Hugging Face model folder
(or a GGUF file, via `server.text.gguf_tokenizer`).

Torch-free (the network edge imports it). Built on the `tokenizers` library plus the folder's
tokenizer_config.json / generation_config.json / config.json, so it behaves like transformers'
fast tokenizer without importing transformers. Chat templates render in jinja2's immutable
sandbox with the same globals and filters transformers provides, because templates from the Hub
are untrusted code written against that environment.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

from server.jsonfile import read_json_object
from server.text.byte_stream import BytePieces, ByteStream, is_byte_level

# transformers stores "no limit" as int(1e30); anything this large means the config did not say.
_UNSET_MAX_LENGTH = 10**12
_NO_TEMPLATE_MESSAGE = (
    "this model has no chat template; use /v1/completions or pass a template"
)


class TokenizerError(ValueError):
    """A model folder's tokenizer files are missing or malformed; the message names the file."""


class ChatTemplateError(ValueError):
    """The chat template is missing, unknown by name, or failed while rendering."""


def _read_json(path: Path) -> dict[str, Any]:
    """Read an optional JSON object file; a missing file is an empty dict, a malformed one an error."""
    if not path.is_file():
        return {}
    return read_json_object(path, TokenizerError)


def _token_content(value: Any, field: str, path: Path) -> Optional[str]:
    """A special token in tokenizer_config.json is a string or an AddedToken dict with `content`."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{path}: {field} must be a string or an object with 'content', got {value!r}")


def _eos_ids(value: Any, field: str, path: Path) -> list[int]:
    """eos_token_id in generation_config.json / config.json is an int or a list of ints."""
    if value is None:
        return []
    if isinstance(value, bool):
        raise TokenizerError(f"{path}: {field} must be an integer or a list of integers, got {value!r}")
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise TokenizerError(f"{path}: {field} must be an integer or a list of integers, got {value!r}")


class _GenerationTagExtension(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (used by some templates to mark assistant
    spans for training masks) and render its body unchanged; serving never needs the mask."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Optional[int] = None,
    separators: Optional[tuple[str, str]] = None,
    sort_keys: bool = False,
) -> str:
    # jinja's built-in tojson HTML-escapes '<', '>' and '&'; templates expect plain JSON, as in HF.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _load_chat_templates(
    model_dir: Path, config: dict[str, Any], config_path: Path
) -> dict[str, str] | str | None:
    """Collect the folder's chat template(s): a single string, a name -> template dict, or None.

    Newer transformers save the default template as chat_template.jinja and named extras under
    additional_chat_templates/; older ones keep them in tokenizer_config.json (a string or a
    list of {"name", "template"}); processors used chat_template.json. The .jinja file wins,
    as in transformers.
    """
    named: dict[str, str] = {}
    single: Optional[str] = None
    raw = config.get("chat_template")
    if isinstance(raw, str):
        single = raw
    elif isinstance(raw, list):
        for i, entry in enumerate(raw):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise TokenizerError(
                    f"{config_path}: chat_template[{i}] must be an object with string 'name' and 'template'"
                )
            named[entry["name"]] = entry["template"]
    elif raw is not None:
        raise TokenizerError(f"{config_path}: chat_template must be a string or a list of named templates")
    legacy = _read_json(model_dir / "chat_template.json").get("chat_template")
    if single is None and not named and isinstance(legacy, str):
        single = legacy
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        single = jinja_file.read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            named[f.stem] = f.read_text(encoding="utf-8")
    if named:
        if single is not None:
            named.setdefault("default", single)
        return named
    return single


class Tokenizer:
    """A model's tokenizer. Build with `Tokenizer.from_dir(model_dir)`.

    Thread-safe for concurrent encode/decode (the Rust backend is); chat template compilation is
    cached per instance.
    """

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        bos_token: Optional[str] = None,
        eos_token: Optional[str] = None,
        pad_token: Optional[str] = None,
        unk_token: Optional[str] = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: dict[str, str] | str | None = None,
        model_max_length: Optional[int] = None,
        extra_eos_token_ids: Iterable[int] = (),
        name: str = "",
    ) -> None:
        self._tok = backend
        # Truncation/padding baked into tokenizer.json would silently cut prompts; length checks
        # belong to admission, which must see the true count.
        self._tok.no_truncation()
        self._tok.no_padding()
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.bos_token_id = self.token_to_id(bos_token)
        self.eos_token_id = self.token_to_id(eos_token)
        self.pad_token_id = self.token_to_id(pad_token)
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        # gte-Qwen2's tokenizer_config asks for EOS after every text, which its last-token pooling
        # reads; transformers appends it, so encode does too.
        self.add_eos_token = add_eos_token and self.eos_token_id is not None
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        eos = set(extra_eos_token_ids)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        for tid in (self.bos_token_id, self.eos_token_id, self.pad_token_id, self.token_to_id(unk_token)):
            if tid is not None:
                special.add(tid)
        self.all_special_ids: frozenset[int] = frozenset(special)
        self._jinja: Optional[ImmutableSandboxedEnvironment] = None
        self._compiled: dict[str, jinja2.Template] = {}
        self._chars_per_token: Optional[int] = None  # max_chars_per_token, computed on first use
        self._special_ends: Optional[tuple[int, int]] = None  # special_ends, computed on first use
        self._byte_level = is_byte_level(backend)  # decode_stream's ByteStream
        self._pieces: dict[bool, BytePieces] = {}  # per skip_special_tokens, built on first use

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load the tokenizer of a Hugging Face model folder.

        Raises TokenizerError naming the file when tokenizer.json is missing or any config is malformed.
        """
        d = Path(model_dir)
        tok_path = d / "tokenizer.json"
        if not tok_path.is_file():
            raise TokenizerError(f"{tok_path}: not found (pagewire needs a fast tokenizer's tokenizer.json)")
        try:
            backend = _BackendTokenizer.from_file(str(tok_path))
        except Exception as e:  # the Rust loader raises a bare Exception on malformed files
            raise TokenizerError(f"{tok_path}: cannot load ({e})") from None
        cfg_path = d / "tokenizer_config.json"
        cfg = _read_json(cfg_path)
        gen_path = d / "generation_config.json"
        model_cfg_path = d / "config.json"
        eos_ids = _eos_ids(_read_json(gen_path).get("eos_token_id"), "eos_token_id", gen_path)
        if not eos_ids:
            eos_ids = _eos_ids(_read_json(model_cfg_path).get("eos_token_id"), "eos_token_id", model_cfg_path)
        max_len = cfg.get("model_max_length")
        if not isinstance(max_len, (int, float)) or isinstance(max_len, bool) or max_len >= _UNSET_MAX_LENGTH:
            max_len = None
        add_bos = cfg.get("add_bos_token", False)
        if not isinstance(add_bos, bool):
            raise TokenizerError(f"{cfg_path}: add_bos_token must be true or false, got {add_bos!r}")
        add_eos = cfg.get("add_eos_token", False)
        if not isinstance(add_eos, bool):
            raise TokenizerError(f"{cfg_path}: add_eos_token must be true or false, got {add_eos!r}")
        return cls(
            backend,
            bos_token=_token_content(cfg.get("bos_token"), "bos_token", cfg_path),
            eos_token=_token_content(cfg.get("eos_token"), "eos_token", cfg_path),
            pad_token=_token_content(cfg.get("pad_token"), "pad_token", cfg_path),
            unk_token=_token_content(cfg.get("unk_token"), "unk_token", cfg_path),
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            chat_template=_load_chat_templates(d, cfg, cfg_path),
            model_max_length=int(max_len) if max_len is not None else None,
            extra_eos_token_ids=eos_ids,
            name=str(d),
        )

    # -- ids <-> text ----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`.

        With add_special_tokens, the tokenizer's own post-processor runs (e.g. Llama 3 adds BOS
        there); BOS is prepended only if tokenizer_config asks for it and it is not already first,
        and EOS appended likewise (`add_eos_token`) unless it is already last.
        Special-token strings inside `text` (e.g. "<|im_start|>") map to their ids, as in HF.
        """
        if len(text) >= GIL_FREE_CHARS:
            # The batch path releases the GIL while Rust works (`encode` holds it throughout),
            # so the event loop keeps running while a long prompt is tokenised on another thread.
            ids: list[int] = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
        if add_special_tokens and self.add_eos_token and (not ids or ids[-1] != self.eos_token_id):
            ids.append(self.eos_token_id)  # type: ignore[arg-type]
        return ids

    def special_ends(self) -> tuple[int, int]:
        """How many special tokens `encode` puts before and after a text's own tokens (a BOS from
        the post-processor or add_bos_token; an EOS likewise): what truncation keeps in place."""
        if self._special_ends is None:
            bare = self.encode("a", add_special_tokens=False)
            full = self.encode("a")
            lead = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
            self._special_ends = (lead, len(full) - len(bare) - lead)
        return self._special_ends

    def max_chars_per_token(self) -> Optional[int]:
        """The most characters of input text one token can stand for, or None when this
        tokenizer's pipeline gives no such bound (a normalizer or pre-tokenizer that can delete
        characters: whitespace splitting, strip, regex replacements). Admission refuses a prompt
        whose character count alone proves it cannot fit the context, without tokenising it.

        A token's vocabulary string has at least as many characters as the text it covers
        (byte-level BPE spells each byte as one character; SentencePiece spells a space as one
        `▁`), so the longest vocabulary string bounds it, times what the normalizer can
        compress (NFC/NFKC compose at most a few code points into one)."""
        if self._chars_per_token is None:
            self._chars_per_token = _chars_per_token_bound(self._tok) or -1
        return self._chars_per_token if self._chars_per_token > 0 else None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for `ids`. No clean-up of spaces before punctuation: that step corrupts BPE output
        (transformers 5 skips it for BPE too) and would make streamed text differ from full text."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context: Sequence[int],
                      skip_special_tokens: bool = True) -> Optional[Callable[[list[int]], Optional[str]]]:
        """A streaming decoder primed with `context` (ids whose text was already shown, ending on a
        character boundary): each call with new ids returns only their new text, or None while
        there is none or it ends in U+FFFD (a character still incomplete).

        A byte-level tokenizer gets a ByteStream (server/text/byte_stream.py: a table lookup and
        an incremental UTF-8 decoder per token); any other the tokenizers library's DecodeStream
        (the same prefix-window technique as IncrementalDetokenizer, in one Rust call per step
        instead of two decodes from Python), or None when this tokenizers release has none
        (before 0.21)."""
        if self._byte_level:  # one table lookup a token (server/text/byte_stream.py says why)
            pieces = self._pieces.get(skip_special_tokens)
            if pieces is None:
                pieces = self._pieces[skip_special_tokens] = BytePieces(self._tok, skip_special_tokens)
            return ByteStream(pieces)
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:
            return None
        stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        backend = self._tok
        return lambda ids: stream.step(backend, ids)

    def token_to_id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        """The vocabulary string of one id (byte-level form, e.g. 'Ġthe'), or None if out of range."""
        return self._tok.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[Optional[str]]:
        return [self._tok.id_to_token(i) for i in ids]

    # -- chat templates --------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def _select_template(self, chat_template: Optional[str], tools: Optional[list[Any]]) -> str:
        """Pick the template source like transformers: an explicit template (or template name) wins;
        with several named templates use 'tool_use' when tools are given, else 'default'."""
        if isinstance(self.chat_template, dict):
            if chat_template is not None:
                return self.chat_template.get(chat_template, chat_template)
            if tools is not None and "tool_use" in self.chat_template:
                return self.chat_template["tool_use"]
            if "default" in self.chat_template:
                return self.chat_template["default"]
            raise ChatTemplateError(
                "this model has several chat templates and none is named 'default'; pass one of: "
                + ", ".join(sorted(self.chat_template))
            )
        if chat_template is not None:
            return chat_template
        if not self.chat_template:
            raise ChatTemplateError(_NO_TEMPLATE_MESSAGE)
        return self.chat_template

    def template_source(self, tools: Optional[list[Any]] = None, chat_template: Optional[str] = None) -> str:
        """The source of the template `apply_chat_template` would use (ChatTemplateError if none)."""
        return self._select_template(chat_template, tools)

    def _compile(self, source: str) -> jinja2.Template:
        tpl = self._compiled.get(source)
        if tpl is None:
            if self._jinja is None:
                env = ImmutableSandboxedEnvironment(
                    trim_blocks=True,
                    lstrip_blocks=True,
                    extensions=[_GenerationTagExtension, jinja2.ext.loopcontrols],
                )
                env.filters["tojson"] = _tojson
                env.globals["raise_exception"] = _raise_exception
                env.globals["strftime_now"] = _strftime_now
                self._jinja = env
            try:
                tpl = self._jinja.from_string(source)
            except jinja2.exceptions.TemplateError as e:
                raise ChatTemplateError(f"chat template does not compile: {e}") from None
            self._compiled[source] = tpl
        return tpl

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Optional[list[dict[str, Any]]] = None,
        chat_template: Optional[str] = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text with the model's chat template.

        Args:
            messages: [{"role": ..., "content": ...}, ...]; keys whose value is None are dropped
                (as transformers does), since templates test key presence.
            add_generation_prompt: append the assistant header so the model answers next.
            tools: JSON-schema tool definitions, passed to the template as `tools`.
            chat_template: a template source, or the name of one of the model's named templates.
            **kwargs: extra template variables; they override the special-token variables.
        Returns:
            The rendered prompt. Encode it with add_special_tokens=False: templates add BOS themselves.
        Raises:
            ChatTemplateError: no template, unknown name, or the template raised/failed.
        """
        source = self._select_template(chat_template, tools)
        template = self._compile(source)
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ChatTemplateError("messages must be a list of objects")
        cleaned = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables: dict[str, Any] = {
            name: value
            for name, value in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("unk_token", self.unk_token),
                ("pad_token", self.pad_token),
            )
            if value is not None
        }
        variables.update(kwargs)
        try:
            return template.render(
                messages=cleaned,
                tools=tools,
                documents=variables.pop("documents", None),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, IndexError,
                AttributeError) as e:
            # A template is untrusted code run on client data: any failure inside it (raise_exception,
            # adding a list to a string, ...) means this conversation does not fit it, not a server bug.
            raise ChatTemplateError(f"chat template error: {e}") from None


# Texts this long are encoded through the GIL-releasing batch path (see Tokenizer.encode).
GIL_FREE_CHARS = 2048

# How many characters a normalizer may turn into one (None: it may delete characters). NFC and
# NFKC compose a base and its combining marks (or a Hangul syllable's jamo) into one code point;
# 4 is above any composition Unicode has.
_NORMALIZER_COMPRESSION = {"NFD": 1, "NFKD": 1, "NFC": 4, "NFKC": 4, "Lowercase": 1, "Prepend": 1,
                           "BertNormalizer": None, "Strip": None, "StripAccents": None, "Precompiled": None,
                           "Nmt": None}
# Pre-tokenizers that keep every character (others, like Whitespace, drop some).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}


def _normalizer_factor(spec: Optional[dict[str, Any]]) -> Optional[float]:
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        f = 1.0
        for part in spec.get("normalizers", []):
            g = _normalizer_factor(part)
            if g is None:
                return None
            f *= g
        return f
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}), spec.get("content", "")
        if "String" not in pattern or not content:
            return None
        return max(1.0, len(pattern["String"]) / len(content))
    factor = _NORMALIZER_COMPRESSION.get(str(kind))
    return None if factor is None else float(factor)


def _pre_tokenizer_keeps_all(spec: Optional[dict[str, Any]]) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_all(p) for p in spec.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _chars_per_token_bound(backend: _BackendTokenizer) -> Optional[int]:
    """See Tokenizer.max_chars_per_token."""
    try:
        pipeline = json.loads(backend.to_str())
    except (ValueError, TypeError):
        return None
    factor = _normalizer_factor(pipeline.get("normalizer"))
    if factor is None or not _pre_tokenizer_keeps_all(pipeline.get("pre_tokenizer")):
        return None
    longest = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=0)
    return int(longest * factor + 0.999) if longest else None
