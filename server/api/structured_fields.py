"""The structured-output fields of a request, read into one StructuredOutputsParams.

Clients name a constraint in one of three ways, all accepted on both HTTP endpoints and in
WebSocket `params`:
  - OpenAI's `response_format`: `{"type": "json_object"}` or
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (`text` = none);
  - vLLM's `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`;
  - vLLM's older names: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
    (and `guided_decoding_backend`, accepted and ignored: llguidance serves every request).
At most one of them may be set. The result carries the wire name of the field it came from
(`field_names`), so an error found later (llguidance's compile at admission) names that field.
"""
from __future__ import annotations

from typing import Any, Optional

from server.api.protocol import SamplingFields
from server.engine.sampling_params import SamplingParamsError, StructuredOutputsParams
from server.serving.errors import InvalidRequest

_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))
# vLLM options with nothing to do here: no fallback backend exists, and JSON never gets free
# whitespace (server.engine.grammar.JSON_DEFAULTS), which is what disable_any_whitespace asks.
_IGNORED_KEYS = ("disable_fallback", "disable_any_whitespace")
_INTERNAL = "structured_outputs"


def _response_format(rf: dict[str, Any], name: str) -> tuple[Optional[dict[str, Any]], str]:
    """(constraint kwargs or None, the field to name in errors) for a `response_format` object."""
    kind = rf.get("type", "text")
    if kind == "text":
        return None, name
    if kind == "json_object":
        return {"json_object": True}, name
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequest(f"{name}.json_schema: must be an object with a 'schema'",
                                 param=f"{name}.json_schema")
        if "schema" not in js:
            raise InvalidRequest(f"{name}.json_schema.schema: is required", param=f"{name}.json_schema.schema")
        if "name" in js and not isinstance(js["name"], str):
            raise InvalidRequest(f"{name}.json_schema.name: must be a string", param=f"{name}.json_schema.name")
        if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
            raise InvalidRequest(f"{name}.json_schema.strict: must be a boolean", param=f"{name}.json_schema.strict")
        # strict or not, the schema is enforced: the grammar is the only way output is produced.
        return {"json": js["schema"]}, f"{name}.json_schema.schema"
    raise InvalidRequest(f"{name}.type: must be one of 'text', 'json_object', 'json_schema', got {kind!r}",
                         param=f"{name}.type")


def structured_outputs(fields: SamplingFields, response_format: Optional[dict[str, Any]],
                       prefix: str = "") -> tuple[Optional[StructuredOutputsParams], dict[str, str]]:
    """The request's constraint (None if it has none) and the map from the internal field names
    (`structured_outputs`, `structured_outputs.<kind>`) to the wire's. Raises InvalidRequest
    naming the field for a malformed or doubled constraint."""
    found: list[tuple[str, dict[str, Any], str]] = []  # (source field, kwargs, error field)
    if response_format is not None:
        kw, err_field = _response_format(response_format, prefix + "response_format")
        if kw is not None:
            found.append((prefix + "response_format", kw, err_field))
    so = fields.structured_outputs
    if so is not None:
        name = prefix + "structured_outputs"
        kw = {k: v for k, v in so.items() if k not in _IGNORED_KEYS}
        found.append((name, kw, ""))
    for wire, kind in _GUIDED:
        value = getattr(fields, wire)
        if value is not None:
            found.append((prefix + wire, {kind: value}, prefix + wire))
    if not found:
        return None, {}
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise InvalidRequest(f"{second}: cannot be combined with {first}; give one constraint",
                             param=second)
    source, kw, err_field = found[0]
    if err_field:  # every internal name maps to the one wire field
        names = {_INTERNAL: err_field, **{f"{_INTERNAL}.{k}": err_field for k in kw}}
    else:
        names = {_INTERNAL: source, **{f"{_INTERNAL}.{k}": f"{source}.{k}" for k in kw}}
        names.update({f"{_INTERNAL}.{k}": f"{source}.{k}" for k in
                      ("json", "regex", "choice", "grammar", "json_object")})
    try:
        params = StructuredOutputsParams.from_value(kw)
    except SamplingParamsError as e:
        wire = names.get(e.field, e.field.replace(_INTERNAL, source, 1))
        raise InvalidRequest(f"{wire}: {e.message}", param=wire) from None
    except TypeError as e:
        raise InvalidRequest(f"{source}: {e}", param=source) from None
    return params, names
