"""Run the gateway in-process: `await serve(config, stop_event)` (what `pdserve up` calls).

The caller owns the signals: uvicorn's own SIGINT/SIGTERM capture is switched off, and setting
`stop_event` is the way to stop: open streams get `shutdown_grace_s` to finish, then each one left
ends with an SSE error event ("service shutting down") before uvicorn closes the connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from shared.protocol.messages import ErrorCode

log = logging.getLogger(__name__)

END_FLUSH_S = 2.0  # after the grace: how long the ended streams get to write their error event


class _EmbeddedServer(uvicorn.Server):
    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


async def end_streams(state, grace_s: float) -> None:
    """Stop taking requests; give the open streams `grace_s` to complete, then end each one that
    is left with an SSE error event ("service shutting down"), so no client sees a bare close."""
    state.stopping = True
    dispatcher = state.dispatcher
    if dispatcher.channels:
        log.info("gateway stopping: %d streams open, waiting up to %.0f s for them", len(dispatcher.channels),
                 grace_s)
    if await dispatcher.wait_idle(grace_s):
        return
    n = dispatcher.end_all(ErrorCode.UNAVAILABLE, "service shutting down")
    log.warning("gateway stopping: ending %d open streams with an error event", n)
    await dispatcher.wait_idle(END_FLUSH_S)  # each stream writes its error event and [DONE], then closes


async def serve(config: GatewayConfig, stop_event: asyncio.Event | None = None) -> None:
    """Serve until `stop_event` is set; raises the start-up error if the gateway cannot start."""
    app = create_app(config)
    server = _EmbeddedServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level.lower(), lifespan="on",
        timeout_graceful_shutdown=config.shutdown_grace_s, access_log=False,
    ))

    async def stop_when_told() -> None:
        await stop_event.wait()
        state = getattr(app.state, "gateway", None)
        if state is not None:
            await end_streams(state, config.shutdown_grace_s)
        server.should_exit = True

    stopper = asyncio.create_task(stop_when_told()) if stop_event is not None else None
    try:
        await server.serve()
    except SystemExit:  # uvicorn exits this way when start-up (lifespan or bind) failed
        error = app.state.startup_error
        reason = error if error is not None else f"could not listen on {config.host}:{config.port} (see the log)"
        raise RuntimeError(f"gateway failed to start: {reason}") from error
    finally:
        if stopper is not None:
            stopper.cancel()
    if not server.started and app.state.startup_error is not None:
        raise RuntimeError(f"gateway failed to start: {app.state.startup_error}") from app.state.startup_error
