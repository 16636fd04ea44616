"""april-ext train on Ray (april_ext.cluster), on a local Ray cluster with the real sglang-router: trainer
ranks and engines as actors, the run on the driver. One cluster for the module (a cluster costs about 15 s);
each test starts its own run's actors and placement groups in it.

- 2 trainer ranks (DDP over gloo) and 2 embedded engines behind the router train the counting task with the
  same scheduler batches and rewards as the single-process run of the same seed (baseline mode); an engine
  actor killed with SIGKILL is restarted by Ray and rejoins the router with the current weights.
- Mid-step faults, with 2 engines behind the router: one engine's server SIGKILLed during a step's rollout
  (its streams end as partials that resume on the other engine; Ray restarts the engine, which rejoins with
  the current weights), then the other's SIGSTOPped during a later step (removed within
  sglang_worker_timeout_s, its requests resumed elsewhere; after SIGCONT it rejoins with the current
  weights). Every step completes with full batches of distinct groups, none trained twice, and every token
  the scheduler received held once. (A restarted engine's old url is forgotten by failover; a stalled
  actor's, answering again on the same url, is not.)
- A trainer rank killed with SIGKILL stops the run with a ClusterError naming it; --resume completes the run.
- Colocated: the trainer actor's and the engine server's memory alternate through pause / resume (RSS); the
  engine registers with a router the run is given, and leaves it at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.parse
import urllib.request

import psutil
import pytest
from _ray_utils import RAY, TINY, checked_and_armed, needs, ray_cluster, ray_run  # noqa: F401 (fixture)
from _ray_utils import alive as _alive
from _ray_utils import label as _label
from _ray_utils import wait as _wait
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext.cluster import ClusterError
from april_ext.cluster.router import Router
from april_ext.cluster import RayTopologyRun
from april_ext.training import TrainConfig, train

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread", "ray_cluster"), needs("ray", "sglang_router")]


def _batches(rows: list[dict]) -> list[tuple[list[int], float]]:
    """Per step: the batch's response lengths (as a multiset: groups finish in any order) and mean reward."""
    return [(sorted(r["rollout/response_lens"]), r["rollout/reward_mean"]) for r in rows]


def test_two_ranks_and_two_engines_train_as_one_process_and_a_killed_engine_rejoins(tmp_path) -> None:
    single = train(TrainConfig(**TINY, partial_rollout=False, num_steps=4, output_dir=str(tmp_path / "single")))
    config = TrainConfig(**TINY, **RAY, partial_rollout=False, num_steps=4, output_dir=str(tmp_path / "ray"),
                         actor_num_gpus_per_node=2, rollout_num_gpus=2)

    async def run() -> tuple[list[dict], dict]:
        async with ray_run(config) as run:
            trainer, engine = run.trainer, run.engine
            assert len(trainer.pids) == 2 and len(engine.pool.slots) == 2 and engine.pool.states() == {0: "up", 1: "up"}
            for _ in range(2):
                await run.step()
            slot = engine.pool.slots[0]
            old_url, old_server = slot.url, await asyncio.wrap_future(slot.actor.server_pid.remote().future())
            os.kill(slot.pid, signal.SIGKILL)
            await _wait(lambda: engine.rejoins == 1 and engine.pool.states()[0] == "up", 120,
                        "engine 0 restarted and rejoined")
            seen = {"old_url": old_url, "new_url": slot.url, "old_server_alive": _alive(old_server),
                    "listed": sorted(engine.pool.router.workers()), "label_on_rejoin": _label(slot.url)}
            while not run.done:
                await run.step()
            seen["labels"] = sorted({_label(s.url) for s in engine.pool.slots})
            await run.finish()
            return run.history, seen

    rows, seen = asyncio.run(run())
    # The same scheduler batches as one process: the ranks' DDP update equals one process's, and each sample's
    # tokens depend only on its seed and the weights, not on which engine drew them.
    assert _batches(rows) == _batches(single.history)
    assert [r["engine/server_weight_versions"] for r in rows] == [["1"], ["2"], ["3"], ["4"]]
    # The restarted engine is a new server (the old one ended by the new actor), given step 2's weights before it
    # was listed again, and the dead url is no longer listed.
    assert seen["new_url"] != seen["old_url"] and not seen["old_server_alive"]
    assert seen["label_on_rejoin"] == "2"
    assert seen["old_url"] not in seen["listed"] and seen["new_url"] in seen["listed"] and len(seen["listed"]) == 2
    assert seen["labels"] == ["4"]


