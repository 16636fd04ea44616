"""What the Ray test modules share: the tiny run's settings, one local cluster per module, waits, the
engines' labels and counters, and the check of a step's batch."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skips a module's tests when one of ``modules`` (ray, sglang_router) is not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed (pip install -e '.[test]' "
                                                    "installs them)")


TINY = dict(counting_median=3.0, counting_sigma=0.8, counting_max_count=12, counting_symbols=2, hidden_size=16,
            num_layers=1, rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=4,
            max_num_seqs=64, num_blocks=256, lr=0.003, progress=False, plots=False, num_threads=1)
# Short timeouts: a dead rank or engine must show within seconds. Actors take a quarter CPU each: the
# local cluster's logical CPUs, on a machine of 2 cores.
RAY = dict(ray=True, ray_num_cpus_per_actor=0.25, ray_timeout_s=120.0, ray_engine_check_interval_s=0.5)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local cluster for the module (a cluster costs about 15 s); each test starts its own run's actors and
    placement groups in it."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            return "State:\tZ" not in handle.read()
    except OSError:
        return False


async def wait(condition, timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(poll_s)


_RUN_KEY: list[str] = []  # the key of the run ray_run built last: its servers refuse calls without it


def _get(url: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=run_headers()), timeout=10) as response:
        return json.loads(response.read())


def run_headers() -> dict[str, str]:
    """The Authorization header of the run ray_run built last (none before one)."""
    return {"Authorization": f"Bearer {_RUN_KEY[-1]}"} if _RUN_KEY else {}


def label(url: str) -> str:
    """The weight version an engine's server reports."""
    return str(_get(f"{url}/model_info")["weight_version"])


def generated_tokens(url: str) -> int:
    """The tokens an engine's (embedded) server generated since it started, by its own counters."""
    return int(_get(f"{url}/server_info")["internal_states"][0]["generated_tokens"])


def check_batch(scheduler, batch, trained_groups: set[int]) -> None:
    """A full batch of distinct complete groups, none trained before, and every token the scheduler received
    held once: in the batch, in a partial buffered for a resume, or in a surplus group."""
    config = scheduler.config
    assert batch.n_groups == config.rollout_batch_size and len(set(batch.prompt_ids)) == batch.n_groups
    assert np.bincount(batch.group_index).tolist() == [config.n_samples_per_prompt] * batch.n_groups
    assert len(set(batch.sample_ids.tolist())) == batch.n_samples
    assert not trained_groups & set(batch.prompt_ids), "a group trained twice"
    trained_groups.update(batch.prompt_ids)
    in_batch = set(batch.sample_ids.tolist())
    held = int(batch.response_lens.sum())
    for sid in scheduler.sample_ids("queued") + scheduler.sample_ids("done"):
        if sid not in in_batch:
            held += int(scheduler.sample(sid).token_ids.size)
    stats = scheduler.stats()
    assert stats["generated_tokens"] == held, (stats, held)


def checked_and_armed(run, trained_groups: set[int]) -> list:
    """Checks each step's batch of ``run`` (check_batch) and returns ``armed``: a fault (a callable) put in it
    is made with the next streamed token, so the step's requests are running on the servers."""
    step_rollout = run.rollout.run_step

    async def checked_rollout(version: int):
        result = await step_rollout(version)
        check_batch(run.scheduler, result.batch, trained_groups)
        return result

    run.rollout.run_step = checked_rollout
    armed: list = []
    generate = run.engine.generate

    async def generate_then_fault(*args):
        async for chunk in generate(*args):
            if armed:
                armed.pop()()
            yield chunk

    run.engine.generate = generate_then_fault
    return armed


def keyed_session(config):
    """A RaySession of ``config``'s topology whose key the helpers here send (a test that builds the pool itself)."""
    from april_ext.cluster import Topology
    from april_ext.cluster.network import new_api_key
    from april_ext.cluster.session import RaySession

    _RUN_KEY.append(new_api_key())
    return RaySession(config, Topology.from_config(config), _RUN_KEY[-1])


def ray_run(config):
    """The TrainingRun of a Ray config, with the cluster layer's factories (as `april-ext train --ray`)."""
    from april_ext.cluster import RayTopologyRun
    from april_ext.training import TrainingRun

    topology = RayTopologyRun(config)
    _RUN_KEY.append(topology.api_key)
    return TrainingRun(config, **topology.factories())
