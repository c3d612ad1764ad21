"""Structured output: OpenAI's ``response_format``, which QLM passes to vLLM untouched, and the
documents the simulated engine writes for it (docs/api.md, "Structured output").

vLLM enforces a format with a grammar over the tokens it generates (xgrammar or guidance): the
answer is a JSON document, of the given schema for ``json_schema``. The grammar starts at the
answer's first token, so a partial answer cannot be continued — sent back as the start of the
assistant's message it would be followed by a whole new document. A request with a format is
therefore never resumed: evicted, or lost with its instance, it starts over (``resumable``).

The simulated engine has no model to constrain. It writes a document the format allows (an
instance of the schema), token by token, and grows its strings' words so that the document ends
at the output length it drew for the request; a schema with no string to grow ends the document
at its smallest size, as a grammar would end the answer. It follows ``type``, ``properties``
(all of them, in order), ``items`` and ``minItems``, ``enum``, ``const``, ``anyOf``/``oneOf``
(the first), ``$ref`` inside the schema and ``minimum``; past a nesting of ``SPARE_DEPTH`` only
what is required (so a recursive schema has a finite document), at most ``MAX_ITEMS`` array
items. A schema it cannot write for is the request's fault (vLLM answers 400 when its grammar
backend cannot compile one), never the instance's. Other keywords (``pattern``, ``format``,
``maxLength``, ...) are not honoured (docs/engines.md).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FORMAT_TYPES = ("text", "json_object", "json_schema")
MAX_DEPTH = 16
"""Nesting (and ``$ref`` hops) the simulated engine follows before refusing the schema."""
SPARE_DEPTH = 4
"""Below this nesting the documents also hold optional properties and one item of arrays."""
MAX_ITEMS = 1000
"""The most array items (``minItems``) the simulated engine writes."""
WORD = "tok"  # the simulated engine's output token (``qlm.engines.wallclock.FILLER_TOKEN``)


def resumable(sampling: Mapping[str, Any]) -> bool:
    """Whether a partial answer of a request with these parameters can be continued: not when
    a response format constrains it (module docstring), nor when it may call tools (a call
    half written cannot be handed back to the model as text to go on from)."""
    fmt = sampling.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type", "text") != "text":
        return False
    return not sampling.get("tools") or sampling.get("tool_choice") == "none"


def planned_call(
    sampling: Mapping[str, Any], messages: Sequence[Mapping[str, Any]] | None
) -> Mapping[str, Any] | None:
    """The function the simulated model calls, or ``None`` to answer in text. With ``tools``
    and a ``tool_choice`` other than ``none``: the named function, or the first tool — under
    ``auto`` (the default) only when the conversation does not end with a tool's answer (then
    the model answers in text, as an agent loop expects)."""
    tools = sampling.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    choice = sampling.get("tool_choice", "auto")
    if choice == "none":
        return None
    functions = [t.get("function", {}) for t in tools if isinstance(t, Mapping)]
    if isinstance(choice, Mapping):
        name = choice.get("function", {}).get("name")
        return next((f for f in functions if f.get("name") == name), None)
    if choice == "auto" and messages and messages[-1].get("role") == "tool":
        return None
    return functions[0] if functions else None


def call_pieces(function: Mapping[str, Any], target: int) -> list[str]:
    """The arguments of a call of ``function``: a JSON document of its ``parameters`` schema,
    as ``document_pieces`` writes it."""
    schema = function.get("parameters") or {"type": "object", "properties": {}}
    fmt = {"type": "json_schema", "json_schema": {"name": "arguments", "schema": schema}}
    return document_pieces(fmt, target)


class SchemaUnsupported(ValueError):
    """A schema the simulated engine cannot write a document for; the text says why."""


@dataclass(frozen=True, slots=True)
class _Slot:
    """A string's words: one at least, more to reach the document's length."""


_SLOT = _Slot()


def document_pieces(response_format: Mapping[str, Any], target: int) -> list[str]:
    """A JSON document ``response_format`` allows, as the text of each of its tokens: exactly
    ``target`` tokens when its strings can grow to that, else its smallest size (more than
    ``target`` when even that is longer)."""
    kind = response_format.get("type", "text")
    if kind == "json_object":
        schema: Mapping[str, Any] = {"type": "object", "properties": {"answer": {"type": "string"}}}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, Mapping) else {}
    else:
        raise SchemaUnsupported(f"response_format type {kind!r} is not a JSON format")
    skeleton: list[str | _Slot] = []
    _emit(schema, schema, skeleton, 0)
    slots = sum(1 for p in skeleton if p is _SLOT)
    words = [1] * slots
    extra = max(0, target - (len(skeleton) - slots) - 3 * slots)
    for i in range(extra if slots else 0):
        words[i % slots] += 1
    pieces: list[str] = []
    k = 0
    for p in skeleton:
        if isinstance(p, _Slot):
            pieces += ['"', WORD] + [" " + WORD] * (words[k] - 1) + ['"']
            k += 1
        else:
            pieces.append(p)
    return pieces


def _resolve(root: Mapping[str, Any], ref: str) -> Mapping[str, Any]:
    if ref == "#":
        return root
    for prefix in ("#/$defs/", "#/definitions/"):
        if ref.startswith(prefix):
            target = root.get(prefix[2:-1], {}).get(ref[len(prefix) :])
            if isinstance(target, Mapping):
                return target
    raise SchemaUnsupported(f"$ref {ref!r} is not a local definition ($defs or definitions)")


def _emit(schema: Any, root: Mapping[str, Any], out: list[str | _Slot], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise SchemaUnsupported(f"the schema nests deeper than {MAX_DEPTH} levels")
    if schema is True or schema == {} or not isinstance(schema, Mapping):
        out.append(_SLOT)  # anything goes: a string
        return
    if "$ref" in schema:
        _emit(_resolve(root, str(schema["$ref"])), root, out, depth + 1)
        return
    if "const" in schema:
        out.append(json.dumps(schema["const"]))
        return
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        out.append(json.dumps(schema["enum"][0]))
        return
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            _emit(schema[key][0], root, out, depth + 1)
            return
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    # Past SPARE_DEPTH only what the schema requires is written (required properties, minItems),
    # so that a recursive schema (a tree of nodes) still has a finite document.
    spare = depth < SPARE_DEPTH
    if kind == "object":
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        out.append("{")
        written = 0
        for name, sub in props.items():
            if not spare and name not in required:
                continue
            out.append(("" if written == 0 else ", ") + json.dumps(name) + ": ")
            _emit(sub, root, out, depth + 1)
            written += 1
        out.append("}")
    elif kind == "array":
        least = schema.get("minItems", 0)
        if not isinstance(least, int) or isinstance(least, bool) or least < 0:
            raise SchemaUnsupported(f"minItems must be a non-negative integer, got {least!r}")
        if least > MAX_ITEMS:
            raise SchemaUnsupported(f"minItems {least} is more than the {MAX_ITEMS} it writes")
        count = max(1, least) if spare else least
        out.append("[")
        for i in range(count):
            if i:
                out.append(", ")
            _emit(schema.get("items", {}), root, out, depth + 1)
        out.append("]")
    elif kind == "string":
        out.append(_SLOT)
    elif kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", 0))
        value = low if isinstance(low, int | float) and not isinstance(low, bool) else 0
        if "exclusiveMinimum" in schema and "minimum" not in schema:
            value += 1
        out.append(str(math.ceil(value)) if kind == "integer" else json.dumps(float(value)))
    elif kind == "boolean":
        out.append("true")
    elif kind == "null":
        out.append("null")
    else:
        raise SchemaUnsupported(f"unknown JSON Schema type {kind!r}")


_TYPES = frozenset(("object", "array", "string", "integer", "number", "boolean", "null"))
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def schema_problem(schema: Any, path: str = "", depth: int = 0) -> str | None:
    """What makes ``schema`` no JSON Schema a server could compile, with where (a JSON pointer
    into it), or ``None``. A shape check — the keywords' types, known ``type`` names, local
    ``$ref`` — not a metaschema validation: vLLM's backend has the last word."""
    where = path or "/"
    if depth > 64:
        return f"{where}: nested deeper than 64 levels"
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, Mapping):
        return f"{where}: a schema must be an object or a boolean"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if k not in _TYPES:
            return f"{path}/type: {k!r} is not a JSON Schema type ({', '.join(sorted(_TYPES))})"
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        return f"{path}/$ref: only references inside the schema (#, #/$defs/...) are resolved"
    for key in ("minItems", "maxItems", "minLength", "maxLength"):
        bound = schema.get(key)
        if bound is not None and (
            not isinstance(bound, int) or isinstance(bound, bool) or bound < 0
        ):
            return f"{path}/{key}: must be a non-negative integer"
    required = schema.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        return f"{path}/required: must be a list of property names"
    if "enum" in schema and not (isinstance(schema["enum"], list) and schema["enum"]):
        return f"{path}/enum: must be a non-empty list"
    for key in _SCHEMA_MAPS:
        if key in schema:
            sub = schema[key]
            if not isinstance(sub, Mapping):
                return f"{path}/{key}: must be an object of schemas"
            for name, s in sub.items():
                problem = schema_problem(s, f"{path}/{key}/{name}", depth + 1)
                if problem:
                    return problem
    for key in _SCHEMA_LISTS:
        if key in schema:
            sub = schema[key]
            if not isinstance(sub, list) or not sub:
                return f"{path}/{key}: must be a non-empty list of schemas"
            for i, s in enumerate(sub):
                problem = schema_problem(s, f"{path}/{key}/{i}", depth + 1)
                if problem:
                    return problem
    for key in ("items", "additionalProperties", "not"):
        if key in schema:
            problem = schema_problem(schema[key], f"{path}/{key}", depth + 1)
            if problem:
                return problem
    return None
