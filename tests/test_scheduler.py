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


def test_active_tasks_advance_together_up_to_max_active():
    """Tasks a job's work returns are stepped in rounds, at most `max_active` at once; a third waits its turn."""
    loop = asyncio.new_event_loop()
    rounds, finished = [], threading.Event()

    def step(active):
        rounds.append(sorted(active.values()))
        for job, name in active.items():
            left[name] -= 1
        done = [job for job, name in active.items() if left[name] == 0]
        if len(done) == len(active) and not sched.depth:
            finished.set()
        return done
    left = {"a": 2, "b": 3, "c": 1}
    sched = Scheduler(max_queue=4, max_active=2, step=step)
    gate, held = threading.Event(), threading.Event()
    sched.submit(Job(lambda job: held.set() or gate.wait() and None, loop))  # holds the worker meanwhile
    assert held.wait(30)
    for name in "abc":
        sched.submit(Job(lambda job, name=name: name, loop))
    gate.set()
    assert finished.wait(30)
    assert rounds == [["a", "b"], ["a", "b"], ["b", "c"]]
    sched.close(timeout_s=30)
