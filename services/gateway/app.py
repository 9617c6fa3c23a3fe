"""The gateway app: `create_app(config)` wires the state (NATS, JetStream, Valkey, tokenizer, worker
view, metrics, admission) in the lifespan and mounts the routes."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
import redis.asyncio as aioredis
from fastapi import FastAPI
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from redis.exceptions import RedisError

from services.gateway.access_log import AccessLog
from services.gateway.admission import Admission
from services.gateway.config import GatewayConfig
from services.gateway.dispatch import Dispatcher
from services.gateway.errors import install_handlers, service_unavailable
from services.gateway.metrics import GatewayMetrics
from services.gateway.prefix_index import PrefixIndex
from services.gateway.prompts import ModelInfo
from services.gateway.router import Router
from services.gateway.routes import router
from services.gateway.workers import WorkerView
from shared.model.hub import DEFAULT_MODEL_ID, default_model_path, resolve_model_path
from shared.model.loader import open_checkpoint
from shared.model.tokenizer import Tokenizer
from shared.protocol import subjects
from shared.protocol.messages import ResetReply, decode
from shared.transport import nats_bus, valkey

log = logging.getLogger(__name__)
_background: set[asyncio.Task] = set()  # (tasks kept referenced until they finish)


def load_model_info(config: GatewayConfig) -> ModelInfo:
    """Tokenizer and context length only (metadata: no weights are read)."""
    path = resolve_model_path(config.model)
    tokenizer = Tokenizer.from_model(path)
    max_model_len = open_checkpoint(path).config.max_model_len
    if config.max_model_len is not None:  # a smaller context (as the workers may be configured), never a larger one
        max_model_len = min(max_model_len, config.max_model_len)
    name = config.served_model_name or default_model_name(path)
    aliases = frozenset({name, path.name, path.stem, str(config.model or DEFAULT_MODEL_ID)})
    return ModelInfo(name=name, max_model_len=max_model_len, tokenizer=tokenizer, aliases=aliases, cache_id=path.name)


def default_model_name(path: Path) -> str:
    """The default model is "SmolLM2-135M-Instruct" however it was named (None, the id, or its cached
    file, which is what `pdserve up` passes); any other checkpoint is named by its file/directory."""
    if path.resolve() == default_model_path().resolve():
        return DEFAULT_MODEL_ID
    return path.name if path.is_dir() else path.stem


@dataclass
class GatewayState:
    config: GatewayConfig
    model: ModelInfo
    nc: NATS
    js: JetStreamContext
    redis: aioredis.Redis
    workers: WorkerView
    admission: Admission
    metrics: GatewayMetrics
    dispatcher: Dispatcher
    index: PrefixIndex
    stopping: bool = False  # set when the gateway starts to shut down: new requests get 503
    started: bool = False  # every expected instance has been heard from (config.expect)
    _pruner: asyncio.Task | None = None

    @classmethod
    async def start(cls, config: GatewayConfig) -> GatewayState:
        model = await asyncio.to_thread(load_model_info, config)
        log.info("serving %s (context %d tokens) in %s mode", model.name, model.max_model_len, config.mode)
        nc = None

        def ask_for_replay() -> None:  # events published while this gateway was away were dropped
            async def ask() -> None:
                for delay in nats_bus.REPLAY_DELAYS_S:  # once its subscriptions have spread through the cluster
                    await asyncio.sleep(delay)
                    if nc is not None and nc.is_connected:
                        await nc.publish(subjects.REPLAY_TOKENS, b"")
            _background.add(task := asyncio.create_task(ask()))
            task.add_done_callback(_background.discard)

        nc = await nats_bus.connect(config.nats_url, config.instance, user=config.nats_user,
                                    password=config.nats_password, token=config.nats_token,
                                    on_reconnected=ask_for_replay)
        try:
            js = nc.jetstream()
            await nats_bus.ensure_streams(js, replicas=nats_bus.stream_replicas(nc))
            redis = valkey.connect(config.redis_url, config.redis_password)
            try:
                await redis.ping()
            except (RedisError, OSError) as exc:  # a hint store: heartbeats on NATS still tell liveness
                log.warning("Valkey at %s is not answering (%s); continuing", config.redis_url, exc)
            workers = WorkerView(redis, alive_s=config.worker_alive_s, stats_ttl_s=config.worker_stats_ttl_s,
                                 registry_cache_s=config.registry_cache_s)
            await workers.start(nc)
            index = PrefixIndex(forget_after_s=2 * config.worker_alive_s)
            await index.start(nc, redis)
        except BaseException:
            await nc.close()
            raise
        admission = Admission(config.max_concurrent_requests)
        metrics = GatewayMetrics(config.instance, lambda: (admission.in_flight, admission.awaiting_first_token),
                                 workers.recent_stats, model=model.name, price=config.price)
        router = Router(config, index, workers.live, model.cache_id, heard_at=workers.heard_at)
        dispatcher = Dispatcher(nc, js, config, workers, router, on_route=metrics.route)
        state = cls(config, model, nc, js, redis, workers, admission, metrics, dispatcher, index)
        state._pruner = asyncio.create_task(state._prune_index())
        return state

    async def _prune_index(self) -> None:
        """Forget the cache locations that went silent (a killed worker or store)."""
        while True:
            await asyncio.sleep(1.0)
            self.index.prune()

    async def stop(self) -> None:
        if self._pruner is not None:
            self._pruner.cancel()
        await self.index.stop()
        await self.workers.stop()
        try:
            await asyncio.wait_for(self.nc.drain(), timeout=5.0)
        except Exception as exc:  # shutting down anyway: say why the drain did not finish
            log.warning("NATS drain failed: %s", exc)
            await self.nc.close()
        await self.redis.aclose()

    async def reset_prefix_cache(self, timeout_s: float = 5.0) -> dict:
        """Ask every worker and kvstore to forget its cached prefixes; wait for each live one's answer
        (503 naming those that did not answer within `timeout_s`)."""
        expected = {(role, inst) for role, insts in (await self.workers.alive()).items() for inst in insts}
        answered: dict[tuple[str, str], int] = {}
        inbox = self.nc.new_inbox()
        got_all = asyncio.Event()

        async def on_reply(msg) -> None:
            try:
                reply = decode(msg.data, ResetReply)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("malformed reset reply dropped: %s", exc)
                return
            answered[(reply.role, reply.instance)] = reply.blocks
            if expected <= answered.keys():
                got_all.set()

        sub = await self.nc.subscribe(inbox, cb=on_reply)
        try:
            await self.nc.publish(subjects.RESET_PREFIX_CACHE, b"", reply=inbox)
            try:
                await asyncio.wait_for(got_all.wait(), timeout_s)
            except TimeoutError:
                pass
        finally:
            await sub.unsubscribe()
        missing = sorted(f"{role} {inst}" for role, inst in expected - answered.keys())
        if missing:
            raise service_unavailable(f"the prefix cache was reset on {len(answered)} instances, but "
                                      f"{', '.join(missing)} did not answer within {timeout_s:g} s")
        log.info("prefix cache reset on %d instances (%d blocks forgotten)", len(answered), sum(answered.values()))
        return {"reset": sorted(f"{role} {inst}" for role, inst in answered),
                "blocks_forgotten": sum(answered.values())}

    async def check_started(self) -> None:
        """503 until every instance the deployment starts (config.expect) has reported once."""
        if self.started:
            return
        alive = await self.workers.alive()
        short = [f"{role} {len(alive.get(role, []))}/{n}" for role, n in sorted(self.config.expect.items())
                 if len(alive.get(role, [])) < n]
        if short:
            raise service_unavailable(f"starting: waiting for {', '.join(short)} ready", code="starting")
        self.started = True

    async def require_workers(self) -> dict[str, list[str]]:
        """Live workers by role; 503 unless every role the mode needs has one, the gateway is not
        stopping, and NATS is connected (a request now would only wait for the bus: say so at once)."""
        if self.stopping:
            raise service_unavailable("service shutting down; retry shortly", code="shutting_down")
        if not self.nc.is_connected:
            raise service_unavailable("the gateway has lost its connection to NATS; retry shortly",
                                      code="bus_unavailable", retry_after=2)
        missing, alive = await self.workers.missing_roles(self.config.required_roles)
        if missing:
            raise service_unavailable(f"no live {' or '.join(missing)} worker ({self.config.mode} mode); "
                                      "retry shortly", code="no_workers")
        return alive


def create_app(config: GatewayConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            state = await GatewayState.start(config)
        except Exception as exc:
            app.state.startup_error = exc  # serve() re-raises it (uvicorn would only sys.exit)
            log.exception("gateway failed to start")
            raise
        app.state.gateway = state
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="pdserve gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config = config
    app.state.startup_error = None
    install_handlers(app)
    app.include_router(router)
    app.add_middleware(AccessLog)
    return app
