"""NATS helpers: connect (reconnecting forever), the JetStream work queues, pull consumers.

Work queues use pull consumers so a worker takes a job only when it has room (backpressure); an
unacked job is redelivered after `ack_wait` (a crashed worker's job comes back), at most
`max_deliver` times.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.errors import NoRespondersError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, PubAck, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NoStreamResponseError, ServiceUnavailableError

from shared.protocol import subjects

log = logging.getLogger(__name__)


# after a reconnect, a worker sends its recent token events again, and a gateway asks all workers to,
# at these delays: once interest has spread through the cluster, and once more
REPLAY_DELAYS_S = (1.0, 2.0)
PING_INTERVAL_S = 2.0  # (nats-py's default, 2 minutes, would hold a partitioned connection that long)


async def connect(url: str, name: str, *, user: str | None = None, password: str | None = None,
                  token: str | None = None, connect_timeout: float = 5.0,
                  on_disconnected: Callable[[], None] | None = None,
                  on_reconnected: Callable[[], None] | None = None) -> NATS:
    """Connect and keep reconnecting forever (services outlive a NATS restart). `url` may list
    several servers, comma-separated (the nodes of a cluster), in order of preference — put this
    host's node first: the client connects to the first that answers and fails over down the list
    (and to any node the cluster announces). A connection that silently stops carrying traffic (a
    partitioned link: no reset) is found dead by its pings within ~PING_INTERVAL_S × 3.
    `on_disconnected` / `on_reconnected` are called (plain functions, in the event loop) after this
    module logs each."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"no NATS server URL in {url!r}")

    async def on_error(exc: Exception) -> None:
        log.warning("%s: NATS error: %s", name, exc)

    async def on_disconnect() -> None:
        log.warning("%s: NATS disconnected", name)
        if on_disconnected is not None:
            on_disconnected()

    async def on_reconnect() -> None:
        log.info("%s: NATS reconnected", name)
        if on_reconnected is not None:
            on_reconnected()

    return await nats.connect(
        servers, name=name, user=user, password=password, token=token,
        connect_timeout=connect_timeout, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
        allow_reconnect=True, error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect,
        ping_interval=PING_INTERVAL_S, max_outstanding_pings=3, dont_randomize=True,
        pending_size=64 * 1024 * 1024,
    )


async def settle(nc: NATS, timeout: float = 10.0) -> None:
    """Return once the server has every command this client sent so far — the subscriptions just
    made are live, so a request from another connection finds them. `nc.flush()` alone does not
    prove it: nats-py writes flush's PING straight to the socket, ahead of the commands still queued
    for its flusher task, so the PONG can come back before the server has seen a SUB sent just
    before (1.6% of the time here: a kvstore said ready and its first request got "no responders").
    The first round trip lets the flusher write the queue; the second PING follows it."""
    await nc.flush(timeout)
    await nc.flush(timeout)


def describe(nc: NATS) -> dict:
    """Where this client is connected: the server, its cluster and the nodes it knows (for /health)."""
    info = getattr(nc, "_server_info", None) or {}
    url = nc.connected_url
    return {"connected": nc.is_connected, "server": info.get("server_name"),
            "url": f"{url.hostname}:{url.port}" if url else None, "cluster": info.get("cluster"),
            "cluster_urls": sorted(info.get("connect_urls") or [])}


# JetStream did not answer (yet): no ack in time, no stream leader (an election), no responders
UNANSWERED = (TimeoutError, ServiceUnavailableError, NoRespondersError, NoStreamResponseError)
DEDUP_WINDOW_S = 120.0  # a job published again with the same Nats-Msg-Id within this is stored once
NO_PEERS_FOR_PLACEMENT = 10005  # JetStream's err_code while a cluster's servers have not all met yet
JETSTREAM_WAIT_S = 60.0  # a cluster just started elects its JetStream leader in seconds


def stream_replicas(nc: NATS) -> int:
    """How many copies of each work queue: $PDSERVE_STREAM_REPLICAS, else 3 on a cluster of 3 or more
    nodes (each job survives losing a node), as many as there are nodes on a smaller one, 1 alone."""
    explicit = os.environ.get("PDSERVE_STREAM_REPLICAS")
    if explicit:
        return int(explicit)
    info = getattr(nc, "_server_info", None) or {}
    if not info.get("cluster"):
        return 1
    return max(1, min(3, len(info.get("connect_urls") or [])))


