"""Asynchronous APRIL on Ray (docs/async.md, "At scale"): the trainer ranks train batch k while the engine servers
generate the next, on a local Ray cluster with the real sglang-router and embedded engines.

- Megatron ranks (PP = 2, each stage broadcasting its own part) train end to end, every batch generated one
  version ahead; an engine's server SIGKILLed while the second stage broadcasts update 2: the update goes again
  to the engine left, the version advances once it holds it, the engine rejoins with the current weights, and
  every batch is full, of distinct groups, with every token the scheduler received held once.
- An engine's server SIGSTOPped as an update starts (it stalls the update: the update is sent again once
  failover removes it), and one SIGKILLed while a batch trains (the rollout of the next batch runs at that
  moment: its requests resume on the other engine): the run loses nothing and the engine rejoins.
- A trainer rank SIGKILLed while it trains stops the run with a ClusterError naming it; --resume completes the
  run, asynchronously too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import psutil
import pytest
from _ray_utils import RAY, TINY, checked_and_armed, needs, ray_cluster, ray_run  # noqa: F401 (fixture)
from _ray_utils import label as _label
from _ray_utils import wait as _wait
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext.cluster import ClusterError, RayTopologyRun
from april_ext.cluster.rank_export import RankHost
from april_ext.training import TrainConfig, train

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread", "ray_cluster"), needs("ray", "sglang_router")]

ASYNC = dict(async_rollout=True, max_head_offpolicyness=1)
WORK = {**TINY, "hidden_size": 32, "rollout_batch_size": 4}


def _lags(row: dict) -> set[int]:
    return {int(lag) for lag in row["async/version_lag_histogram"]}


def _check_async_rows(rows: list[dict], steps: int) -> None:
    """Every step trained, its async metrics logged; after the first, every batch came from the version before the
    trainer's (d = 1: generated while the step before it trained), and the servers held each step's version."""
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["engine/server_weight_versions"] for r in rows] == [[str(s)] for s in range(1, steps + 1)]
    assert _lags(rows[0]) == {0}
    for row in rows[1:]:
        assert min(_lags(row)) >= 1, row["async/version_lag_histogram"]
    for row in rows:
        for key in ("async/trainer_idle_s", "async/engine_idle_s", "async/weight_update_s"):
            assert row[key] >= 0.0, (key, row[key])


async def _to_the_end(run, seen: dict, trained: set[int]) -> dict:
    """The run's remaining steps, then what every test checks: the servers' labels, the history, the groups."""
    while not run.done:
        await run.step()
    seen["labels"] = sorted({_label(s.url) for s in run.engine.pool.slots})
    await run.finish()
    seen["history"], seen["groups"] = run.history, len(trained)
    return seen


def test_async_megatron_ranks_train_end_to_end_and_a_server_killed_mid_update_loses_nothing(
        tmp_path, monkeypatch, caplog) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'april_ext[megatron]')")
    config = TrainConfig(**{**WORK, "num_layers": 2}, **RAY, **ASYNC, trainer="megatron",
                         pipeline_model_parallel_size=2, actor_num_gpus_per_node=2, rollout_num_gpus=2,
                         weight_sync="broadcast", num_steps=4, output_dir=str(tmp_path / "run"),
                         weight_sync_timeout_s=20.0)
    armed: list = []
    send = RankHost.send

    async def send_then_fault(self, name: str) -> None:
        if armed and self.rank == 1:  # the second stage's sender: the first stage's part has gone
            armed.pop()()
        await send(self, name)

    monkeypatch.setattr(RankHost, "send", send_then_fault)

    async def run() -> dict:
        async with ray_run(config) as run:
            engine, seen, trained = run.engine, {}, set()
            checked_and_armed(run, trained)
            await run.step()
            killed = engine.pool.slots[0]
            server = await asyncio.wrap_future(killed.actor.server_pid.remote().future())
            seen["killed_url"] = killed.url
            armed.append(lambda: os.kill(server, signal.SIGKILL))
            await asyncio.wait_for(run.step(), 240)  # its update is update 2
            assert not armed, "update 2 sent nothing from the second stage"
            await _wait(lambda: engine.rejoins == 1 and engine.pool.states()[0] == "up", 120,
                        "the killed engine restarted and rejoined")
            seen["rejoined"] = (killed.url, _label(killed.url), str(run.trainer.version))
            return await _to_the_end(run, seen, trained)

    caplog.set_level(logging.WARNING, logger="april_ext.cluster.ray_engine")
    seen = asyncio.run(asyncio.wait_for(run(), 600))  # a hang fails the test instead of stalling the suite
    assert "weight update 2 failed" in caplog.text and "sending it again to the engines left" in caplog.text
    _check_async_rows(seen["history"], 4)
    # The batches the pipeline generated: the 4 trained, and none beyond the run's last step.
    assert seen["groups"] == 4 * config.rollout_batch_size
    new_url, label, version = seen["rejoined"]
    assert new_url != seen["killed_url"] and label == version
    assert seen["labels"] == ["4"]


@pytest.mark.parametrize("fault", ["stopped_as_an_update_starts", "killed_while_a_batch_trains"])
def test_an_async_run_loses_nothing_when_a_server_stalls_in_an_update_or_dies_while_a_batch_trains(
        tmp_path, caplog, fault: str) -> None:
    """The killed server's engine is restarted by Ray while a batch trains: with the ranks broadcasting, they
    cannot send the last update again (they train past it), so the engine rejoins with the update of that step."""
    killed = fault == "killed_while_a_batch_trains"
    config = TrainConfig(**WORK, **RAY, **ASYNC, actor_num_gpus_per_node=1, rollout_num_gpus=2, num_steps=4,
                         output_dir=str(tmp_path / "run"), sglang_worker_timeout_s=3.0,
                         weight_sync="broadcast" if killed else "disk",
                         weight_sync_timeout_s=30.0)  # bounds the update the stalled server holds up

    async def run() -> dict:
        async with ray_run(config) as run:
            engine, seen, trained = run.engine, {}, set()
            checked_and_armed(run, trained)
            await run.step()
            victim = engine.pool.slots[1]
            server = await asyncio.wrap_future(victim.actor.server_pid.remote().future())
            seen["victim_url"] = victim.url
            done: dict[str, float] = {}

            def back() -> bool:
                return engine.pool.states()[1] == "up" and victim.url in engine.pool_health()["live"]

            if killed:
                train_step, ranks_all, old_url = run.trainer.train_step, run.trainer.ranks.all, victim.url

                def kill_then_train(batch):
                    if not done:
                        os.kill(server, signal.SIGKILL)
                        done["at"] = time.monotonic()
                    return train_step(batch)

                def training_through_the_restart(name: str, calls):
                    """The step of the kill trains (inside the trainer group's train step) until the pool's watch
                    has seen the restarted engine and tried its rejoin: the ranks are past the last update."""
                    if name == "train_step" and done and "held" not in done:
                        done["held"] = time.monotonic()
                        while victim.url == old_url and time.monotonic() - done["held"] < 120:
                            time.sleep(0.05)
                        time.sleep(1.0)  # the rejoin's attempt, which finds the step training
                    return ranks_all(name, calls)

                run.trainer.train_step = kill_then_train
                run.trainer.ranks.all = training_through_the_restart
                await asyncio.wait_for(run.step(), 240)
                assert victim.url != old_url, "the killed engine was not restarted within 120 s"
                await _wait(lambda: engine.rejoins == 1 and back(), 60, "the restarted engine rejoined")
            else:
                update = engine.update_from_trainer

                async def stop_then_update(version: int):
                    if not done:
                        os.kill(server, signal.SIGSTOP)
                        done["at"] = time.monotonic()
                    return await update(version)

                engine.update_from_trainer = stop_then_update
                try:
                    await asyncio.wait_for(run.step(), 4 * config.weight_sync_timeout_s)
                    await _wait(lambda: victim.url in engine.pool_health()["removed"], 60, "the victim taken out")
                finally:
                    os.kill(server, signal.SIGCONT)
                await _wait(back, 120, "the victim back")
            assert done, "the fault was not made"
            seen["back"] = (victim.url, _label(victim.url), str(run.trainer.version))
            return await _to_the_end(run, seen, trained)

    caplog.set_level(logging.WARNING, logger="april_ext.cluster.ray_engine")
    seen = asyncio.run(asyncio.wait_for(run(), 600))
    if killed:
        assert "rejoins with the next weight update" in caplog.text
        assert seen["back"][1] == "2"  # the update of the step it was killed in
    _check_async_rows(seen["history"], 4)
    assert seen["groups"] == 4 * config.rollout_batch_size
    url, label, version = seen["back"]
    assert label == version
    # A stalled server comes back on its own url; a killed one is restarted by Ray on a new one.
    assert (url == seen["victim_url"]) == (not killed)
    assert seen["labels"] == ["4"]
    assert seen["history"][-1]["engine/workers_live"] == 2


def test_a_trainer_rank_killed_in_an_async_run_stops_it_and_resume_completes_it(tmp_path) -> None:
    config = TrainConfig(**WORK, **{**RAY, "ray_timeout_s": 30.0}, **ASYNC, num_steps=3, save_interval=1,
                         output_dir=str(tmp_path / "run"), actor_num_gpus_per_node=2, rollout_num_gpus=1)

    async def run_until_killed() -> float:
        async with ray_run(config) as run:
            await run.step()
            # Each rank trains in its own process (a child of its own would leave the data-parallel group).
            assert all(not psutil.Process(pid).children() for pid in run.trainer.pids)
            os.kill(run.trainer.pids[1], signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(ClusterError, match=r"trainer rank 1 .*died during train_step.*--resume"):
                await run.step()
            return time.monotonic() - start

    assert asyncio.run(asyncio.wait_for(run_until_killed(), 300)) < config.ray_timeout_s
    resumed_config = config.replace(resume=True)
    resumed = train(resumed_config, **RayTopologyRun(resumed_config).factories())
    assert resumed.resumed_from == 1
    assert [r["step"] for r in resumed.history] == [1, 2, 3]
    assert [r["engine/server_weight_versions"] for r in resumed.history[1:]] == [["2"], ["3"]]
    assert all("async/version_lag_mean" in r for r in resumed.history[1:])
