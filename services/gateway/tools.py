"""Tool calling: OpenAI's `tools` + `tool_choice` in, `tool_calls` out.

In: the tools are rendered by the model's chat template where it takes a `tools` variable; otherwise
(SmolLM2's template has none) the Hermes convention, which SmolLM2 and Qwen were trained on, is
written into the system message: the function signatures inside <tools></tools>, and each call
answered as <tool_call>{"name": …, "arguments": {…}}</tool_call>. Earlier assistant tool calls and
`tool` results in the conversation are written the same way.

Out: `tool_choice` "auto" parses the model's text for <tool_call> blocks (streamed: text before a
block streams as content, a block is sent as one tool-call delta once it closes). A named function
forces its parameters' JSON schema on the output, which *is* the call's arguments (streamed as
argument deltas); "required" forces a JSON array of calls, each {"name", "arguments"} of one of the
tools. "none" renders no tools. A call that does not parse is returned as content, never dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.errors import bad_request
from shared.model.sampling_params import Constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>"
)


@dataclass
class ToolRequest:
    tools: list[dict[str, Any]]  # OpenAI's tool objects, validated: {"type": "function", "function": {...}}
    choice: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls: False keeps only the first call

    @property
    def functions(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    def constraint(self) -> Constraint | None:
        """What a forced choice makes the model write (None: free text)."""
        if self.choice == "named":
            return Constraint("json", json.dumps(_parameters(self.functions[self.name])))
        if self.choice == "required":
            calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": name}, "arguments": _parameters(f)}}
                     for name, f in self.functions.items()]
            array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                array["maxItems"] = 1
            return Constraint("json", json.dumps(array))
        return None

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self)


def parse_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest | None:
    """The request's tools, checked (400 naming the problem); None when it has none or they are off."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise bad_request("'tools' must be a non-empty list of {'type': 'function', 'function': {...}}", param="tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"'tools[{i}]' must be {{'type': 'function', 'function': {{'name': ...}}}}",
                              param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise bad_request(f"'tools[{i}].function.name' must be a string of 1 to 64 characters", param="tools")
        if name in names:
            raise bad_request(f"'tools' names the function {name!r} twice", param="tools")
        names.add(name)
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"'tools[{i}].function.parameters' must be a JSON schema object", param="tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad_request(f"'tools[{i}].function.description' must be a string", param="tools")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolRequest(tools, tool_choice or "auto", parallel=parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise bad_request(f"'tool_choice' names the function {name!r}, which is not in 'tools'",
                              param="tool_choice")
        return ToolRequest(tools, "named", name, parallel=parallel)
    raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                      "{'name': ...}}", param="tool_choice")


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


# ------------------------------------------------------------------------------------ rendering


def hermes_system_prompt(tools: list[dict[str, Any]]) -> str:
    return HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def hermes_messages(messages: list[dict[str, Any]], tools: ToolRequest | None) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools: the tools in the system message, earlier
    calls as <tool_call> blocks in the assistant's text, results as <tool_response> blocks."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [OPEN + "\n" + json.dumps({"name": c["function"]["name"],
                                                "arguments": _arguments(c["function"].get("arguments"))},
                                               ensure_ascii=False) + "\n" + CLOSE for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content") or ""] + blocks))})
        elif m["role"] == "tool":
            out.append({"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools is not None and tools.choice != "none":
        system = hermes_system_prompt(tools.tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _arguments(arguments: Any) -> Any:
    """A call's arguments as the model wrote them: OpenAI sends them as a JSON string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments if arguments is not None else {}


# -------------------------------------------------------------------------------------- parsing


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallParser:
    """One choice's output → content and tool calls, fed text deltas as they come.

    `push(text)` and `finish()` return (content delta, tool-call deltas in OpenAI's streaming shape);
    `calls` collects the whole calls for a non-streamed message."""

    request: ToolRequest
    calls: list[dict[str, Any]] = field(default_factory=list)
    _buffer: str = ""

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        mode = self.request.choice
        if mode == "named":
            deltas = []
            if not self.calls:
                self.calls.append({"id": new_call_id(), "type": "function",
                                   "function": {"name": self.request.name, "arguments": ""}})
                deltas.append({"index": 0, **self.calls[0], "function": {"name": self.request.name, "arguments": ""}})
            if text:
                self.calls[0]["function"]["arguments"] += text
                deltas.append({"index": 0, "function": {"arguments": text}})
            return "", deltas
        if mode == "required":
            self._buffer += text
            return "", []
        if mode == "none":
            return text, []
        return self._push_hermes(text)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        mode = self.request.choice
        if mode == "named":
            return self.push("") if not self.calls else ("", [])
        if mode == "required":
            text, self._buffer = self._buffer, ""
            try:
                items = json.loads(text)
                return "", [self._add(item["name"], item["arguments"]) for item in items]
            except (json.JSONDecodeError, KeyError, TypeError):  # cut off by max_tokens
                return text, []
        if mode == "none":
            return "", []
        rest, self._buffer = self._buffer, ""
        if rest.startswith(OPEN):  # a call the model did not close before it stopped
            call = self._hermes_call(rest[len(OPEN):])
            if call is not None:
                return "", [call]
        return rest, []

    def _push_hermes(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._buffer += text
        content, deltas = "", []
        while self._buffer:
            if self._buffer.startswith(OPEN):
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                body, self._buffer = self._buffer[len(OPEN):end], self._buffer[end + len(CLOSE):]
                call = self._hermes_call(body)
                if call is None:
                    content += OPEN + body + CLOSE
                else:
                    deltas.append(call)
                continue
            start = self._buffer.find(OPEN)
            if start < 0:  # keep back what could be the start of a tag
                keep = _partial_suffix(self._buffer, OPEN)
                cut = len(self._buffer) - keep
                content, self._buffer = content + self._buffer[:cut], self._buffer[cut:]
                break
            content, self._buffer = content + self._buffer[:start], self._buffer[start:]
        if self.calls and content.strip() == "":
            content = ""  # whitespace between calls is not an answer
        return content, deltas

    def _hermes_call(self, body: str) -> dict[str, Any] | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if not self.request.parallel and self.calls:
            return None  # parallel_tool_calls false: the first call only (the rest is kept as content)
        return self._add(obj["name"], arguments)

    def _add(self, name: str, arguments: Any) -> dict[str, Any]:
        call = {"id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                             else json.dumps(arguments, ensure_ascii=False)}}
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call}


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_message(request: ToolRequest, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole (non-streamed) output → (content or None, tool calls)."""
    parser = request.parser()
    content, _ = parser.push(text)
    rest, _ = parser.finish()
    content += rest
    if parser.calls:
        return (content.strip() or None), parser.calls
    return content, []
