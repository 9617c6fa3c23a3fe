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
    for name, subs in ((subjects.PREFILL_STREAM, [subjects.PREFILL_JOBS]),
                       (subjects.DECODE_STREAM, [subjects.DECODE_JOBS, subjects.DECODE_DIRECT])):
        config = StreamConfig(name=name, subjects=subs, retention=RetentionPolicy.WORK_QUEUE, storage=storage,
                              max_age=600.0)
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)


async def pull_subscription(js: JetStreamContext, stream: str, durable: str, filter_subject: str, *,
                            ack_wait: float = 30.0, max_deliver: int = 3) -> JetStreamContext.PullSubscription:
    """A durable pull consumer shared by all workers of one pool (a work queue allows one consumer
    per subject, so workers of a pool bind to the same durable)."""
    config = ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                            ack_wait=ack_wait, max_deliver=max_deliver, filter_subject=filter_subject,
                            max_ack_pending=-1)
    return await js.pull_subscribe(filter_subject, durable=durable, stream=stream, config=config)
