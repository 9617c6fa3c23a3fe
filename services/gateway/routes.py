"""HTTP routes. A generation request goes:

    auth → admit (429) → read body (413/415/400) → validate (400/404) → tokenize, size (400)
         → live workers? (503) → subscribe + publish job → SSE stream | one JSON body
"""

from __future__ import annotations

import hmac
import importlib.metadata
import json
import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from services.gateway import schemas
from services.gateway.errors import APIError, bad_request
from services.gateway.generation import Generation
from services.gateway.logprobs import LogprobFormat
from services.gateway.metrics import CONTENT_TYPE
from services.gateway.output import OutputText
from services.gateway.prompts import chat_prompt_ids, check_model, normalize_messages, prepare
from services.gateway.responses import ResponseMeta
from services.gateway.streaming import CLIENT_GONE, SSEResponse, collect, sse_body
from services.gateway.tools import parse_tools
from services.gateway.trace import RequestTrace
from shared.transport import nats_bus

if TYPE_CHECKING:
    from services.gateway.app import GatewayState

log = logging.getLogger(__name__)

try:
    _VERSION = importlib.metadata.version("pdserve")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was not installed
    _VERSION = "unknown"
_DRAIN_LIMIT = 64 * 1024 * 1024  # read (and drop) an oversized body up to this, so the client sees the 413


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


async def require_api_key(request: Request) -> None:
    key = request.app.state.config.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


router = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = _state(request)
    alive = await state.require_workers()
    await state.check_started()
    return JSONResponse({"status": "ok", "mode": state.config.mode, "model": state.model.name, "workers": alive,
                         "requests_in_flight": state.admission.in_flight, "nats": nats_bus.describe(state.nc)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


_STATIC = Path(__file__).parent / "static"


@router.get("/dashboard")
async def dashboard() -> Response:
    """The live dashboard: a page and a script that poll /metrics and /health (nothing from elsewhere)."""
    return Response((_STATIC / "dashboard.html").read_bytes(), media_type="text/html; charset=utf-8")


@router.get("/dashboard.js")
async def dashboard_js() -> Response:
    return Response((_STATIC / "dashboard.js").read_bytes(), media_type="text/javascript; charset=utf-8")


def _model_card(state: GatewayState) -> dict[str, Any]:
    return {"id": state.model.name, "object": "model", "created": state.model.created, "owned_by": "pdserve",
            "max_model_len": state.model.max_model_len}


@v1.get("/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(_state(request))]})


@v1.get("/models/{model:path}")
async def get_model(model: str, request: Request) -> JSONResponse:
    state = _state(request)
    check_model(model, state.model)
    return JSONResponse(_model_card(state))


@v1.post("/completions")
async def completions(request: Request) -> Response:
    return await _generate(request, schemas.CompletionRequest, "completion")


@v1.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _generate(request, schemas.ChatCompletionRequest, "chat")


# vLLM's utility endpoints (at the root, as vLLM serves them), behind the API key like /v1
utility = APIRouter(dependencies=[Depends(require_api_key)])


async def _utility_request(request: Request, schema: type) -> tuple[GatewayState, Any]:
    state = _state(request)
    req = schemas.parse(schema, await read_json(request, state.config.max_body_bytes))
    check_model(req.model, state.model)
    return state, req


@utility.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    state, req = await _utility_request(request, schemas.TokenizeRequest)
    tokenizer = state.model.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give either 'prompt' or 'messages'", param="prompt")
    if req.messages is not None:
        if req.add_special_tokens:
            raise bad_request("'add_special_tokens' with 'messages': the chat template writes them",
                              param="add_special_tokens")
        ids = chat_prompt_ids(tokenizer, normalize_messages(req.messages), parse_tools(req.tools, None, None))
    else:
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": state.model.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = [tokenizer.id_to_token(t) for t in ids]
    return JSONResponse(body)


@utility.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    state, req = await _utility_request(request, schemas.DetokenizeRequest)
    tokenizer = state.model.tokenizer
    bad = next((t for t in req.tokens if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (size {tokenizer.vocab_size})", param="tokens")
    return JSONResponse({"prompt": tokenizer.decode(req.tokens)})


@utility.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> JSONResponse:
    """vLLM's: the tokenizer's configuration (special tokens, chat template), so clients that count
    tokens (lm-evaluation-harness's `tokenizer_backend=remote`) use the server's own tokenizer."""
    state = _state(request)
    return JSONResponse(state.model.tokenizer.hf_config(state.model.max_model_len))


@utility.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> JSONResponse:
    """vLLM's: forget every cached prefix (benchmarks call it between runs), in every worker's engine
    and every kvstore. Blocks in use stay; cached ones are no longer found. Answers with who did it."""
    return JSONResponse(await _state(request).reset_prefix_cache())


@utility.get("/router")
async def router_state(request: Request) -> JSONResponse:
    """What the router sees: its policy, each live worker's load and the routing index by location."""
    state = _state(request)
    r = state.dispatcher.router
    roles = ("colocated",) if state.config.mode == "colocated" else ("prefill", "decode")
    workers = {s.instance: {"role": s.role, "kvstore": s.kvstore, "load_tokens": round(r.load(s), 1),
                            "queued_tokens": s.queued_tokens, "pending_tokens": r.pending_tokens(s),
                            "kv_blocks_in_use": s.kv_blocks_in_use}
               for role in roles for s in state.workers.live(role)}
    return JSONResponse({"policy": state.config.router, "mode": state.config.mode, "workers": workers,
                         "index": state.index.summary()})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": _VERSION})


router.include_router(v1)
router.include_router(utility)


async def read_json(request: Request, limit: int) -> Any:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(415, f"Content-Type must be application/json, got {media_type!r}",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length")
    too_large = APIError(413, f"request body is larger than the {limit} byte limit", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > _DRAIN_LIMIT:
        raise too_large
    body = bytearray()
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            body += chunk
        elif size > _DRAIN_LIMIT:
            break
    if size > limit:
        raise too_large
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


def _outcome(exc: APIError) -> str:
    return "rejected" if exc.status in (429, 503) else ("invalid" if exc.status < 500 else "error")


async def _generate(request: Request, schema: type[schemas.GenerationRequest], kind: str) -> Response:
    state = _state(request)
    arrived = time.perf_counter()
    try:
        ticket = state.admission.admit()
    except APIError:
        state.metrics.count("rejected")
        raise
    channels: list = []
    trace = RequestTrace(request.headers, "chat" if kind == "chat" else "text_completion", state.model.name,
                         request.method, request.url.path)
    try:
        req = schemas.parse(schema, await read_json(request, state.config.max_body_bytes))
        prepared = await prepare(req, state.model, state.config.default_max_tokens)
        await state.require_workers()
        request_id = uuid.uuid4().hex
        params = prepared.params
        trace.dispatched(request_id, params, len(prepared.prompt_ids), prepared.num_candidates)
        headers = trace.headers()
        rank = prepared.num_candidates > prepared.num_choices and params.logprobs is None
        if rank:  # best_of ranks the candidates by their tokens' log-probabilities
            params = msgspec.structs.replace(params, logprobs=0)
        for i in range(prepared.num_candidates):
            # choice i: its own request (seed + i), published once choice 0's prompt KV is cached
            rid = request_id if prepared.num_candidates == 1 else f"{request_id}-{i}"
            seeded = params if params.seed is None or i == 0 else msgspec.structs.replace(params, seed=params.seed + i)
            channels.append(await state.dispatcher.open(rid, prepared.prompt_ids, seeded,
                                                        after=channels[0] if i else None, headers=headers))
        ticket.dispatched()
    except BaseException as exc:
        ticket.release()
        state.metrics.count(_outcome(exc) if isinstance(exc, APIError) else "error")
        for channel in channels:  # choices already published (n > 1) are cancelled
            await channel.close("the request failed")
        trace.finish(error=exc.message if isinstance(exc, APIError) else type(exc).__name__)
        raise

    tokenizer = state.model.tokenizer
    generations = [
        Generation(channel, OutputText(tokenizer, prepared.prompt_ids, stop=params.stop, min_tokens=params.min_tokens,
                                       skip_special_tokens=params.skip_special_tokens),
                   num_prompt_tokens=len(prepared.prompt_ids), metrics=state.metrics, ticket=ticket, arrived=arrived,
                   index=i, operation="chat" if kind == "chat" else "text_completion", trace=trace)
        for i, channel in enumerate(channels)]
    request.scope.setdefault("state", {})["generations"] = generations  # for the access log
    meta = ResponseMeta(kind, request_id, state.model.name, echo=prepared.echo, continuous_usage=prepared.continuous_usage,
                        tools=prepared.tools, price=state.config.price, trace=trace,
                        logprobs=LogprobFormat(tokenizer, kind) if params.logprobs is not None else None)
    log.debug("request %s: %d prompt tokens, max_tokens %d, n %d, stream=%s", request_id, len(prepared.prompt_ids),
              params.max_tokens, len(generations), prepared.stream)
    if prepared.stream:
        return SSEResponse(sse_body(generations, meta, prepared.include_usage),
                           on_disconnect=lambda: [c.abort(CLIENT_GONE) for c in channels])
    return await collect(generations, meta, request.receive, prepared.num_choices, strip_logprobs=rank)
