"""ServerPool.watch keeps checking every engine whatever one check raises (no Ray: the checks are stand-ins)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from april_ext.cluster.server_pool import ServerPool, ServerSlot
from april_ext.errors import InvalidStateError
from april_ext.training import TrainConfig


async def _noop(*_: object) -> None:
    return None


@pytest.mark.parametrize("error", [InvalidStateError("rejoin refused"), OSError("connection reset"),
                                   RuntimeError("unexpected")])
def test_a_check_that_raises_is_logged_and_every_engine_is_checked_again(error: Exception, caplog) -> None:
    pool = ServerPool(TrainConfig(ray_engine_check_interval_s=0.01), [ServerSlot(0, None), ServerSlot(1, None)], None)
    checked: list[int] = []

    async def check(slot: ServerSlot, rejoin: object, members: object) -> None:
        checked.append(slot.index)
        if slot.index == 0 and checked.count(0) == 1:
            raise error
        slot.registered = True

    pool._check = check  # type: ignore[method-assign]

    async def main() -> None:
        watch = asyncio.create_task(pool.watch(_noop, None))  # type: ignore[arg-type]
        while checked.count(0) < 3:
            assert not watch.done(), watch
            await asyncio.sleep(0.01)
        watch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watch

    with caplog.at_level(logging.WARNING, logger="april_ext.cluster.server_pool"):
        asyncio.run(asyncio.wait_for(main(), 30))
    # The first round: engine 0 raised, engine 1 was still checked; later rounds check both, and engine 0 joined.
    assert checked[:2] == [0, 1] and all(s.registered for s in pool.slots)
    assert any(str(error) in record.getMessage() or (record.exc_info and record.exc_info[1] is error)
               for record in caplog.records)