def _listening(pid: int) -> set[str]:
    """The addresses the process ``pid`` and its children listen on (TCP)."""
    process = psutil.Process(pid)
    return {c.laddr.ip for p in (process, *process.children(recursive=True))
            for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def _status(url: str, token: str | None) -> int:
    request = urllib.request.Request(f"{url}/generate", json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}).encode(),
                                     {"Content-Type": "application/json", **({"Authorization": token} if token else {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_a_one_node_run_binds_loopback_and_its_servers_and_router_take_only_the_run_key(tmp_path) -> None:
    """On a cluster of one node the engine servers, the router and the trainer's rendezvous are on 127.0.0.1
    (formerly the node's address); every server and the router refuse a call without the run's key (401),
    which the run itself sends, and the key is in no log or metrics file."""
    config = TrainConfig(**TINY, **RAY, num_steps=2, output_dir=str(tmp_path / "run"), weight_sync="broadcast")

    async def run() -> dict:
        async with ray_run(config) as run:
            await run.step()
            pool, key = run.engine.pool, run.engine.pool.network.api_key
            servers = [await asyncio.wrap_future(s.actor.server_pid.remote().future()) for s in pool.slots]
            rendezvous = await asyncio.wrap_future(run.trainer.actors[0].rendezvous.remote().future())
            seen = {"key": key, "rendezvous": rendezvous[0], "loopback": pool.network.loopback,
                    "urls": [urllib.parse.urlsplit(u).hostname for u in [pool.router.url, *(s.url for s in pool.slots)]],
                    "listening": set().union(*(_listening(pid) for pid in [*servers, pool.router.process.pid])),
                    "statuses": {(url, token): _status(url, token) for url in [pool.router.url, pool.slots[0].url]
                                 for token in (None, "Bearer wrong", f"Bearer {key}")}}
            await run.step()
            await run.finish()
            return seen

    seen = asyncio.run(run())
    assert seen["loopback"] and seen["rendezvous"] == "127.0.0.1" and set(seen["urls"]) == {"127.0.0.1"}
    assert seen["listening"] == {"127.0.0.1"}, seen["listening"]
    statuses = {(token.split()[-1] if token else None): code for (_, token), code in seen["statuses"].items()}
    assert statuses == {None: 401, "wrong": 401, seen["key"]: 200}, seen["statuses"]
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file() and path.suffix in (".log", ".jsonl", ".json", ".toml"):
            assert seen["key"] not in path.read_text(errors="replace"), path


def test_a_killed_trainer_rank_stops_the_run_and_resume_completes_it(tmp_path) -> None:
    config = TrainConfig(**TINY, **{**RAY, "ray_timeout_s": 30.0}, num_steps=3, save_interval=1,
                         output_dir=str(tmp_path / "run"), actor_num_gpus_per_node=2, rollout_num_gpus=1)

    async def run_until_killed() -> float:
        async with ray_run(config) as run:
            await run.step()
            os.kill(run.trainer.pids[1], signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(ClusterError, match=r"trainer rank 1 .*died during train_step.*--resume"):
                await run.step()
            return time.monotonic() - start

    assert asyncio.run(run_until_killed()) < config.ray_timeout_s
    resumed_config = config.replace(resume=True)
    resumed = train(resumed_config, **RayTopologyRun(resumed_config).factories())
    assert resumed.resumed_from == 1
    assert [r["step"] for r in resumed.history] == [1, 2, 3]
    assert [r["engine/server_weight_versions"] for r in resumed.history[1:]] == [["2"], ["3"]]


def test_colocated_trainer_and_engine_memory_alternate_behind_a_given_router(tmp_path) -> None:
    # Big enough to see in RSS: the engine's KV cache is 1024 pages x 16 tokens x 4 layers x (K, V) x 2 KV heads
    # x 128 x 4 B = 128 MiB; the trainer's paused weights 4 layers x 13 x 512^2 x 4 B = 52 MiB.
    router = Router.launch([], str(tmp_path / "router.log"), timeout_s=60, request_timeout_s=60)
    config = TrainConfig(**{**TINY, "hidden_size": 512, "num_layers": 4, "num_blocks": 1024}, **RAY, colocate=True,
                         num_steps=2, output_dir=str(tmp_path / "run"), ray_router_url=router.url)
    mib = 1 << 20

    async def run() -> dict[str, list[int]]:
        async with ray_run(config) as run:
            memory, trainer, engine = run.memory, run.trainer, run.engine
            assert list(engine.pool.router.workers()) == [engine.pool.slots[0].url]
            rss: dict[str, list[int]] = {"trainer": [], "engine": []}

            async def measure() -> None:
                rss["trainer"].append(trainer.rss_bytes()[0])
                rss["engine"].append((await engine.pool.server_rss_bytes())[0])

            await run.step()  # the optimizer state exists after the first update
            await measure()  # after the weight sync: the trainer resident, the engine's KV cache released
            await memory.to_rollout()
            await measure()  # the trainer paused, the engine resumed
            await memory.to_training()
            await measure()  # the engine released, the trainer resumed
            while not run.done:
                await run.step()
            await run.finish()
            assert [r["engine/server_weight_versions"] for r in run.history] == [["1"], ["2"]]
            return rss

    try:
        rss = asyncio.run(run())
        # The run registered its engine with the router it was given, and took it off again at the end.
        assert router.process.poll() is None and router.workers() == {}
    finally:
        router.stop()
    print({k: [round(v / mib) for v in vs] for k, vs in rss.items()})
    (t0, t1, t2), (e0, e1, e2) = rss["trainer"], rss["engine"]
    assert e1 - e0 > 100 * mib and e1 - e2 > 100 * mib  # the KV cache comes back for the rollout, then goes
    assert t0 - t1 > 40 * mib and t2 - t1 > 40 * mib  # the trainer's weights: away for the rollout, then back


@pytest.mark.parametrize("weight_sync", ["disk", "broadcast"])
def test_an_engine_server_killed_or_stopped_mid_step_fails_over_and_rejoins_with_current_weights(
        tmp_path, weight_sync: str) -> None:
    timeout_s = 3.0
    config = TrainConfig(**{**TINY, "rollout_batch_size": 4}, **RAY, num_steps=4, output_dir=str(tmp_path / "run"),
                         actor_num_gpus_per_node=1, rollout_num_gpus=2, sglang_worker_timeout_s=timeout_s,
                         weight_sync=weight_sync, weight_sync_timeout_s=120.0)  # a loaded machine: joins were slow

    async def run() -> dict:
        async with ray_run(config) as run:
            engine, seen, trained = run.engine, {}, set()
            armed = checked_and_armed(run, trained)

            async def mid_step(fault) -> dict:
                """A step with ``fault()`` made mid-rollout; it must complete. Its bound allows for a server
                stopped just before the step's weight sync (while failover has yet to notice it): the sync
                then waits out its own bounds, weight_sync_timeout_s for a worker's answer and twice that for
                the trainer rank's (seen on a loaded clean clone: 120 s alone was not enough)."""
                armed.append(fault)
                row = await asyncio.wait_for(run.step(), 4 * config.weight_sync_timeout_s)
                assert not armed, "no token came in the step"
                return row

            await run.step()
            killed, stopped = engine.pool.slots
            server = await asyncio.wrap_future(killed.actor.server_pid.remote().future())
            seen["killed_url"] = killed.url
            await mid_step(lambda: os.kill(server, signal.SIGKILL))
            await _wait(lambda: engine.rejoins == 1 and engine.pool.states()[0] == "up", 120,
                        "the killed engine restarted and rejoined")
            seen["killed_rejoined"] = (killed.url, _label(killed.url), str(run.trainer.version))
            server = await asyncio.wrap_future(stopped.actor.server_pid.remote().future())
            times: dict[str, float] = {}

            def stop() -> None:
                os.kill(server, signal.SIGSTOP)
                times["stopped"] = time.monotonic()

            async def removal() -> None:
                await _wait(lambda: stopped.url in engine.pool_health()["removed"], 60, "the stopped engine removed",
                            poll_s=0.05)
                times["removed"] = time.monotonic()

            try:
                watch = asyncio.create_task(removal())
                row = await mid_step(stop)
                await asyncio.wait_for(watch, 60)
                seen["detected_s"] = times["removed"] - times["stopped"]
                seen["stopped_row"] = row
                assert stopped.url in engine.pool_health()["removed"]
                assert stopped.url not in engine.pool.router.workers()
            finally:
                os.kill(server, signal.SIGCONT)
            await _wait(lambda: stopped.url in engine.pool_health()["live"], 60, "the stopped engine rejoined")
            seen["stopped_rejoined"] = (_label(stopped.url), str(run.trainer.version))
            while not run.done:
                await run.step()
            seen["labels"] = sorted({_label(s.url) for s in engine.pool.slots})
            seen["listed"] = sorted(engine.pool.router.workers())
            await run.finish()
            seen["history"] = run.history
            return seen

    seen = asyncio.run(run())
    # Killed: Ray restarted the engine on a new server, given the current weights before it was listed again.
    new_url, label, version = seen["killed_rejoined"]
    assert new_url != seen["killed_url"] and label == version
    # Stopped: removed within the failover timeout (between 1 and 1.25 x it after its last answer), back after
    # SIGCONT with the current weights.
    # (Failover's probes and silence checks run every timeout / 4; a second of slack for a busy machine.)
    assert seen["detected_s"] < 1.25 * timeout_s + 1.0, seen["detected_s"]
    assert seen["stopped_row"]["engine/workers_removed"] == 1
    label, version = seen["stopped_rejoined"]
    assert label == version
    assert [r["engine/server_weight_versions"] for r in seen["history"]] == [["1"], ["2"], ["3"], ["4"]]
    assert seen["labels"] == ["4"] and len(seen["listed"]) == 2
    assert seen["history"][-1]["engine/workers_live"] == 2


def test_failover_forgets_a_restarted_engines_old_url_but_not_a_stalled_actors_own() -> None:
    from april_ext.cluster.ray_engine import RayEngine

    forgotten: list[str] = []

    class Inner:
        def forget_worker(self, url: str) -> None:
            forgotten.append(url)

    engine = RayEngine(Inner(), pool=None)  # type: ignore[arg-type]
    # No update yet: nothing to push; an actor that was stalled answers again on its own url.
    asyncio.run(engine._rejoin("http://h:1", "http://h:1"))
    asyncio.run(engine._rejoin("http://h:1", "http://h:2"))
    assert forgotten == ["http://h:1"]
