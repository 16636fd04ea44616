"""The real SGLang router (`sglang-router` from PyPI, a Rust binary that runs on CPU) in front of two embedded
servers: the adapter generates through it and reaches every worker it lists for aborts, weight updates and
health, and an APRIL training run goes through it."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from _engine_utils import greedy_reference, tiny_model
from _sglang_utils import counting_checkpoint, live_server
from _torch_threads import one_torch_thread

from april_ext.batch import FinishReason
from april_ext.model import load_pretrained, save_pretrained
from april_ext.protocol import SamplingParams
from april_ext.sglang import SGLangEngine, SGLangEngineConfig, free_port
from april_ext.training import TrainConfig, train

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                       reason="sglang-router is not installed (pip install -e '.[test]' installs it)"),
]

PROMPT = [5, 17, 33, 2, 60]


def _get(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


@contextlib.contextmanager
def sglang_router(worker_urls: list[str], tmp_path, timeout_s: float = 90.0) -> Iterator[str]:
    """`python -m sglang_router.launch_router` on a free loopback port, in its own process group; returns
    once its /workers lists every worker as healthy. Stopped with SIGTERM (then SIGKILL) on exit."""
    port = free_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *worker_urls, "--policy", "round_robin", "--log-level", "warn",
               # its metrics port (29000 by default) free too: a second router on the machine must not collide
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    with open(tmp_path / "router.log", "wb") as log, \
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                             start_new_session=True) as proc:
        yield from _serve(proc, f"http://127.0.0.1:{port}", worker_urls, tmp_path, timeout_s)


def _serve(proc: subprocess.Popen, url: str, worker_urls: list[str], tmp_path, timeout_s: float) -> Iterator[str]:
    """Waits until the router lists every worker as healthy, yields its url, then stops it."""
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            status, answer = _get(f"{url}/workers")
            listed = {w["url"]: w.get("is_healthy") for w in answer.get("workers", [])} \
                if status == 200 and isinstance(answer, dict) else {}
            if all(listed.get(u) for u in worker_urls):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the router did not list {worker_urls} as healthy in time (exit code "
                                     f"{proc.poll()}): {(tmp_path / 'router.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def test_the_adapter_through_the_router_reaches_every_worker(tmp_path) -> None:
    first, second = tiny_model(seed=1), tiny_model(seed=2)
    save_pretrained(second, tmp_path / "ckpt")
    long = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)

    async def body(router: str, workers: list[str]):
        async with SGLangEngine(SGLangEngineConfig(router_url=router, abort_timeout_s=30.0)) as engine:
            health = engine.health()
            listed = await engine.worker_urls()
            short = SamplingParams(max_new_tokens=6, temperature=0.0)
            greedy = [await _greedy(engine, short) for _ in range(2)]

            started: dict[int, int] = {}

            async def consume(i: int) -> None:
                async for c in engine.generate(PROMPT, long, request_id=f"s-{i}"):
                    started[i] = started.get(i, 0) + len(c.token_ids)

            streams = [asyncio.create_task(consume(i)) for i in range(6)]
            while len([n for n in started.values() if n > 0]) < 6:  # every request is decoding
                await asyncio.sleep(0.01)
            busy = {url: await _in_flight(engine, url) for url in workers}
            aborted = await engine.abort()
            await asyncio.gather(*streams)
            idle = {url: await _in_flight(engine, url) for url in workers}
            names = await engine.update_weights(str(tmp_path / "ckpt"), version=5)
            versions = await engine.weight_versions()
            after = [await _greedy(engine, short, versions=True) for _ in range(2)]
            checked = await engine.check_health()
            return health, listed, greedy, busy, aborted, idle, names, versions, after, checked

    with one_torch_thread(), live_server(tiny_model(seed=1)) as a, live_server(tiny_model(seed=1)) as b:
        workers = [a.url, b.url]
        with sglang_router(workers, tmp_path) as router:
            health, listed, greedy, busy, aborted, idle, names, versions, after, checked = \
                asyncio.run(body(router, workers))
    assert health["status"] == "ok" and set(health["workers"]) == set(workers)
    assert sorted(listed) == sorted(workers)
    assert greedy == [greedy_reference(first, PROMPT, 6)] * 2
    # Round robin: both workers run requests; abort() ends every one of them on every worker.
    assert all(n > 0 for n in busy.values()), busy
    assert len(aborted) == 6 and all(o.finish_reason is FinishReason.ABORT for o in aborted)
    assert all(0 < len(o.token_ids) < 200 for o in aborted)
    assert idle == {url: 0 for url in workers}
    # The weights reached every worker: each reports the label, and generation through the router (on
    # either worker) is the new model's, tagged with the new version.
    assert names and versions == {url: "5" for url in workers}
    want = greedy_reference(second, PROMPT, 6)
    assert [[t for t, _ in a] for a in after] == [want, want] and {v for a in after for _, v in a} == {5}
    assert checked["status"] == "ok"


async def _greedy(engine: SGLangEngine, params: SamplingParams, versions: bool = False) -> list:
    out = []
    async for chunk in engine.generate(PROMPT, params):
        out += [(t, chunk.weight_version) if versions else t for t in chunk.token_ids]
    return out


async def _in_flight(engine: SGLangEngine, url: str) -> int:
    info = (await engine.server_info())[url]
    return int(info["internal_states"][0]["requests_in_flight"])


def test_an_april_training_run_through_the_router(tmp_path) -> None:
    ckpt = counting_checkpoint(tmp_path / "ckpt")
    settings = {"counting_median": 3.0, "counting_sigma": 0.8, "counting_max_count": 12, "counting_symbols": 2,
                "hidden_size": 16, "num_layers": 1, "rollout_batch_size": 2, "n_samples_per_prompt": 4,
                "over_sampling_batch_size": 4, "max_num_seqs": 64, "num_blocks": 256, "lr": 0.003,
                "progress": False, "plots": False}
    with one_torch_thread(), \
            live_server(load_pretrained(ckpt), weight_version="17", block_size=16, max_num_seqs=64) as a, \
            live_server(load_pretrained(ckpt), weight_version="17", block_size=16, max_num_seqs=64) as b:
        workers = [a.url, b.url]
        with sglang_router(workers, tmp_path) as router:
            result = train(TrainConfig(**settings, num_steps=3, output_dir=str(tmp_path / "run"), engine="sglang",
                                       sglang_router_url=router, model=ckpt))
            labels = {url: _get(f"{url}/model_info")[1]["weight_version"] for url in workers}
            generated = {url: _get(f"{url}/server_info")[1]["internal_states"][0]["generated_tokens"]
                         for url in workers}
    rows = result.history
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Every step's weights reached both workers (the run reads the label of each worker after its sync).
    assert [r["engine/server_weight_versions"] for r in rows] == [["1"], ["2"], ["3"]]
    assert labels == {url: "3" for url in workers}
    # The router spread the samples over both workers, and APRIL's aborts reached them: the partial samples
    # aborted at the end of a step were resumed in the next.
    assert all(n > 0 for n in generated.values()), generated
    assert any(r["rollout/carried_token_ratio"] > 0 for r in rows[1:])


def test_a_keyed_router_in_front_of_keyed_servers_refuses_calls_without_the_key(tmp_path) -> None:
    """The run's key on the servers and on the launched router (cluster.router.Router.launch): the adapter
    with the key generates through it and reaches every worker; without it, or with a wrong one, the router
    and the servers answer 401."""
    from april_ext.cluster.router import Router

    key = "router-key-42"
    short = SamplingParams(max_new_tokens=4, temperature=0.0)

    async def body(router: str, workers: list[str]):
        async with SGLangEngine(SGLangEngineConfig(router_url=router, api_key=key)) as engine:
            tokens = [t async for c in engine.generate(PROMPT, short) for t in c.token_ids]
            listed = sorted(await engine.worker_urls())
            checked = await engine.check_health()
        return tokens, listed, checked

    with one_torch_thread(), live_server(tiny_model(seed=1), api_key=key) as a, \
            live_server(tiny_model(seed=1), api_key=key) as b:
        workers = sorted([a.url, b.url])
        router = Router.launch(workers, str(tmp_path / "router.log"), timeout_s=60, request_timeout_s=60,
                               api_key=key)
        try:
            tokens, listed, checked = asyncio.run(body(router.url, workers))
            statuses = {}
            for url in (router.url, *workers):
                for token in (None, "Bearer wrong"):
                    request = urllib.request.Request(f"{url}/generate", data=json.dumps({"input_ids": PROMPT}).encode(),
                                                     headers={"Content-Type": "application/json",
                                                              **({"Authorization": token} if token else {})})
                    try:
                        urllib.request.urlopen(request, timeout=10)
                        statuses[(url, token)] = 200
                    except urllib.error.HTTPError as err:
                        statuses[(url, token)] = err.code
        finally:
            router.stop()
    assert tokens == greedy_reference(tiny_model(seed=1), PROMPT, 4)
    assert listed == workers and checked["status"] == "ok"
    assert set(statuses.values()) == {401}, statuses
    assert key not in (tmp_path / "router.log").read_text()


def test_failover_keeps_a_worker_its_owner_took_off_the_router_and_put_back(tmp_path) -> None:
    """A Ray engine pool takes a stalled engine off the router itself and adds it back when its actor answers
    (cluster.router.Router, as the pool does). The adapter's failover did not watch it meanwhile; formerly its
    silence counted from before it left, so the first check after its return removed it again ("no answer ...
    for 11.3 s") and it went through another remove, push and rejoin."""
    from april_ext.cluster.router import Router

    timeout_s = 1.0

    async def body(router: Router, workers: list[str]):
        config = SGLangEngineConfig(router_url=router.url, worker_timeout_s=timeout_s)
        async with SGLangEngine(config) as engine:
            await asyncio.sleep(2 * timeout_s)  # watched while listed
            await asyncio.to_thread(router.remove, workers[1], 30)
            await asyncio.sleep(3 * timeout_s)  # off the list for longer than the timeout
            await asyncio.to_thread(router.add, workers[1])
            await asyncio.to_thread(router.wait_until, lambda w: workers[1] in w, 30, f"list {workers[1]}")
            await asyncio.sleep(3 * timeout_s)  # several checks after its return
            return engine.pool_health(), sorted(await engine.worker_urls())

    with one_torch_thread(), live_server(tiny_model(seed=1)) as a, live_server(tiny_model(seed=1)) as b:
        workers = [a.url, b.url]
        router = Router.launch(workers, str(tmp_path / "router.log"), timeout_s=60, request_timeout_s=60)
        try:
            health, listed = asyncio.run(body(router, workers))
        finally:
            router.stop()
    assert health["removals"] == 0 and health["rejoins"] == 0, health
    assert listed == sorted(workers)
