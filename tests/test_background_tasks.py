"""Stopping the adapter's long-lived tasks (watchers, pollers) for sure: april_ext.sglang.background.cancel_and_wait.
A Ray run's shutdown hung on an engine-pool watcher whose cancellation asyncio.wait_for had swallowed (before
Python 3.12 it does when the cancellation arrives as its inner future completes): the task ran on, and the single
cancel-then-await waited for it forever."""

from __future__ import annotations

import asyncio

from april_ext.sglang.background import cancel_and_wait


async def _watcher_that_loses_one_cancellation(ticks: list[int]) -> None:
    """A polling loop whose first cancellation is lost, as asyncio.wait_for loses one."""
    lost = False
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if lost:
                raise
            lost = True
            asyncio.current_task().uncancel()
        ticks.append(1)


def test_a_task_that_loses_a_cancellation_is_cancelled_again_until_it_ends() -> None:
    async def main() -> tuple[bool, asyncio.Task[None]]:
        task = asyncio.create_task(_watcher_that_loses_one_cancellation([]))
        await asyncio.sleep(0.05)
        task.cancel()  # what the shutdown did: one cancel, then await the task
        _, pending = await asyncio.wait({task}, timeout=0.3)
        still_running = task in pending
        await asyncio.wait_for(cancel_and_wait([task, None], retry_s=0.05), 5)
        return still_running, task

    still_running, task = asyncio.run(main())
    assert still_running  # one cancel did not end it
    assert task.cancelled()


def test_tasks_that_ended_or_failed_are_awaited_without_raising() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def main() -> list[asyncio.Task[None]]:
        tasks = [asyncio.create_task(fails()), asyncio.create_task(asyncio.sleep(60))]
        await asyncio.sleep(0)
        await asyncio.wait_for(cancel_and_wait(tasks), 5)
        return tasks

    failed, sleeping = asyncio.run(main())
    assert isinstance(failed.exception(), RuntimeError) and sleeping.cancelled()


def test_a_ray_engine_leaves_although_its_pool_watcher_lost_a_cancellation() -> None:
    from april_ext.cluster.ray_engine import RayEngine

    class Pool:
        def membership(self, engine: object) -> None:
            return None

        def watch(self, rejoin: object, members: object):
            return _watcher_that_loses_one_cancellation([])

    async def main() -> bool:
        async def enter_and_leave() -> None:
            async with RayEngine(object(), Pool()):  # type: ignore[arg-type]
                await asyncio.sleep(0.05)

        leaving = asyncio.create_task(enter_and_leave())
        done, _ = await asyncio.wait({leaving}, timeout=5)
        if not done:
            leaving.cancel()
        return bool(done)

    assert asyncio.run(main()), "RayEngine.__aexit__ still waits for its watcher"
