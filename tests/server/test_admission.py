"""Admission without a model: seats, the priority queue, timeouts, hang-ups, release exactly once."""

from __future__ import annotations

import asyncio

import pytest

from trtedge.server.admission import Admission
from trtedge.server.errors import APIError


def run(coro):
    return asyncio.run(coro)


def test_without_ifb_one_runs_queue_fills_then_429_with_retry_after():
    async def main():
        a = Admission.for_engine(False, max_batch_size=8, max_queued=1, timeout=60)
        seat = await a.acquire()
        waiter = asyncio.ensure_future(a.acquire())
        await asyncio.sleep(0)
        assert (a.num_active, a.num_waiting) == (1, 1)
        with pytest.raises(APIError) as e:
            await a.acquire()
        assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1
        seat.release()
        second = await waiter
        assert (a.num_active, a.num_waiting) == (1, 0)
        second.release()
        assert a.num_active == 0

    run(main())


def test_with_ifb_batch_plus_queue_in_flight_then_immediate_429():
    async def main():
        a = Admission.for_engine(True, max_batch_size=2, max_queued=3, timeout=60)
        seats = [await a.acquire() for _ in range(5)]
        with pytest.raises(APIError) as e:
            await a.acquire()
        assert e.value.status == 429 and "5 requests are in flight" in e.value.message
        seats[0].release()
        (await a.acquire()).release()
        assert a.stats.refused_queue_full == 1

    run(main())


def test_waiters_are_served_by_priority_then_arrival():
    async def main():
        a = Admission(1, 10, timeout=60)
        running = await a.acquire()
        order = []

        async def wait(name, priority):
            seat = await a.acquire(priority)
            order.append(name)
            seat.release()

        tasks = [asyncio.ensure_future(wait(n, p)) for n, p in [("a", 0), ("b", 5), ("c", 0), ("d", 5)]]
        await asyncio.sleep(0)
        running.release()
        await asyncio.gather(*tasks)
        assert order == ["b", "d", "a", "c"]

    run(main())


def test_queue_timeout_gives_429_and_leaves_the_queue():
    async def main():
        a = Admission(1, 4, timeout=0.05)
        seat = await a.acquire()
        with pytest.raises(APIError) as e:
            await a.acquire()
        assert e.value.status == 429 and "--queue-timeout" in e.value.message
        assert a.num_waiting == 0 and a.stats.refused_queue_timeout == 1
        seat.release()
        assert a.num_active == 0

    run(main())


def test_hang_up_while_queued_leaves_the_queue_without_a_seat():
    async def main():
        a = Admission(1, 4, timeout=60)
        seat = await a.acquire()
        gone = asyncio.Event()
        waiter = asyncio.ensure_future(a.acquire(abort=gone))
        await asyncio.sleep(0)
        gone.set()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (a.num_active, a.num_waiting, a.stats.left_queue) == (1, 0, 1)
        seat.release()
        assert a.num_active == 0

    run(main())


def test_seat_released_twice_counts_once_and_cancelled_waiter_passes_its_seat_on():
    async def main():
        a = Admission(1, 4, timeout=60)
        seat = await a.acquire()
        first = asyncio.ensure_future(a.acquire())
        second = asyncio.ensure_future(a.acquire())
        await asyncio.sleep(0)
        seat.release()
        seat.release()
        first.cancel()  # handed the seat, but gone before it ran: the seat moves to the next waiter
        with pytest.raises(asyncio.CancelledError):
            await first
        got = await second
        assert (a.num_active, a.num_waiting) == (1, 0)
        got.release()
        assert a.num_active == 0

    run(main())


def test_draining_refuses_new_requests_with_503():
    async def main():
        a = Admission(1, 4, timeout=60)
        a.draining = True
        with pytest.raises(APIError) as e:
            await a.acquire()
        assert e.value.status == 503

    run(main())


def test_refuse_waiting_fails_every_waiter_with_the_error_and_takes_no_seat():
    async def main():
        a = Admission(1, 10, timeout=60)
        running = await a.acquire()
        waiters = [asyncio.ensure_future(a.acquire()) for _ in range(3)]
        await asyncio.sleep(0)
        a.refuse_waiting(APIError(503, "the server is shutting down", code="shutting_down"))
        for w in waiters:
            with pytest.raises(APIError) as e:
                await w
            assert e.value.code == "shutting_down"
        assert (a.num_active, a.num_waiting) == (1, 0)
        running.release()
        assert a.num_active == 0

    run(main())
