"""The serving queue: arrival order, a bound that refuses at once, a cancelled waiting job leaves its place."""
import asyncio
import threading

import pytest

from runtime.serving.scheduler import Closed, Job, QueueFull, Scheduler


def test_jobs_run_in_arrival_order_and_a_full_queue_refuses():
    loop = asyncio.new_event_loop()
    sched = Scheduler(max_queue=2)
    gate, started, order = threading.Event(), threading.Event(), []

    def hold(job):
        started.set()
        gate.wait()

    sched.submit(Job(hold, loop))
    started.wait()
    last = threading.Event()
    jobs = [Job(lambda job, i=i: order.append(i) or (i == 2 and last.set()), loop) for i in range(3)]
    sched.submit(jobs[0])
    sched.submit(jobs[1])
    with pytest.raises(QueueFull) as e:
        sched.submit(jobs[2])
    assert e.value.retry_after_s >= 1 and sched.depth == 2
    sched.cancel(jobs[0])  # leaves the queue at once: its place is free
    assert sched.depth == 1
    sched.submit(jobs[2])
    gate.set()
    assert last.wait(30)
    assert order == [1, 2]
    sched.close(timeout_s=30)
    with pytest.raises(Closed):
        sched.submit(Job(hold, loop))


def test_a_failing_job_does_not_stop_the_worker():
    loop = asyncio.new_event_loop()
    sched = Scheduler(max_queue=4)
    done = threading.Event()
    sched.submit(Job(lambda job: 1 / 0, loop))
    sched.submit(Job(lambda job: done.set(), loop))
    assert done.wait(30)
    sched.close(timeout_s=30)
