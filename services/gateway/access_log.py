"""One access-log line per HTTP request, when it has ended (a stream: after its last chunk):

    POST /v1/chat/completions 200 1234.5 ms prompt=25 completion=48 id=<request id>

4xx and 5xx answers are logged at WARNING, so they show in the gateway's own log at its default
level; the rest at INFO. /metrics and /health (scraped every few seconds) are logged at DEBUG.
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("pdserve.access")

_QUIET = ("/metrics", "/health")


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self._line(scope, status, (time.perf_counter() - t0) * 1e3)

    @staticmethod
    def _line(scope: Scope, status: int, ms: float) -> None:
        path = scope.get("path", "")
        level = logging.WARNING if status >= 400 or status == 0 else logging.INFO
        if path in _QUIET and level == logging.INFO:
            level = logging.DEBUG
        if not log.isEnabledFor(level):
            return
        extra = ""
        generations = scope.get("state", {}).get("generations")
        if generations:  # set by the generation routes once the request was dispatched (one per choice)
            first = generations[0]
            completion = sum(g.channel.num_tokens for g in generations)
            extra = f" prompt={first.num_prompt_tokens} completion={completion} id={first.request_id}"
        # status 0: the client left (or the app failed) before any response was started
        log.log(level, "%s %s %s %.1f ms%s", scope.get("method", ""), path, status or "-", ms, extra)
