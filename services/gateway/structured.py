"""Structured output requests → one constraint for the engine, checked here so a bad one is a 400.

Accepted, as vLLM accepts them: OpenAI's `response_format` (`text`, `json_object`, `json_schema`),
vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields and its newer
`structured_outputs` object ({json | regex | choice | grammar}). At most one may be given.
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.errors import bad_request
from shared.model.grammar import GrammarCompiler, GrammarError
from shared.model.sampling_params import Constraint
from shared.protocol.messages import ConstraintMsg

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def request_constraint(req: Any) -> tuple[str, Constraint] | None:
    """(the field it came from, the constraint) of a request, or None for free text; 400 where the
    fields are malformed or more than one asks for structure."""
    found: list[tuple[str, Constraint]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        if (c := _response_format(fmt)) is not None:
            found.append(("response_format", c))
    for name, kind in _GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append((name, _constraint(kind, value, name)))
    outputs = getattr(req, "structured_outputs", None)
    if outputs is not None:
        given = [k for k in ("json", "regex", "choice", "grammar") if outputs.get(k) is not None]
        if len(given) != 1:
            raise bad_request("'structured_outputs' must set exactly one of json, regex, choice, grammar",
                              param="structured_outputs")
        found.append(("structured_outputs", _constraint(given[0], outputs[given[0]], f"structured_outputs.{given[0]}")))
    if len(found) > 1:
        raise bad_request(f"at most one structured output may be asked for; got {', '.join(f for f, _ in found)}",
                          param=found[1][0])
    return found[0] if found else None


def _response_format(fmt: dict[str, Any]) -> Constraint | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json", "")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("'response_format.json_schema' must be an object with a 'schema'",
                              param="response_format")
        schema = spec.get("schema", {"type": "object"})
        return _constraint("json", schema, "response_format.json_schema.schema")
    raise bad_request(f"'response_format.type' is {kind!r}; expected one of {list(_RESPONSE_FORMATS)}",
                      param="response_format")


def _constraint(kind: str, value: Any, name: str) -> Constraint:
    if kind == "json":
        if isinstance(value, str):
            return Constraint("json", value)
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"'{name}' must be a JSON schema (an object)", param=name.split(".")[0])
        return Constraint("json", json.dumps(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"'{name}' must be a non-empty list of non-empty strings", param=name.split(".")[0])
        return Constraint("choice", "", tuple(value))
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{name}' must be a non-empty string", param=name.split(".")[0])
    return Constraint(kind, value)


def combined_constraint(req: Any, tool_constraint: Constraint | None) -> tuple[str, Constraint] | None:
    """The request's one constraint, `tool_constraint` (what a forced tool_choice makes the model
    write) included; 400 where a forced call meets a structured output."""
    found = request_constraint(req)
    if tool_constraint is None:
        return found
    if found is not None:
        raise bad_request(f"'{found[0]}' cannot be combined with a tool_choice that forces a call", param=found[0])
    return "tools", tool_constraint


def checked_constraint(found: tuple[str, Constraint], compiler: GrammarCompiler) -> ConstraintMsg:
    """A constraint compiled once against the model's vocabulary (400 naming the error)."""
    field, c = found
    try:
        compiler.check(c)
    except GrammarError as exc:
        raise bad_request(f"'{field}' cannot be compiled: {exc}", param=field) from None
    return ConstraintMsg(kind=c.kind, spec=c.spec, choices=list(c.choices))
