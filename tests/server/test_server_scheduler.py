"""The scheduler with real threads: order, fairness, failure isolation, limits, stop, callbacks.

Jobs are synchronised with Events, never with sleeps: a "gate" job holds the worker so that the
jobs submitted behind it are all queued before any of them can run.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest

from twinkle.errors import ConfigurationError, StateError, TwinkleError
from twinkle.server.execution.scheduling.scheduler import Batchable, Job, QueueFullError, Scheduler, wait_job

# Seconds any wait in these tests may take before the test counts as hung.
TIMEOUT = 5.0


class Gate:
    """A job that holds the worker until the test opens the gate."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def job(self, order: list[str] | None = None, label: str = 'gate') -> Callable[[], str]:
        def fn() -> str:
            if order is not None:
                order.append(label)
            self.entered.set()
            if not self.opened.wait(TIMEOUT):
                raise TimeoutError('the test never opened the gate')
            return label

        return fn

    def hold(self, scheduler: Scheduler, tenant: str = 'gatekeeper', order: list[str] | None = None) -> Job:
        """Submit the gate job and return once the worker is inside it."""
        job = scheduler.submit(tenant, self.job(order, label=f'{tenant}-gate'))
        assert self.entered.wait(TIMEOUT)
        return job


def recorder(order: list[str], label: str, result: Any = None) -> Callable[[], Any]:
    def fn() -> Any:
        order.append(label)  # list.append is atomic; only the worker thread appends anyway
        return result

    return fn


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
def make_scheduler(gate: Gate) -> Iterator[Callable[..., Scheduler]]:
    made: list[Scheduler] = []

    def make(**kwargs: Any) -> Scheduler:
        scheduler = Scheduler(**kwargs)
        scheduler.start()
        made.append(scheduler)
        return scheduler

    yield make
    gate.opened.set()
    for scheduler in made:
        scheduler.stop()


def test_jobs_of_one_tenant_run_in_submission_order(make_scheduler, gate):
    scheduler, order = make_scheduler(), []
    gate.hold(scheduler)
    jobs = [scheduler.submit('alice', recorder(order, f'a{i}', result=i)) for i in range(10)]
    assert scheduler.queued('alice') == 10 and scheduler.queued() == 10
    gate.opened.set()
    assert scheduler.drain(TIMEOUT)
    assert order == [f'a{i}' for i in range(10)]
    assert [job.result for job in jobs] == list(range(10))
    assert all(job.status == 'done' and job.done.is_set() for job in jobs)
    assert all(job.started_at >= job.submitted_at and job.finished_at >= job.started_at for job in jobs)


def test_single_job_of_second_tenant_waits_only_for_the_running_job(make_scheduler, gate):
    # A's first job holds the worker while A queues 19 more and B then submits 1. The running
    # tenant re-enters the rotation only when its job ends, behind B, so the order is
    # A0 (already running), B0, then A1..A19: B waits for no job but the one already running.
    scheduler, order = make_scheduler(), []
    scheduler.submit('A', gate.job(order, label='A0'))
    assert gate.entered.wait(TIMEOUT)
    for i in range(1, 20):
        scheduler.submit('A', recorder(order, f'A{i}'))
    scheduler.submit('B', recorder(order, 'B0'))
    gate.opened.set()
    assert scheduler.drain(TIMEOUT)
    assert order.index('B0') == 1
    assert order == ['A0', 'B0'] + [f'A{i}' for i in range(1, 20)]


def test_tenants_with_work_are_served_round_robin(make_scheduler, gate):
    # Behind the gate, A queues 3 jobs, then B 2, then C 1: tenants take turns in the order they
    # first queued work, and a tenant drops out of the rotation once its queue is empty.
    scheduler, order = make_scheduler(), []
    gate.hold(scheduler)
    for tenant, count in (('A', 3), ('B', 2), ('C', 1)):
        for i in range(count):
            scheduler.submit(tenant, recorder(order, f'{tenant}{i}'))
    assert scheduler.stats()['queued'] == {'A': 3, 'B': 2, 'C': 1}
    gate.opened.set()
    assert scheduler.drain(TIMEOUT)
    assert order == ['A0', 'B0', 'C0', 'A1', 'B1', 'A2']