async def ensure_streams(js: JetStreamContext, storage: StorageType = StorageType.FILE, replicas: int = 1) -> None:
    """Create (or bring to this configuration) the two work-queue streams, with `replicas` copies
    and a duplicate window (publishers set Nats-Msg-Id: a publish retried after a lost ack or a leader
    change is stored once). Waits for JetStream to answer (a cluster electing its leader)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + JETSTREAM_WAIT_S
    for name, subs in ((subjects.PREFILL_STREAM, [subjects.PREFILL_JOBS, f"{subjects.PREFILL_JOBS}.*"]),
                       (subjects.DECODE_STREAM, [subjects.DECODE_JOBS, subjects.DECODE_DIRECT,
                                                 f"{subjects.DECODE_DIRECT}.*"])):
        config = StreamConfig(name=name, subjects=subs, retention=RetentionPolicy.WORK_QUEUE, storage=storage,
                              max_age=600.0, num_replicas=replicas, duplicate_window=DEDUP_WINDOW_S)
        while True:
            try:
                try:
                    await js.add_stream(config)
                except BadRequestError as exc:
                    if exc.err_code == NO_PEERS_FOR_PLACEMENT:
                        raise  # not "it exists": the cluster has not yet met enough of its peers
                    await js.update_stream(config)
                break
            except (*UNANSWERED, BadRequestError) as exc:
                if loop.time() > deadline or (isinstance(exc, BadRequestError) and exc.err_code != NO_PEERS_FOR_PLACEMENT):
                    raise
                log.info("JetStream not ready (%s); retrying", exc)
                await asyncio.sleep(0.5)


async def publish_job(js: JetStreamContext, subject: str, payload: bytes, msg_id: str, *, timeout: float = 2.0,
                      headers: dict[str, str] | None = None, retry_s: float = 20.0,
                      on_retry: Callable[[], Awaitable[None]] | None = None) -> PubAck:
    """Publish a job exactly once: with `msg_id` as its Nats-Msg-Id, retried (same id) while the
    stream does not answer — a lost ack, a leader being elected — for up to `retry_s`; the stream's
    duplicate window stores a retried copy once. Raises the last error after that. `await on_retry()`
    before each retry (a worker handing a request on tells the gateway it is still at it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_s
    headers = {**(headers or {}), "Nats-Msg-Id": msg_id}
    while True:
        try:
            return await js.publish(subject, payload, timeout=timeout, headers=headers)
        except UNANSWERED as exc:
            if loop.time() + timeout > deadline:
                raise
            log.warning("publish of %s to %s failed (%s); retrying", msg_id, subject, type(exc).__name__)
            if on_retry is not None:
                await on_retry()
            await asyncio.sleep(0.2)


async def pull_subscription(js: JetStreamContext, stream: str, durable: str, filter_subject: str, *,
                            ack_wait: float = 30.0, max_deliver: int = 3,
                            inactive_threshold: float | None = None) -> JetStreamContext.PullSubscription:
    """A durable pull consumer shared by all workers of one pool (a work queue allows one consumer
    per subject, so workers of a pool bind to the same durable) — or, on a per-worker subject, that
    worker's own, which the server deletes after `inactive_threshold` seconds without it (a worker
    that never comes back; the gateway has resubmitted its jobs to the shared queue by then)."""
    config = ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                            ack_wait=ack_wait, max_deliver=max_deliver, filter_subject=filter_subject,
                            max_ack_pending=-1, inactive_threshold=inactive_threshold)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + JETSTREAM_WAIT_S
    while True:  # a cluster busy or electing a leader may leave the consumer's API calls unanswered
        try:
            return await js.pull_subscribe(filter_subject, durable=durable, stream=stream, config=config)
        except UNANSWERED as exc:
            if loop.time() > deadline:
                raise
            log.warning("JetStream did not answer for consumer %s (%s); retrying", durable, type(exc).__name__)
            await asyncio.sleep(0.5)


WORKER_CONSUMER_IDLE_S = 3600.0  # a per-worker consumer outlives its worker this long (restarts keep it)


async def worker_subscription(js: JetStreamContext, stream: str, base: str, instance: str, *, ack_wait: float,
                              max_deliver: int) -> JetStreamContext.PullSubscription:
    """The pull consumer of `instance`'s own jobs (`base`.<instance>: the router chose this worker)."""
    return await pull_subscription(js, stream, f"{base.replace('.', '-')}-{instance}",
                                   subjects.worker_jobs(base, instance), ack_wait=ack_wait, max_deliver=max_deliver,
                                   inactive_threshold=WORKER_CONSUMER_IDLE_S)
