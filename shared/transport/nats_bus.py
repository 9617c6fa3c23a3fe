"""NATS helpers: connect (reconnecting forever), the JetStream work queues, pull consumers.

Work queues use pull consumers so a worker takes a job only when it has room (backpressure); an
unacked job is redelivered after `ack_wait` (a crashed worker's job comes back), at most
`max_deliver` times.
"""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, AckPolicy, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from shared.protocol import subjects

log = logging.getLogger(__name__)


async def connect(url: str, name: str, *, user: str | None = None, password: str | None = None,
                  token: str | None = None, connect_timeout: float = 5.0) -> NATS:
    """Connect and keep reconnecting forever (services outlive a NATS restart)."""

    async def on_error(exc: Exception) -> None:
        log.warning("%s: NATS error: %s", name, exc)

    async def on_disconnect() -> None:
        log.warning("%s: NATS disconnected", name)

    async def on_reconnect() -> None:
        log.info("%s: NATS reconnected", name)

    return await nats.connect(
        url, name=name, user=user, password=password, token=token,
        connect_timeout=connect_timeout, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
        allow_reconnect=True, error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect,
        pending_size=64 * 1024 * 1024,
    )


async def ensure_streams(js: JetStreamContext, storage: StorageType = StorageType.FILE) -> None:
    """Create (or keep) the two work-queue streams."""
    for name, subs in ((subjects.PREFILL_STREAM, [subjects.PREFILL_JOBS, f"{subjects.PREFILL_JOBS}.*"]),
                       (subjects.DECODE_STREAM, [subjects.DECODE_JOBS, subjects.DECODE_DIRECT,
                                                 f"{subjects.DECODE_DIRECT}.*"])):
        config = StreamConfig(name=name, subjects=subs, retention=RetentionPolicy.WORK_QUEUE, storage=storage,
                              max_age=600.0)
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)


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
    return await js.pull_subscribe(filter_subject, durable=durable, stream=stream, config=config)


WORKER_CONSUMER_IDLE_S = 3600.0  # a per-worker consumer outlives its worker this long (restarts keep it)


async def worker_subscription(js: JetStreamContext, stream: str, base: str, instance: str, *, ack_wait: float,
                              max_deliver: int) -> JetStreamContext.PullSubscription:
    """The pull consumer of `instance`'s own jobs (`base`.<instance>: the router chose this worker)."""
    return await pull_subscription(js, stream, f"{base.replace('.', '-')}-{instance}",
                                   subjects.worker_jobs(base, instance), ack_wait=ack_wait, max_deliver=max_deliver,
                                   inactive_threshold=WORKER_CONSUMER_IDLE_S)
