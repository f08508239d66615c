"""The queue host (megatrain_ray.orchestration.queues): the semantics of queue.Queue that the roles rely
on, through one real actor holding several named queues."""

import os
import pickle
import queue
import signal
import threading
import time

import pytest
import ray

from megatrain_ray.orchestration.queues import QueueClient, QueueHost


@pytest.fixture(scope="module")
def host(ray_cluster):
    actor = ray.remote(QueueHost).options(num_cpus=0).remote()
    ray.get(actor.size.remote("up", 0))
    yield actor
    ray.kill(actor, no_restart=True)


def test_items_come_back_in_order_and_the_queues_of_one_host_are_apart(host):
    a, b = QueueClient(host, "order-a"), QueueClient(host, "order-b")
    for item in (1, {"step": 0, "lr": 1e-3}, (2, 3)):
        a.put(item, timeout=5)
    b.put("other")
    assert (a.qsize(), a.qsize(within=5), b.qsize()) == (3, 3, 1)
    assert [a.get(timeout=5) for _ in range(3)] == [1, {"step": 0, "lr": 1e-3}, (2, 3)]
    assert a.qsize() == 0 and b.get(block=False) == "other" and b.qsize() == 0


def test_a_get_on_an_empty_queue_raises_empty_after_its_timeout(host):
    q = QueueClient(host, "empty")
    started = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.5)
    assert 0.45 <= time.monotonic() - started < 5
    with pytest.raises(queue.Empty):
        q.get(block=False, timeout=5)  # block=False: the timeout does not apply
    with pytest.raises(queue.Empty):
        q.get(block=False)


def test_a_bounded_queue_raises_full_and_takes_the_item_once_there_is_room(host):
    q = QueueClient(host, "bounded", maxsize=2)
    q.put(0, timeout=1)
    q.put(1, block=False)
    assert q.qsize() == q.maxsize
    with pytest.raises(queue.Full):
        q.put(2, block=False)
    started = time.monotonic()
    with pytest.raises(queue.Full):
        q.put(2, timeout=0.5)
    assert 0.45 <= time.monotonic() - started < 5
    threading.Timer(0.3, q.get).start()  # room in 0.3 s: the waiting put goes in then
    q.put(2, timeout=10)
    assert [q.get(timeout=1) for _ in range(2)] == [1, 2] and q.qsize() == 0


def test_a_waiting_get_is_answered_by_a_put_from_another_process(host):
    q = QueueClient(host, "across")

    @ray.remote(num_cpus=0)
    def later(client, item):
        time.sleep(0.3)
        client.put(item)

    ref = later.remote(pickle.loads(pickle.dumps(q)), "ticket")  # the client travels as the roles' do
    assert q.get(timeout=30) == "ticket"
    ray.get(ref)


def test_a_timed_out_get_takes_no_item(host):
    q = QueueClient(host, "no-loss")
    for _ in range(20):
        with pytest.raises(queue.Empty):
            q.get(timeout=0.01)
    q.put("kept")
    assert q.qsize() == 1 and q.get(timeout=1) == "kept"


def test_a_negative_timeout_is_refused():
    with pytest.raises(ValueError):
        QueueClient(None, "x").get(timeout=-1)


def test_drain_takes_every_waiting_item_in_order_in_one_call_and_leaves_the_queue_empty(host):
    q = QueueClient(host, "drain")
    assert q.drain(within=5) == []
    for item in range(5):
        q.put(item)
    assert q.drain(within=5) == [0, 1, 2, 3, 4] and q.qsize() == 0
    q.put("after")
    assert q.drain() == ["after"]


def test_drain_and_size_of_a_frozen_host_give_up_within_their_time(ray_cluster):
    actor = ray.remote(QueueHost).options(num_cpus=0).remote()
    ray.get(actor.size.remote("up", 0))
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGSTOP)  # a hung host: the driver's salvage after a failure must not wait on it for ever
    try:
        started = time.monotonic()
        client = QueueClient(actor, "frozen")
        with pytest.raises(ray.exceptions.GetTimeoutError):
            client.drain(within=0.5)
        with pytest.raises(ray.exceptions.GetTimeoutError):
            client.qsize(within=0.5)  # the driver's queue-depth gauge: it must not hang a step's row either
        assert time.monotonic() - started < 5
    finally:
        os.kill(pid, signal.SIGCONT)
        ray.kill(actor, no_restart=True)
