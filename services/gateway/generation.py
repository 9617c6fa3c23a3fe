"""One dispatched request, from TokenEvents to text steps: detokenize, apply stop strings, time it.

Both response styles consume the same `steps()`: streaming turns each step into an SSE chunk,
non-streaming joins them. A worker's error event or a broken/timed-out stream raises `APIError`
(after at most the steps that were already good); a client that left ends the steps silently.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.gateway.admission import Ticket
from services.gateway.dispatch import RequestChannel, StreamError
from services.gateway.errors import APIError, from_error_code
from services.gateway.metrics import GatewayMetrics
from services.gateway.output import OutputText
from services.gateway.trace import RequestTrace
from shared.protocol.messages import ErrorCode, Timing, TokenEvent, TokenLogprobs, Usage

log = logging.getLogger(__name__)


@dataclass
class Step:
    text: str  # new text ("" when a token completed no character yet, or text is held back)
    finish_reason: str | None = None  # "stop" | "length" on the last step
    stop_reason: str | int | None = None
    usage: Usage | None = None  # on the last step
    timing: Timing | None = None  # on the last step: where the time went, what was computed and moved
    # (token id, its log-probabilities) of the tokens since the previous step, where asked for
    logprobs: list[tuple[int, TokenLogprobs]] = field(default_factory=list)


class Generation:
    def __init__(self, channel: RequestChannel, output: OutputText, *, num_prompt_tokens: int,
                 metrics: GatewayMetrics, ticket: Ticket, arrived: float, index: int = 0,
                 operation: str = "chat", trace: RequestTrace | None = None) -> None:
        self.channel = channel
        # choice `index` of the request (n > 1); the request's TTFT, latency and outcome are its
        # first choice's, every choice's tokens count for ITL; the choices share the admission ticket
        self.index = index
        self.output = output
        self.num_prompt_tokens = num_prompt_tokens
        self._metrics = metrics
        self._ticket = ticket
        self._arrived = arrived  # time.perf_counter() when the HTTP request came in
        self._operation = operation  # GenAI's gen_ai.operation.name: "chat" | "text_completion"
        self._trace = trace
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self.status = "cancelled"  # requests_total label; set as the request ends
        self._cancel_reason = "the client stopped reading"
        self._logprobs: list[tuple[int, TokenLogprobs]] = []  # not yet handed out with a step
        self.prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1 … P-1's (echo + logprobs)

    @property
    def request_id(self) -> str:
        return self.channel.request_id

    async def steps(self) -> AsyncIterator[Step]:
        try:
            async for event in self.channel.events():
                if event.token_ids:
                    self._observe_tokens(len(event.token_ids))
                if not event.finished:
                    text = self._add(event)
                    if text:
                        yield Step(text, logprobs=self._take_logprobs())
                    continue
                if event.error_code != ErrorCode.OK or event.finish_reason in ("abort", "error"):
                    raise self._worker_error(event)
                final = self._final_step(event)
                yield final
                self.status = "success"
                if self.index == 0:
                    duration = time.perf_counter() - self._arrived
                    self._metrics.e2e.observe(duration)
                    ttft = None if self._first_token_at is None else self._first_token_at - self._arrived
                    self._metrics.observe_genai(self._operation, ttft, duration, final.usage.completion_tokens)
                return
        except StreamError as exc:
            log.warning("request %s: %s", self.request_id, exc.message)
            self.status = "timeout" if exc.code == ErrorCode.TIMEOUT else "error"
            self._cancel_reason = exc.message
            raise from_error_code(exc.code, exc.message) from None

    def _add(self, event: TokenEvent) -> str:
        """The event's tokens into the text (and their log-probabilities, for those the text took)."""
        if event.prompt_logprobs and self.prompt_logprobs is None:
            self.prompt_logprobs = event.prompt_logprobs
        before = self.output.num_tokens
        text = self.output.add(event.token_ids)
        taken = self.output.num_tokens - before
        self._logprobs += zip(event.token_ids[:taken], event.logprobs[:taken])
        return text

    def _take_logprobs(self) -> list[tuple[int, TokenLogprobs]]:
        taken, self._logprobs = self._logprobs, []
        return taken

    def _final_step(self, event: TokenEvent) -> Step:
        if self._trace is not None:
            self._trace.final_event()
        text = self._add(event)
        text += self.output.finish(event.stop_reason)
        if self.output.stop_string is not None:
            finish_reason, stop_reason = "stop", self.output.stop_string
        else:
            finish_reason = event.finish_reason if event.finish_reason in ("stop", "length") else "stop"
            stop_reason = event.stop_reason
        usage = event.usage or Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=self.channel.num_tokens)
        timing = event.timing or Timing()
        if (kv_s := timing.kv_write_s + timing.kv_read_s) > 0:
            self._metrics.kv_transfer.observe(kv_s)  # colocated/direct requests move no KV: not observed
        self._metrics.account(timing, usage)
        return Step(text, finish_reason=finish_reason, stop_reason=stop_reason, usage=usage,
                    logprobs=self._take_logprobs(), timing=timing)

    def usage_so_far(self) -> Usage:
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=self.channel.num_tokens)

    def _worker_error(self, event: TokenEvent) -> APIError:
        code = event.error_code if event.error_code != ErrorCode.OK else ErrorCode.INTERNAL
        message = event.error or f"the request ended with finish_reason={event.finish_reason!r}"
        log.warning("request %s: worker %s reported %s: %s", self.request_id, event.worker or "?", code.name, message)
        self.status = "error"
        return from_error_code(code, message)

    def _observe_tokens(self, n: int) -> None:
        now = time.perf_counter()
        if self._last_token_at is None:
            self._first_token_at = now
            if self._trace is not None and self.index == 0:
                self._trace.first_token()
            if self.index == 0:
                self._metrics.ttft.observe(now - self._arrived)
            self._ticket.first_token()
        else:  # an event of n tokens: n gaps of equal share (workers may batch tokens per event)
            gap = (now - self._last_token_at) / n
            for _ in range(n):
                self._metrics.itl.observe(gap)
        self._last_token_at = now

    async def close(self) -> None:
        """Always called at the end: cancels the request on the workers unless they finished it,
        frees the admission slot, counts the outcome."""
        await self.channel.close(self._cancel_reason)
        if self.channel.migrations:
            self._metrics.migrations.inc(self.channel.migrations)
        self._ticket.release()
        if self.index == 0:
            self._metrics.count(self.status)
