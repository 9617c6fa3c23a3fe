"""NATS on real servers: a URL list fails over, a retried job publish is stored once, and a 3-node
cluster gets its work queues replicated 3 ways (what every service creates at start)."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from shared.protocol import subjects
from shared.transport import nats_bus
from shared.transport.servers import cluster_url, free_port, nats_server_binary, start_nats, start_nats_cluster, \
    wait_for_port


async def test_a_url_list_connects_past_a_dead_server(nats_server):
    dead = f"nats://127.0.0.1:{free_port()}"
    nc = await nats_bus.connect(f"{dead}, {nats_server.url}", "test-list")
    try:
        assert nc.is_connected and nc.connected_url.port == nats_server.port
    finally:
        await nc.close()
    with pytest.raises(ValueError, match="no NATS server URL"):
        await nats_bus.connect(" , ", "test-empty")


async def test_settled_subscriptions_answer_another_connection_at_once(nats_server):
    """A service subscribes, settles, says ready; a request from another connection must find it.
    With one plain flush this got "no responders" about once in 60 tries here."""
    asker = await nats_bus.connect(nats_server.url, "test-asker")
    try:
        for i in range(300):
            service = await nats_bus.connect(nats_server.url, "test-service")

            async def answer(msg):
                await msg.respond(b"ok")

            for op in range(6):  # as many as a kvstore makes
                await service.subscribe(f"test.settle.{i}.{op}", cb=answer)
            await nats_bus.settle(service)
            assert (await asker.request(f"test.settle.{i}.5", b"?", timeout=5)).data == b"ok"
            await service.close()
    finally:
        await asker.close()


async def test_a_job_published_again_with_its_id_is_stored_once(nats_server):
    nc = await nats_bus.connect(nats_server.url, "test-dedup")
    js = nc.jetstream()
    try:
        await nats_bus.ensure_streams(js)
        subject = subjects.worker_jobs(subjects.PREFILL_JOBS, "dedup-test")  # no consumer: jobs stay
        await js.purge_stream(subjects.PREFILL_STREAM, subject=subject)
        first = await nats_bus.publish_job(js, subject, b"job", "rid-1.0")
        again = await nats_bus.publish_job(js, subject, b"job", "rid-1.0")  # e.g. after a lost ack
        other = await nats_bus.publish_job(js, subject, b"job", "rid-1.1")  # the next attempt is a new job
        assert not first.duplicate and again.duplicate and again.seq == first.seq
        assert not other.duplicate and other.seq > first.seq
        info = await js.stream_info(subjects.PREFILL_STREAM, subjects_filter=subject)
        assert info.state.subjects == {subject: 2}
        await js.purge_stream(subjects.PREFILL_STREAM, subject=subject)
    finally:
        await nc.close()


async def test_a_job_publish_retries_while_no_stream_answers_calling_back_each_time(nats_server):
    """No stream takes the subject (as while a stream's leader is elected): the publish is retried
    until `retry_s`, and `on_retry` runs before each retry (the prefill worker's notice to the gateway
    that it still holds the request), then the last error is raised."""
    nc = await nats_bus.connect(nats_server.url, "test-retry")
    calls = []

    async def on_retry() -> None:
        calls.append(asyncio.get_running_loop().time())

    try:
        with pytest.raises(nats_bus.UNANSWERED):
            await nats_bus.publish_job(nc.jetstream(), "test.no.stream", b"job", "rid-2.0", timeout=0.2, retry_s=1.5,
                                       on_retry=on_retry)
        assert len(calls) >= 3, calls  # a retry every ~0.2 s (+ the no-responders answer)
    finally:
        await nc.close()


async def test_a_worker_s_consumer_waits_for_jetstream_to_answer(tmp_path):
    """A worker binding its pull consumer while JetStream does not answer (here a server without it,
    replaced by one with it on the same port; in the 3-host test a cluster busy with four engines
    loading) retries instead of dying at start."""
    port = free_port()
    plain = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    server = None
    try:
        wait_for_port(port, proc=plain)
        nc = await nats_bus.connect(f"nats://127.0.0.1:{port}", "test-consumer-wait")
        try:
            binding = asyncio.create_task(nats_bus.pull_subscription(nc.jetstream(), subjects.DECODE_STREAM, "decode",
                                                                     subjects.DECODE_JOBS))
            await asyncio.sleep(1.5)
            assert not binding.done()  # no JetStream: still trying
            plain.terminate()
            plain.wait(5)
            server = await asyncio.to_thread(start_nats, port, tmp_path)
            admin = await nats_bus.connect(server.url, "test-consumer-admin")
            await nats_bus.ensure_streams(admin.jetstream())
            await admin.close()
            sub = await asyncio.wait_for(binding, 30)
            info = await sub.consumer_info()
            assert info.name == "decode" and info.config.filter_subject == subjects.DECODE_JOBS
        finally:
            await nc.close()
    finally:
        plain.kill()
        if server is not None:
            server.stop()


@pytest.mark.slow
async def test_a_three_node_cluster_replicates_the_work_queues(tmp_path):
    nodes = await asyncio.to_thread(start_nats_cluster, 3, tmp_path)
    try:
        for _ in range(50):  # the routes between the nodes form within moments of their start
            nc = await nats_bus.connect(cluster_url(nodes), "test-cluster")
            if nats_bus.stream_replicas(nc) == 3:
                break
            await nc.close()
            await asyncio.sleep(0.1)
        try:
            assert nats_bus.stream_replicas(nc) == 3
            seen = nats_bus.describe(nc)
            assert seen["connected"] and seen["cluster"] == "pdserve" and seen["server"] == "nats-0"  # the first URL
            assert len(seen["cluster_urls"]) == 3
            js = nc.jetstream()
            await nats_bus.ensure_streams(js, replicas=nats_bus.stream_replicas(nc))  # waits for the election
            for stream in (subjects.PREFILL_STREAM, subjects.DECODE_STREAM):
                info = await js.stream_info(stream)
                assert info.config.num_replicas == 3 and info.config.duplicate_window == nats_bus.DEDUP_WINDOW_S
                assert info.cluster.leader and len(info.cluster.replicas) == 2
        finally:
            await nc.close()
    finally:
        for node in nodes:
            node.stop()


async def test_token_events_lost_in_an_outage_are_sent_again_on_request(nats_server):
    """A worker keeps its last seconds of token events; a gateway back from an outage asks
    (REPLAY_TOKENS) and gets them again — the final event included, which no later event would
    have revealed as lost. Older events than the window are not resent."""
    import time
    from collections import deque
    from types import SimpleNamespace

    from shared.protocol.messages import TokenEvent, decode
    from shared.transport.worker import REPLAY_WINDOW_S, WorkerRuntime as Worker

    nc = await nats_bus.connect(nats_server.url, "replay-test")
    worker = SimpleNamespace(nc=nc, config=SimpleNamespace(instance="decode-0"), attempts={}, _recent=deque(), _tasks=[])
    worker.replay_recent = lambda since, delays=(0.0,): Worker.replay_recent(worker, since, delays)
    got = []

    async def on_event(msg):
        got.append(decode(msg.data, TokenEvent))

    sub = await nc.subscribe(subjects.tokens("r1"), cb=on_event)
    await Worker.publish_tokens(worker, "r1", 0, [5, 6])
    await Worker.publish_tokens(worker, "r1", 2, [7], finished=True, finish_reason="stop")
    worker._recent.appendleft((time.monotonic() - REPLAY_WINDOW_S - 1, subjects.tokens("r1"), b"old"))
    await nc.flush()
    await asyncio.sleep(0.1)
    assert [(e.index, e.token_ids, e.finished) for e in got] == [(0, [5, 6], False), (2, [7], True)]
    await Worker._on_replay_request(worker, None)  # what a gateway's REPLAY_TOKENS message does
    await nc.flush()
    await asyncio.sleep(0.1)
    assert [(e.index, e.finished) for e in got[2:]] == [(0, False), (2, True)]
    await sub.unsubscribe()
    await nc.close()


async def test_a_job_failing_on_its_last_delivery_ends_its_request_at_once(nats_server):
    """A job that raises in a worker is handed back while it has deliveries left; on its last one
    its request gets an error event (the gateway ends it), instead of waiting out the queue timeout."""
    from collections import deque
    from types import SimpleNamespace

    from shared.protocol.messages import PrefillJob, SamplingMsg, TokenEvent, decode, encode
    from shared.transport.worker import WorkerRuntime as Worker

    nc = await nats_bus.connect(nats_server.url, "test-failing-job")
    js = nc.jetstream()
    await nats_bus.ensure_streams(js)
    instance = "failing-test"
    sub = await nats_bus.worker_subscription(js, subjects.PREFILL_STREAM, subjects.PREFILL_JOBS, instance,
                                             ack_wait=30, max_deliver=2)
    worker = SimpleNamespace(nc=nc, config=SimpleNamespace(role="prefill", instance=instance, max_deliver=2),
                             attempts={}, _recent=deque(), _tasks=[])
    worker.publish_tokens = lambda *a, **k: Worker.publish_tokens(worker, *a, **k)
    worker.publish_error = lambda *a: Worker.publish_error(worker, *a)
    events = []

    async def on_event(msg):
        events.append(decode(msg.data, TokenEvent))

    events_sub = await nc.subscribe(subjects.tokens("r-fails"), cb=on_event)
    job = PrefillJob(request_id="r-fails", prompt_ids=[1, 2], params=SamplingMsg(), resume_ids=[9])
    await nats_bus.publish_job(js, subjects.worker_jobs(subjects.PREFILL_JOBS, instance), encode(job), "r-fails.0")
    for delivery in (1, 2):
        [msg] = await sub.fetch(1, timeout=5)
        assert msg.metadata.num_delivered == delivery
        try:
            raise RuntimeError("a bug")
        except RuntimeError:
            await Worker.job_failed(worker, msg, PrefillJob)
        await nc.flush()
        await asyncio.sleep(0.1)
        assert len(events) == delivery - 1  # handed back quietly the first time
    [error] = events
    assert error.finished and error.finish_reason == "error" and error.index == 1  # after the resumed token
    assert "failed this request's job 2 times" in error.error
    with pytest.raises(TimeoutError):
        await sub.fetch(1, timeout=1.5)  # terminated: never delivered again
    await events_sub.unsubscribe()
    await nc.close()
