"""The engine behind an asyncio service: steps run in a worker thread, requests come and go as
asyncio calls.

    add_request() / add_prefilled() / abort()   → queued, applied between steps (event-loop thread)
    run()                                       → loop: apply queued commands → step (thread) → deliver
    each request's outputs                      → its own asyncio.Queue (RequestStream)

The engine is only ever touched from the event-loop thread while no step is running, or from the
step thread while a step runs: never both, so it needs no locks. (The router's estimates are the one
exception: `add_request` looks a prompt up in the prefix cache and `queued_tokens` reads the queues
while a step may run; both only read, and are estimates.) torch releases the GIL inside its kernels,
so the event loop keeps serving NATS while a step computes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.engine.cores import CoreShare
from shared.engine.engine import LLMEngine, RequestError, RequestOutput
from shared.engine.sequence import FinishReason

log = logging.getLogger(__name__)


@dataclass
class StreamItem:
    output: RequestOutput | None = None
    kv_blocks: torch.Tensor | None = None  # prefill-only: the exported prompt KV
    error: BaseException | None = None  # the request could not be added


class RequestStream:
    """One request's outputs, in order; ends with a finished output or an error."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.queue: asyncio.Queue[StreamItem] = asyncio.Queue()

    async def get(self) -> StreamItem:
        return await self.queue.get()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, cores: CoreShare | None = None, borrow_from: int = 1):
        self.engine = engine
        self.cores = cores  # lend this engine's cores to the others on the host while idle
        self.borrow_from = borrow_from  # … and borrow theirs for steps of this many sequences, or a prompt's
        self._streams: dict[str, RequestStream] = {}
        self._adding = 0  # requests submitted whose add has not run yet (it runs between steps)
        self._commands: list[Callable[[], None]] = []
        self._wake = asyncio.Event()
        self.steps = 0  # steps run so far: a caller can tell a busy engine from a stuck one
        self.incoming_tokens = 0  # prompt tokens to compute of requests added but not yet in the engine
        self._block_queue: int | None = None  # the routing index's event queue on the engine's pool
        self._block_events: list = []  # taken from it between steps, read by `take_block_events`

    # ---------------------------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt_ids: list[int], params, **kwargs) -> RequestStream:
        # what the router should count as this engine's work: the prompt less what it holds cached
        # (read while a step may run: a lookup that changes nothing, and only an estimate)
        cached = self.engine.kv.cached_tokens(prompt_ids) if params.prompt_logprobs is None else 0
        prefix_kv = kwargs.get("prefix_kv")
        if prefix_kv is not None:
            cached = max(cached, prefix_kv.shape[0] * self.engine.config.block_size)
        todo = len(prompt_ids) - cached
        self.incoming_tokens += todo

        def add() -> None:
            self.incoming_tokens -= todo
            seq = self.engine.add_request(request_id, prompt_ids, params, **kwargs)
            seq.expected_cached_tokens = cached

        return self._submit(request_id, add)

    def add_prefilled(self, request_id: str, prompt_ids: list[int], first_token: int, kv_blocks: torch.Tensor,
                      params, **kwargs) -> RequestStream:
        def add() -> None:
            seq = self.engine.add_prefilled(request_id, prompt_ids, first_token, kv_blocks, params, **kwargs)
            if seq.is_finished:  # the first token already ended it (EOS, stop string, max_tokens 1)
                self._deliver([self.engine.make_output(seq, [])])

        return self._submit(request_id, add)

    def abort(self, request_id: str) -> None:
        def do_abort() -> None:
            if self.engine.abort(request_id):
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.queue.put_nowait(StreamItem(output=RequestOutput(
                        request_id, [], "", True, FinishReason.ABORT, 0, 0, 0)))

        self._commands.append(do_abort)
        self._wake.set()

    async def reset_prefix_cache(self) -> int:
        """Forget the engine's cached prefixes, between steps; returns the blocks forgotten."""
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._commands.append(lambda: done.set_result(self.engine.pool.reset_prefix_cache()))
        self._wake.set()
        return await done

    def watch_blocks(self) -> None:
        """Start keeping the prefix cache's BlockStored/BlockEvicted events (the routing index)."""
        self._block_queue = self.engine.pool.add_event_queue()

    def take_block_events(self) -> list:
        """Events of the steps run so far (event-loop thread: they were moved here between steps)."""
        events, self._block_events = self._block_events, []
        return events

    async def cached_keys(self) -> list[bytes]:
        """Every key the engine's prefix cache can hit, read between steps."""
        done: asyncio.Future[list[bytes]] = asyncio.get_running_loop().create_future()
        self._commands.append(lambda: done.set_result(self.engine.pool.cached_keys()))
        self._wake.set()
        return await done

    def _collect_block_events(self) -> None:
        if self._block_queue is not None:
            self._block_events += self.engine.pool.take_events(self._block_queue)

    def _submit(self, request_id: str, add: Callable[[], None]) -> RequestStream:
        stream = RequestStream(request_id)

        def command() -> None:
            self._adding -= 1
            if request_id in self._streams:  # refused without touching the running request's stream
                stream.queue.put_nowait(StreamItem(error=RequestError(f"request id {request_id!r} is already in use")))
                return
            self._streams[request_id] = stream
            try:
                add()
            except Exception as exc:  # RequestError, MemoryError: the caller decides what to tell the client
                self._streams.pop(request_id, None)
                stream.queue.put_nowait(StreamItem(error=exc))

        self._adding += 1
        self._commands.append(command)
        self._wake.set()
        return stream

    @property
    def num_adding(self) -> int:
        """Requests submitted whose add runs at the next step (their KV blocks are not taken yet)."""
        return self._adding

    @property
    def num_requests(self) -> int:
        """The requests this engine holds, counting those submitted since its last step (a worker
        deciding whether it has room for another job must see the one it just took)."""
        return len(self._streams) + self._adding

    def queued_tokens(self) -> int:
        """Prompt tokens taken but not computed yet, less those the prefix cache held when they came:
        the router's measure of this engine's prefill work (an estimate, read while a step may run; a
        step changing the queues meanwhile raises RuntimeError). Counting a waiting prompt whole made
        the holder of a shared document look a prompt busier for each request queued there, and the
        router sent the next one to a worker that had to compute the document again."""
        sched = self.engine.scheduler
        return self.incoming_tokens + sum(
            max(0, seq.num_prompt_tokens - max(seq.num_computed_tokens, seq.expected_cached_tokens))
            for seq in [*sched.waiting, *sched.running])

    # -------------------------------------------------------------------------------------- loop

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._wake.clear()
                if self._commands:
                    continue
                if self.cores is not None:
                    self.cores.set_busy(False)
                waiter = asyncio.ensure_future(self._wake.wait())
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                stopper.cancel()
                continue
            outputs = await asyncio.to_thread(self._step)
            self.steps += 1
            self._deliver(outputs)
            self._collect_block_events()

    def _step(self) -> list[RequestOutput]:
        """One engine step (in the worker thread), on this engine's cores plus those lent to it."""
        if self.cores is not None:
            self.cores.set_busy(True)
            sched = self.engine.scheduler
            # a lone decode stream gains nothing from more threads; a prompt's chunk does, in any role
            wide = sched.num_unfinished >= self.borrow_from or any(
                s.num_new_tokens > 1 for s in (*sched.running, *sched.waiting))
            threads = self.cores.threads() if wide else self.cores.share
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        return self.engine.step()

    def _apply_commands(self) -> None:
        commands, self._commands = self._commands, []
        for command in commands:
            command()
        self._collect_block_events()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            item = StreamItem(output=out)
            if out.finished:
                del self._streams[out.request_id]
                if out.finish_reason == FinishReason.PREFILLED:
                    _, item.kv_blocks = self.engine.export_kv(out.request_id)
            stream.queue.put_nowait(item)