def test_weighted_tenants_lead_passes_in_proportion_to_their_weights(make_scheduler, gate):
    # Deficit round robin: weight 2 runs two in a row where weight 1 runs one, 0.5 one every other
    # round; a tenant whose queue empties leaves the rotation, and its credit with it.
    weights = {'A': 2.0, 'B': 1.0, 'C': 0.5, 'gatekeeper': 1.0}
    scheduler, order = make_scheduler(weight_of=weights.__getitem__), []
    gate.hold(scheduler)
    for tenant, count in (('A', 6), ('B', 3), ('C', 2)):
        for i in range(count):
            scheduler.submit(tenant, recorder(order, f'{tenant}{i}'))
    gate.opened.set()
    assert scheduler.drain(TIMEOUT)
    assert order == ['A0', 'A1', 'B0', 'A2', 'A3', 'B1', 'C0', 'A4', 'A5', 'B2', 'C1']


def test_a_failing_job_fails_alone(make_scheduler, gate):
    scheduler, order = make_scheduler(), []
    gate.hold(scheduler)
    error = ValueError('boom')

    def explode() -> None:
        raise error

    bad = scheduler.submit('alice', explode)
    good = scheduler.submit('alice', recorder(order, 'after', result=42))
    gate.opened.set()
    assert good.wait(TIMEOUT) and bad.wait(TIMEOUT)
    assert (bad.status, bad.error, bad.result) == ('failed', error, None)
    assert (good.status, good.error, good.result) == ('done', None, 42)
    assert order == ['after']
    assert scheduler.drain(TIMEOUT)
    stats = scheduler.stats()
    assert (stats['completed'], stats['failed'], stats['alive']) == (3, 1, True)  # gate, bad, good


def test_full_queue_refuses_with_retry_hint_and_other_tenants_still_submit(make_scheduler, gate):
    scheduler = make_scheduler(max_queued_per_tenant=2)
    gate.hold(scheduler, tenant='alice')  # the running job does not count against the limit
    scheduler.submit('alice', lambda: None)
    scheduler.submit('alice', lambda: None)
    with pytest.raises(QueueFullError) as caught:
        scheduler.submit('alice', lambda: None)
    error = caught.value
    assert isinstance(error, TwinkleError) and isinstance(error, RuntimeError)
    assert (error.tenant, error.limit) == ('alice', 2)
    assert "'alice'" in str(error) and 'max_queued_per_tenant=2' in str(error)
    # No job has finished yet, so there is no mean duration: the hint is the 1 s floor.
    assert error.retry_after_s == 1.0
    assert scheduler.queued('alice') == 2
    # The server's own work for alice (releasing her idle adapter) is not crowded out by her queue.
    release = scheduler.submit('alice', lambda: 'released', internal=True)
    bob = scheduler.submit('bob', lambda: 'bob ran')
    gate.opened.set()
    assert bob.wait(TIMEOUT) and bob.result == 'bob ran'
    assert release.wait(TIMEOUT) and release.result == 'released'


def test_retry_after_scales_with_the_recent_mean_duration(make_scheduler, gate):
    # One finished job of >= 0.6 s makes the mean >= 0.6 s; with 2 jobs queued the hint is
    # 2 * mean >= 1.2 s, above the 1 s floor. (The sleep is the job's work, not synchronisation.)
    scheduler = make_scheduler(max_queued_per_tenant=2)
    assert scheduler.submit('alice', lambda: time.sleep(0.6)).wait(TIMEOUT)
    gate.hold(scheduler, tenant='alice')
    scheduler.submit('alice', lambda: None)
    scheduler.submit('alice', lambda: None)
    with pytest.raises(QueueFullError) as caught:
        scheduler.submit('alice', lambda: None)
    mean = scheduler.stats()['mean_duration_s']
    assert mean >= 0.6
    assert caught.value.retry_after_s == pytest.approx(2 * mean)


