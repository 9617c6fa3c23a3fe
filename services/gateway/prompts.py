"""From a validated request to what a worker needs: prompt token ids and wire sampling params.

Chat messages are rendered with the checkpoint's own template and encoded without adding special
tokens (the template already wrote them); a completion prompt is encoded as is, or taken as token
ids. Then the context check: prompt + max_tokens must fit in the model's context.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from services.gateway.errors import APIError, bad_request
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest
from services.gateway.structured import checked_constraint, combined_constraint
from services.gateway.tools import ToolRequest, hermes_messages, parse_tools
from shared.model.chat_template import ROLES, ChatTemplateError, render_chat, template_variables
from shared.model.grammar import GrammarCompiler
from shared.model.tokenizer import Tokenizer
from shared.protocol.messages import SamplingMsg

_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


@dataclass
class ModelInfo:
    name: str  # what /v1/models lists
    max_model_len: int
    tokenizer: Tokenizer
    aliases: frozenset[str] = frozenset()  # other names requests may use (file name, path as given)
    cache_id: str = ""  # the model id in KV block keys (the engines use the checkpoint's file name)
    created: int = field(default_factory=lambda: int(time.time()))  # unix time it was loaded
    _grammar: GrammarCompiler | None = field(default=None, repr=False)

    @property
    def grammar(self) -> GrammarCompiler:
        """Structured output's compiler over this model's vocabulary (indexed on first use)."""
        if self._grammar is None:
            self._grammar = GrammarCompiler(self.tokenizer)
        return self._grammar


@dataclass
class PreparedRequest:
    prompt_ids: list[int]
    params: SamplingMsg
    stream: bool
    include_usage: bool
    continuous_usage: bool = False
    echo: str = ""  # completions' echo: the prompt's text
    num_choices: int = 1  # n
    num_candidates: int = 1  # best_of: generated; the num_choices most likely are returned
    tools: ToolRequest | None = None  # chat with tools: the output is parsed for tool calls


def check_model(requested: str | None, model: ModelInfo) -> None:
    if requested is not None and requested != model.name and requested not in model.aliases:
        raise APIError(404, f"The model '{requested}' does not exist; this server serves '{model.name}'",
                       param="model", code="model_not_found")


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI message objects → {role, content: str} dicts the template expects (plus an assistant's
    `tool_calls` and a tool result's `tool_call_id`, checked)."""
    if not messages:
        raise bad_request("'messages' is empty: a chat needs at least one message", param="messages")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise bad_request(f"'messages[{i}].role' is {role!r}; expected one of {sorted(ROLES | set(_ROLE_ALIASES))}",
                              param="messages")
        calls = message.get("tool_calls") if role == "assistant" else None
        if calls is not None:
            out.append({"role": role, "content": _content_text(message.get("content") or "", i),
                        "tool_calls": _tool_calls(calls, i)})
            continue
        out.append({"role": role, "content": _content_text(message.get("content"), i)})
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            out[-1]["tool_call_id"] = message["tool_call_id"]
    return out


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request(f"'messages[{i}].tool_calls' must be a list", param="messages")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", ""), (str, dict)):
            raise bad_request(f"'messages[{i}].tool_calls[{j}]' must be {{'id', 'type': 'function', 'function': "
                              "{'name': <string>, 'arguments': <JSON string>}}", param="messages")
    return calls


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'messages[{i}].content[{j}]' must be {{'type': 'text', 'text': <string>}}; "
                                  "other content parts are not supported", param="messages")
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM joins text parts
    raise bad_request(f"'messages[{i}].content' must be a string or a list of text parts, got "
                      f"{type(content).__name__}", param="messages")


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: ToolRequest | None = None
                    ) -> list[int]:
    """The conversation rendered with the model's template: tools through its `tools` variable where
    it has one, else in the Hermes convention (services/gateway/tools.py)."""
    extra: dict[str, Any] = {}
    if "tools" in template_variables(tokenizer.chat_template):
        if tools is not None and tools.choice != "none":
            extra["tools"] = tools.tools
    elif tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = hermes_messages(messages, tools)
    try:
        text = render_chat(tokenizer.chat_template, messages, add_generation_prompt=True,
                           bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "", **extra)
    except (ChatTemplateError, ValueError) as exc:
        raise bad_request(str(exc), param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def completion_prompt_ids(tokenizer: Tokenizer, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(f"'prompt' holds {len(prompt)} prompts; only a single prompt per request is supported",
                              param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt) if prompt else []
    else:
        ids = list(prompt)
        bad = next((t for t in ids if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise bad_request(f"'prompt' has token id {bad}, outside the vocabulary (size {tokenizer.vocab_size})",
                              param="prompt")
    if not ids:
        raise bad_request("'prompt' is empty", param="prompt")
    return ids


def resolve_max_tokens(num_prompt: int, requested: int | None, max_model_len: int, default_cap: int) -> int:
    """The number of tokens to generate; 400 when the request cannot fit in the context."""
    if num_prompt >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                          f"{num_prompt} tokens, which leaves no room for a completion. Please shorten the prompt.",
                          param="messages", code="context_length_exceeded")
    room = max_model_len - num_prompt
    if requested is None:
        return min(room, default_cap)
    if requested > room:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{num_prompt + requested} tokens ({num_prompt} in the prompt, {requested} in the "
                          "completion). Please reduce the prompt or max_tokens.",
                          param="max_tokens", code="context_length_exceeded")
    return requested


def sampling_msg(req: GenerationRequest, max_tokens: int, vocab_size: int) -> SamplingMsg:
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens")
    stop_ids = req.stop_token_ids or []
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise bad_request(f"'stop_token_ids' must be ids in [0, {vocab_size})", param="stop_token_ids")
    bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
    if any(not 0 <= t < vocab_size for t in bias):
        raise bad_request(f"'logit_bias' keys must be token ids in [0, {vocab_size})", param="logit_bias")
    return SamplingMsg(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),  # OpenAI's default
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=req.top_k or 0,
        seed=req.seed,
        stop=req.stop_list,
        stop_token_ids=list(stop_ids),
        ignore_eos=bool(req.ignore_eos),
        min_tokens=min_tokens,
        skip_special_tokens=req.skip_special_tokens is not False,
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
        logit_bias=bias,
        min_p=float(req.min_p or 0.0),
        logprobs=req.num_logprobs,
        # completions' echo + logprobs: the prompt's log-probabilities too (computed in prefill)
        prompt_logprobs=req.logprobs if isinstance(req, CompletionRequest) and req.echo else None,
    )


async def prepare(req: CompletionRequest | ChatCompletionRequest, model: ModelInfo, default_max_tokens: int
                  ) -> PreparedRequest:
    """Validate against the model, tokenize (in a thread: long prompts take a while), size the output."""
    check_model(req.model, model)
    if (err := req.unsupported_param()) is not None:
        raise err
    tokenizer = model.tokenizer
    tools = None
    if isinstance(req, ChatCompletionRequest):
        messages = normalize_messages(req.messages)
        tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        prompt_ids = await asyncio.to_thread(chat_prompt_ids, tokenizer, messages, tools)
        requested = req.requested_max_tokens
    else:
        prompt_ids = await asyncio.to_thread(completion_prompt_ids, tokenizer, req.prompt)
        requested = req.max_tokens
    max_tokens = resolve_max_tokens(len(prompt_ids), requested, model.max_model_len, default_max_tokens)
    params = sampling_msg(req, max_tokens, tokenizer.vocab_size)
    found = combined_constraint(req, tools.constraint() if tools is not None else None)
    if found is not None:  # compiling can take a while: off the event loop (free text costs nothing here)
        params.constraint = await asyncio.to_thread(checked_constraint, found, model.grammar)
    echo = ""
    if isinstance(req, CompletionRequest) and req.echo:
        prompt = req.prompt[0] if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) \
            else req.prompt
        echo = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
    return PreparedRequest(prompt_ids, params, stream=bool(req.stream), include_usage=req.include_usage,
                           continuous_usage=req.continuous_usage, echo=echo, num_choices=req.num_choices,
                           num_candidates=req.num_candidates, tools=tools)
