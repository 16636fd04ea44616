"""The reward pipeline of a rollout driver: each completed group is scored in a task of its own (so a slow reward
never holds up the driver), its rewards go through the group filter, and the verdict is reported; the failures of
those tasks are collected for the driver to raise in its own loop.

Both drivers use it: the RolloutLoop (rewards by reward_fn, or an environment's; in deterministic mode it reports
the verdicts itself, in the order the groups completed) and CustomGenerateRollout (the function's own rewards
first; it holds back the verdict that would end its step).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from april_ext.data_source import Prompt
from april_ext.protocol.reward import score_group
from april_ext.scheduler import CompletedGroup

RewardFn = Callable[[Prompt, np.ndarray], "float | Awaitable[float]"]
"""Scores one response (token ids) of a prompt; may be a plain function (run in a worker thread) or async."""
GroupFilter = Callable[[Sequence[float]], bool]
"""Decides from a group's rewards whether it is trained on (True) or dropped (e.g. DAPO dynamic sampling)."""
Verdict = tuple[list[float], bool]
"""A group's rewards and whether the filter accepted it."""


class RewardPipeline:
    """Scores completed groups in tasks: ``rewards_of(group)`` (by default :meth:`score_group`, reward_fn's),
    then group_filter(rewards) -> bool (None: every group is accepted), then ``report(group, rewards,
    accepted)``; with no ``report`` the verdict is only the task's result, for the caller to report. A task's
    failure is appended to ``failures`` (the driver's list) and every task's end calls ``notify``."""

    def __init__(self, reward_fn: RewardFn | None, group_filter: GroupFilter | None, *,
                 failures: list[BaseException], notify: Callable[[], None],
                 rewards_of: Callable[[CompletedGroup], Awaitable[Sequence[float]]] | None = None,
                 report: Callable[[CompletedGroup, list[float], bool], None] | None = None) -> None:
        self.reward_fn = reward_fn
        self.group_filter = group_filter
        self.failures = failures
        self._notify = notify
        self._rewards_of = rewards_of or self._reward_fn_of
        self._report = report
        self._async = inspect.iscoroutinefunction(reward_fn) or \
            inspect.iscoroutinefunction(getattr(reward_fn, "__call__", None))
        self.tasks: set[asyncio.Task[Verdict]] = set()

    @property
    def pending(self) -> int:
        """Groups being scored."""
        return len(self.tasks)

    def start(self, group: CompletedGroup) -> asyncio.Task[Verdict]:
        task = asyncio.create_task(self._verdict(group))
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    async def wait(self) -> None:
        """Until every task has ended (their failures are in ``failures``)."""
        while self.tasks:
            await asyncio.wait(set(self.tasks))

    async def score_group(self, prompt: Prompt, responses: Sequence[np.ndarray]) -> list[float]:
        """reward_fn's rewards of a group's responses: a reward_fn with an async ``score_group(prompt, responses)``
        method is called once for the group (a group-level reward, training.hooks, schedules its own calls); an
        ``async def`` one is awaited per response, all at once; a plain one runs in a worker thread, one call for
        the group."""
        reward_fn = self.reward_fn
        assert reward_fn is not None  # the drivers refuse a missing reward_fn where they would call it
        score_whole_group = getattr(reward_fn, "score_group", None)
        if score_whole_group is not None:
            return await score_whole_group(prompt, responses)
        if self._async:
            return list(await asyncio.gather(*(reward_fn(prompt, r) for r in responses)))  # type: ignore[misc]
        return await asyncio.to_thread(score_group, reward_fn, prompt, responses)  # type: ignore[arg-type]

    async def score_sample(self, prompt: Prompt, response: np.ndarray) -> Any:
        """reward_fn's reward of one response: awaited, or a plain function's in a worker thread."""
        reward_fn = self.reward_fn
        assert reward_fn is not None
        return await reward_fn(prompt, response) if self._async else \
            await asyncio.to_thread(reward_fn, prompt, response)  # type: ignore[misc]

    async def _reward_fn_of(self, group: CompletedGroup) -> list[float]:
        return await self.score_group(group.prompt, group.responses)

    async def _verdict(self, group: CompletedGroup) -> Verdict:
        values = [float(r) for r in await self._rewards_of(group)]
        accepted = True if self.group_filter is None else bool(self.group_filter(values))
        if self._report is not None:
            self._report(group, values, accepted)
        return values, accepted

    def _done(self, task: asyncio.Task[Verdict]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.failures.append(task.exception())  # type: ignore[arg-type]
        self._notify()


def raise_first(failures: list[BaseException]) -> None:
    """Raises the first failure collected; the others are dropped with it (the step ends on the first)."""
    if failures:
        failure = failures[0]
        failures.clear()
        raise failure


__all__ = ["GroupFilter", "RewardFn", "RewardPipeline", "Verdict", "raise_first"]