def test_concurrent_submits_from_eight_threads(make_scheduler, gate):
    # 8 threads submit 50 jobs each, 4 tenants shared by 2 threads each: nothing is lost, ids are
    # unique, and each thread's jobs run in the order that thread submitted them.
    scheduler, order = make_scheduler(max_queued_per_tenant=1000), []
    gate.hold(scheduler)
    barrier, jobs, lock = threading.Barrier(8), [], threading.Lock()

    def submitter(thread_index: int) -> None:
        barrier.wait(TIMEOUT)
        mine = [
            scheduler.submit(f'tenant{thread_index % 4}', recorder(order, f't{thread_index}-{i}')) for i in range(50)
        ]
        with lock:
            jobs.extend(mine)

    threads = [threading.Thread(target=submitter, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert scheduler.queued() == 400
    gate.opened.set()
    assert scheduler.drain(TIMEOUT)
    assert len({job.id for job in jobs}) == 400 and all(job.status == 'done' for job in jobs)
    assert sorted(order) == sorted(f't{t}-{i}' for t in range(8) for i in range(50))
    for thread_index in range(8):
        mine = [label for label in order if label.startswith(f't{thread_index}-')]
        assert mine == [f't{thread_index}-{i}' for i in range(50)]


def test_stop_finishes_the_running_job_and_returns_the_queued_ones(make_scheduler, gate):
    scheduler, order = make_scheduler(), []
    running = gate.hold(scheduler, order=order)
    queued = [scheduler.submit('alice', recorder(order, 'a0')), scheduler.submit('bob', recorder(order, 'b0'))]
    left = scheduler.stop(wait=False)
    assert left == queued and all(job.status == 'pending' for job in left)
    assert scheduler.queued() == 0
    with pytest.raises(StateError, match='stopped'):
        scheduler.submit('alice', lambda: None)
    gate.opened.set()
    assert scheduler.stop() == []  # a second stop only waits for the worker to end
    assert running.status == 'done' and not scheduler.stats()['alive']
    assert order == ['gatekeeper-gate']  # the returned jobs never ran
    left[0].fail(StateError('the server stopped'))
    assert left[0].done.is_set() and left[0].status == 'failed'
    assert scheduler.get(left[1].id) is left[1]  # still findable for the caller to fail


def test_withdraw_takes_the_chosen_waiting_jobs_and_the_others_run_in_order(make_scheduler, gate):
    scheduler, order = make_scheduler(), []
    gate.hold(scheduler, order=order)
    jobs = {label: scheduler.submit(label[0], recorder(order, label)) for label in ('a0', 'b0', 'a1', 'c0')}
    taken = scheduler.withdraw(lambda job: job.tenant in ('a', 'c'))  # a gone client's, say
    assert taken == [jobs['a0'], jobs['a1'], jobs['c0']] and all(job.status == 'pending' for job in taken)
    assert scheduler.queued() == 1 and scheduler.get(jobs['a0'].id) is jobs['a0']  # findable, for its caller to fail
    gate.opened.set()
    assert jobs['b0'].wait(TIMEOUT) and scheduler.drain(TIMEOUT)
    assert order == ['gatekeeper-gate', 'b0']  # the withdrawn never ran
    assert scheduler.withdraw(lambda job: True) == []


def test_a_withdraw_during_the_wait_for_companions_leaves_the_worker_serving(make_scheduler, gate):
    # alice and bob shared a pass, so alice's next job waits up to mix_wait_s for bob's; it is
    # withdrawn meanwhile, leaving nothing queued when the wait ends.
    scheduler = make_scheduler(mix_wait_s=0.5)
    gate.hold(scheduler)
    first = [submit_shareable(scheduler, name) for name in ('alice', 'bob')]
    gate.opened.set()
    assert all(job.wait(TIMEOUT) for job in first) and first[0].pass_size == 2
    waiting = submit_shareable(scheduler, 'alice')
    time.sleep(0.1)  # the worker starts its wait (nothing shows it; a slow one misses this test's point only)
    assert scheduler.withdraw(lambda job: job is waiting) == [waiting]
    time.sleep(0.6)  # past the wait's end, with nothing queued
    later = scheduler.submit('carol', lambda: 'ran')
    assert later.wait(TIMEOUT) and later.result == 'ran' and waiting.status == 'pending'


def test_callbacks_run_around_each_job_on_the_worker_thread(make_scheduler):
    seen: list[tuple[str, str, str, bool]] = []
    main = threading.current_thread()

    def on_start(job: Job) -> None:
        seen.append(('start', job.id, job.status, threading.current_thread() is main))

    def on_finish(job: Job) -> None:
        # on_finish sees the outcome before waiters are woken, so what it records is there first.
        seen.append(('finish', job.id, job.status, job.done.is_set()))

    scheduler = make_scheduler(on_start=on_start, on_finish=on_finish)
    job = scheduler.submit('alice', lambda: 1, job_id='job-1')
    assert job.wait(TIMEOUT)
    assert seen == [('start', 'job-1', 'running', False), ('finish', 'job-1', 'done', False)]


def test_a_raising_callback_does_not_stop_the_worker(make_scheduler):
    def broken(job: Job) -> None:
        raise RuntimeError(f'callback broke on {job.id}')

    scheduler = make_scheduler(on_start=broken, on_finish=broken)
    jobs = [scheduler.submit('alice', lambda index=index: index) for index in range(3)]
    assert scheduler.drain(TIMEOUT)
    assert [(job.status, job.result) for job in jobs] == [('done', 0), ('done', 1), ('done', 2)]
    assert scheduler.stats()['alive']


def test_wait_job_does_not_block_the_event_loop(make_scheduler, gate):
    scheduler = make_scheduler()
    held = scheduler.submit('alice', gate.job())

    async def main() -> tuple[bool, bool, bool]:
        waiter = asyncio.create_task(wait_job(held, timeout=TIMEOUT))
        await asyncio.sleep(0)  # the waiter is now parked on the job
        # The loop is free while the job runs: this coroutine runs and is the one to open the gate.
        assert not waiter.done()
        gate.opened.set()
        finished = await waiter
        already_done = await wait_job(held, timeout=0)
        second_gate = Gate()
        blocked = scheduler.submit('alice', second_gate.job())
        timed_out = await wait_job(blocked, timeout=0.05)
        assert blocked._callbacks == []  # a timed-out waiter leaves no callback behind
        second_gate.opened.set()
        return finished, already_done, timed_out

    assert asyncio.run(main()) == (True, True, False)
    assert held.status == 'done'


def test_get_keeps_only_the_most_recent_finished_jobs(make_scheduler):
    scheduler = make_scheduler(keep_finished=2)
    jobs = [scheduler.submit('alice', lambda: None, job_id=f'job-{i}') for i in range(4)]
    assert scheduler.drain(TIMEOUT)
    assert [scheduler.get(job.id) for job in jobs] == [None, None, jobs[2], jobs[3]]
    assert scheduler.get('never-submitted') is None


def test_bad_arguments_name_the_value(make_scheduler):
    with pytest.raises(ConfigurationError, match='max_queued_per_tenant must be at least 1, got 0'):
        Scheduler(max_queued_per_tenant=0)
    scheduler = make_scheduler()
    scheduler.submit('alice', lambda: None, job_id='same')
    with pytest.raises(ConfigurationError, match="'same' is already in use"):
        scheduler.submit('bob', lambda: None, job_id='same')
    with pytest.raises(StateError, match='already started'):
        scheduler.start()


def test_module_docstring_example_runs():
    import doctest

    import twinkle.server.execution.scheduling.scheduler as scheduler_module

    assert doctest.testmod(scheduler_module).failed == 0


def test_a_shared_pass_fails_only_the_job_it_returns_an_error_for(make_scheduler, gate):
    # run_many answers an error for 'bob': bob fails, alice and carol get their results, and
    # no job's own fn runs (a rerun after the pass would train the others twice).
    scheduler = make_scheduler()
    gate.hold(scheduler)
    order: list[str] = []
    error = ValueError('bob: loss is inf')

    def run_many(payloads: list[str]) -> list[Any]:
        order.append('pass')
        return [error if name == 'bob' else name.upper() for name in payloads]

    jobs = {
        name: scheduler.submit(name, recorder(order, name), batch=Batchable('fb', 1, name, run_many))
        for name in ('alice', 'bob', 'carol')
    }
    gate.opened.set()
    assert all(job.wait(TIMEOUT) for job in jobs.values())
    assert order == ['pass']
    assert {name: (job.status, job.result, job.pass_size) for name, job in jobs.items()} == {
        'alice': ('done', 'ALICE', 3),
        'bob': ('failed', None, 3),
        'carol': ('done', 'CAROL', 3),
    }
    assert jobs['bob'].error is error


def test_a_pass_that_raises_runs_its_jobs_one_by_one(make_scheduler, gate):
    scheduler = make_scheduler()
    gate.hold(scheduler)
    order: list[str] = []

    def run_many(payloads: list[str]) -> list[Any]:
        raise ValueError('one row is bad')

    jobs = [
        scheduler.submit(name, recorder(order, name, result=name), batch=Batchable('fb', 1, name, run_many))
        for name in ('alice', 'bob')
    ]
    gate.opened.set()
    assert all(job.wait(TIMEOUT) for job in jobs)
    assert order == ['alice', 'bob'] and [(job.result, job.pass_size) for job in jobs] == [('alice', 1), ('bob', 1)]


def test_on_idle_runs_once_per_idle_spell_on_the_worker_thread(make_scheduler):
    calls: list[bool] = []
    called = threading.Semaphore(0)
    main = threading.current_thread()

    def on_idle() -> None:
        calls.append(threading.current_thread() is main)
        called.release()

    scheduler = make_scheduler(on_idle=on_idle, idle_after_s=0.05)
    assert scheduler.submit('alice', lambda: 1).wait(TIMEOUT)
    assert called.acquire(timeout=TIMEOUT)
    # Idle for six times idle_after_s more: still one call, as nothing ran since.
    assert not called.acquire(timeout=0.3)
    assert scheduler.submit('bob', lambda: 2).wait(TIMEOUT)
    assert called.acquire(timeout=TIMEOUT)
    assert calls == [False, False]


def test_a_raising_on_idle_does_not_stop_the_worker(make_scheduler):
    raised = threading.Event()

    def on_idle() -> None:
        raised.set()
        raise RuntimeError('trim failed')

    scheduler = make_scheduler(on_idle=on_idle, idle_after_s=0.01)
    assert scheduler.submit('alice', lambda: 1).wait(TIMEOUT)
    assert raised.wait(TIMEOUT)
    job = scheduler.submit('alice', lambda: 2)
    assert job.wait(TIMEOUT) and job.result == 2
    with pytest.raises(ConfigurationError, match='idle_after_s must be positive, got 0'):
        Scheduler(idle_after_s=0)


def submit_shareable(scheduler: Scheduler, name: str) -> Job:
    """Tenant ``name``'s job that can share a pass of kind 'fb' (a pass returns its payloads, the names)."""
    return scheduler.submit(name, lambda: name, batch=Batchable('fb', 1, name, lambda payloads: payloads))


def test_a_job_that_can_share_waits_for_the_companions_of_its_last_pass(make_scheduler, gate):
    # alice, bob and carol shared a pass; alice's next job, first to arrive, waits for theirs
    # (up to mix_wait_s, here far longer than the test) instead of starting alone.
    scheduler = make_scheduler(mix_wait_s=60.0)
    gate.hold(scheduler)

    submit = partial(submit_shareable, scheduler)
    first = [submit(name) for name in ('alice', 'bob', 'carol')]
    gate.opened.set()
    assert all(job.wait(TIMEOUT) for job in first) and {job.pass_size for job in first} == {3}
    lead = submit('alice')
    time.sleep(0.3)  # what the worker does meanwhile: wait
    assert lead.status == 'pending'
    second = [lead, submit('bob'), submit('carol')]
    assert all(job.wait(TIMEOUT) for job in second)
    assert {(job.pass_id, job.pass_size) for job in second} == {(first[0].pass_id + 1, 3)}


@pytest.mark.slow
def test_the_wait_for_companions_ends_after_mix_wait_s_and_a_lone_tenant_does_not_wait(make_scheduler, gate):
    wait_s = 1.0
    scheduler = make_scheduler(mix_wait_s=wait_s)
    gate.hold(scheduler)

    submit = partial(submit_shareable, scheduler)
    pair = [submit('alice'), submit('bob')]
    gate.opened.set()
    assert all(job.wait(TIMEOUT) for job in pair) and pair[0].pass_size == 2
    # bob sends nothing more: alice waits mix_wait_s, then runs alone, twice (bob was in one
    # of her last two passes), then no more.
    for waited in (True, True, False):
        job = submit('alice')
        assert job.wait(TIMEOUT) and job.pass_size == 1 and job.started_at is not None
        assert (job.started_at - job.submitted_at >= wait_s) is waited
    plain = [scheduler.submit('carol', lambda: 'c'), scheduler.submit('dave', lambda: 'd')]
    assert all(job.wait(TIMEOUT) for job in plain)  # jobs that cannot share never wait


def test_a_tenant_one_pass_behind_the_others_is_waited_for_and_joins_them(make_scheduler, gate):
    # dave missed alice, bob and carol's pass and ran alone after it. Expecting only the tenants
    # of the last pass (dave), the next one would start without dave again, keeping him one pass
    # behind for good; expecting those of the last two, it waits for him.
    scheduler = make_scheduler(mix_wait_s=1.0)
    gate.hold(scheduler)

    submit = partial(submit_shareable, scheduler)
    trio = [submit(name) for name in ('alice', 'bob', 'carol')]
    gate.opened.set()
    assert all(job.wait(TIMEOUT) for job in trio) and trio[0].pass_size == 3
    late = submit('dave')
    assert late.wait(TIMEOUT) and late.pass_size == 1
    step = [submit(name) for name in ('alice', 'bob', 'carol')]
    time.sleep(0.1)  # dave's next request comes a little after the others'
    step.append(submit('dave'))
    assert all(job.wait(TIMEOUT) for job in step)
    assert {job.pass_size for job in step} == {4}


def test_mix_wait_must_not_be_negative():
    with pytest.raises(ConfigurationError, match='mix_wait_s must be 0 or more, got -1'):
        Scheduler(mix_wait_s=-1)


def test_no_wait_for_companions_while_other_work_is_queued(make_scheduler, gate):
    scheduler = make_scheduler(mix_wait_s=60.0)
    gate.hold(scheduler)

    submit = partial(submit_shareable, scheduler)
    trio = [submit(name) for name in ('alice', 'bob', 'carol')]
    gate.opened.set()
    assert all(job.wait(TIMEOUT) for job in trio) and trio[0].pass_size == 3
    second = Gate()
    second.hold(scheduler)
    lead, other = submit('alice'), scheduler.submit('dave', lambda: 'd')
    second.opened.set()
    # alice's job would wait for bob and carol, but dave's job is there to run: neither idles.
    assert lead.wait(TIMEOUT) and other.wait(TIMEOUT) and lead.pass_size == 1
