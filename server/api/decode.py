"""Turning request bytes into protocol Structs, with errors that name the offending field.

msgspec's strict JSON parser rejects `NaN`/`Infinity`, which Python's `json` module (and so
many clients) happily emit. Rejecting those bodies as "invalid JSON" would hide which field was
wrong, so a body msgspec cannot parse is re-read with the lenient stdlib parser; if that
succeeds the object is converted with msgspec, whose constraints then name the field
(`temperature: must be a finite number`).

Every parsed document is then checked in one iterative walk (`_check_document`), so hostile
shapes get a 400 naming the field instead of a 500 deeper in the server: nesting deeper than
MAX_DEPTH (a recursive walk, or the JSON parsers themselves, would hit Python's recursion
limit), NaN/Infinity, and lone UTF-16 surrogates (`"\\ud800"` is valid JSON but not text; the
tokenizer and SQLite would fail on it later).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

import msgspec

from server.serving.errors import InvalidRequest

T = TypeVar("T")

_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")
_decoder = msgspec.json.Decoder()

# No request of this API nests anywhere near this deep (a chat message's content part is 4).
MAX_DEPTH = 64


def parse_json(body: bytes | str) -> Any:
    """Parse a JSON document into Python objects; NaN/Infinity are accepted here and rejected
    later by the field constraints, so the error can name the field."""
    if not body:
        raise InvalidRequest("request body is empty; expected a JSON object", code="invalid_json")
    try:
        return _decoder.decode(body)
    except RecursionError:
        raise _too_deep(_deep_field(body)) from None
    except msgspec.DecodeError as exc:
        try:
            return json.loads(body)
        except RecursionError:
            raise _too_deep(_deep_field(body)) from None
        except (ValueError, UnicodeDecodeError):
            raise InvalidRequest(f"invalid JSON: {exc}", code="invalid_json") from None


def _too_deep(field: str | None) -> InvalidRequest:
    where = f"{field}: " if field else ""
    return InvalidRequest(f"{where}JSON nested deeper than {MAX_DEPTH} levels", param=field,
                          code="invalid_json")


def _deep_field(body: bytes | str) -> str | None:
    """The top-level key whose value nests too deep, found by scanning the raw text (the parsers
    themselves gave up): brackets outside strings change the depth; the key is the last string
    seen at depth 1 before a ':'."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    depth = 0
    i, n = 0, len(text)
    last_str: str | None = None
    key: str | None = None
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            last_str = text[i + 1 : j]
            i = j + 1
            continue
        if c == ":" and depth == 1:
            key = last_str
        elif c in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return key if key is not None else None
        elif c in "]}":
            depth -= 1
        i += 1
    return key


def _field_of(message: str) -> tuple[str | None, str]:
    """Split msgspec's "Expected `int`, got `str` - at `$.params.max_tokens`" into (field, text).

    A missing field is named by the message itself ("Object missing required field `id`"), so
    its name is appended to the path of the object that lacks it.
    """
    m = _PATH.search(message)
    path = (m.group(1) or None) if m else None
    text = message[: m.start()] if m else message
    missing = _MISSING.search(text)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
        text = "is required"
    return path, text


def _join(prefix: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    return f"{prefix}.{key}" if prefix else str(key)


def _has_surrogate(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_document(obj: Any) -> None:
    """Raise InvalidRequest naming the first field that nests too deep, is NaN/Infinity, or holds
    a lone surrogate. Iterative, so it cannot itself overflow the stack."""
    stack: list[tuple[Any, str, int]] = [(obj, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                name = path or "$"
                raise InvalidRequest(f"{name}: contains a lone UTF-16 surrogate, which is not valid text",
                                     param=name)
        elif isinstance(value, float):
            if not math.isfinite(value):
                name = path or "$"
                raise InvalidRequest(f"{name}: must be a finite number", param=name)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                top = path.split(".")[0].split("[")[0] or None
                raise _too_deep(top)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            children = []
            for k, v in items:
                if isinstance(k, str) and _has_surrogate(k):
                    raise InvalidRequest(f"{_join(path, '?')}: a key contains a lone UTF-16 surrogate",
                                         param=path or None)
                if isinstance(v, (str, float, dict, list)):
                    children.append((v, _join(path, k), depth + 1))
            stack.extend(reversed(children))  # keep document order: the first bad field is named


def convert(obj: Any, typ: type[T]) -> T:
    """Validate a parsed document against a Struct; raise InvalidRequest naming the field."""
    if not isinstance(obj, dict):
        raise InvalidRequest(
            f"expected a JSON object, got {type(obj).__name__}", code="invalid_request"
        )
    _check_document(obj)
    try:
        return msgspec.convert(obj, typ, strict=True)
    except msgspec.ValidationError as exc:
        field, text = _field_of(str(exc))
        msg = f"{field}: {text}" if field else text
        raise InvalidRequest(msg, param=field) from None


def decode(body: bytes | str, typ: type[T]) -> T:
    """parse_json + convert."""
    return convert(parse_json(body), typ)
