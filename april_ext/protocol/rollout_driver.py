"""RolloutDriver: what the training run needs of a rollout, whichever drives the scheduler (the RolloutLoop over
a RolloutEngine, or slime's custom generate function through CustomGenerateRollout).

- ``run_step(policy_version)``: one step, until N groups are accepted (or the data ran out): its batch and metrics.
- Between steps: ``carried`` samples may stay in the engine (step_boundary "carry"); ``running_engine()`` is an
  async context manager inside which the engine generates for other work (evaluation) although samples are
  carried; ``abort_carried()`` ends them (the end of a run).
- Rewards of groups that completed after their step's batch was taken may still be computed:
  ``pending_rewards`` counts them and ``drain_rewards()`` waits until they reached the scheduler (before a
  checkpoint), raising the first failure.
- What goes into a checkpoint beside the scheduler's state: ``environment_state()`` (bytes, or None when there is
  nothing to save) and ``load_environment_state(bytes)`` on resume.
- ``close()``: ends the work the rollout still has running (the end of a run).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Protocol, runtime_checkable

from april_ext.protocol.rollout_result import RolloutResult


@runtime_checkable
class RolloutDriver(Protocol):
    async def run_step(self, policy_version: int) -> RolloutResult: ...

    @property
    def carried(self) -> int: ...

    async def abort_carried(self) -> None: ...

    def running_engine(self) -> AbstractAsyncContextManager[None]: ...

    @property
    def pending_rewards(self) -> int: ...

    async def drain_rewards(self) -> None: ...

    def environment_state(self) -> bytes | None: ...

    def load_environment_state(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


__all__ = ["RolloutDriver"]
