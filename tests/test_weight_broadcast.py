"""Weight sync by collective broadcast (SGLang's /init_weights_update_group + /update_weights_from_distributed):
this process is rank 0 and broadcasts to embedded servers running as subprocesses on loopback (two ends of
one group cannot share a process: torch names groups process-wide)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch
from _engine_utils import greedy_reference, tiny_model
from _sglang_utils import live_server
from _torch_threads import one_torch_thread

from april_ext.errors import ConfigError, InvalidArgumentError
from april_ext.model import save_pretrained
from april_ext.protocol import SamplingParams, sglang_wire
from april_ext.sglang import SGLangEngine, SGLangEngineConfig, SGLangServerArgs, launch_sglang_server
from april_ext.weights import WeightBroadcastError, buckets
from april_ext.weights.group import dtype_name, parse_dtype
from april_ext.weights.sender import master_address_for

PROMPT = [5, 17, 33, 2]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
TIMEOUT_S = 8.0


@contextlib.contextmanager
def workers(tmp_path, count: int, timeout_s: float = TIMEOUT_S) -> Iterator[list]:
    """`count` `april-ext serve` processes on the tiny model (seed 0), their weight-group timeout timeout_s."""
    save_pretrained(tiny_model(), tmp_path / "ckpt")
    args = SGLangServerArgs(model_path=str(tmp_path / "ckpt"), extra_args=(
        "--num-blocks", "64", "--block-size", "4", "--weight-group-timeout", str(timeout_s)))
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(launch_sglang_server(
            args, module="april_ext.server", env={"OMP_NUM_THREADS": "1"}, timeout_s=120,
            log_path=str(tmp_path / f"server_{i}.log"))) for i in range(count)]
        yield servers


def broadcast_config(urls, **overrides) -> SGLangEngineConfig:
    return SGLangEngineConfig(worker_urls=tuple(urls), weight_sync="broadcast", weight_sync_timeout_s=TIMEOUT_S,
                              retries=0, **overrides)


async def greedy(engine: SGLangEngine) -> list[int]:
    out = []
    async for chunk in engine.generate(PROMPT, GREEDY):
        out.extend(chunk.token_ids)
    return out


@pytest.mark.slow
def test_every_worker_takes_each_step_s_weights_and_generates_as_a_reference(tmp_path) -> None:
    """Two workers, three updates (the first builds the group, the others reuse it), small buckets so that
    an update spans several calls: after each, every worker reports the version and answers greedy prompts
    as a model loaded with the trainer's weights."""
    steps = [tiny_model(seed=s) for s in (11, 12, 13)]

    async def session(urls) -> list[tuple[dict[str, str], list[list[int]]]]:
        seen = []
        async with SGLangEngine(broadcast_config(urls, weight_bucket_mb=0.004)) as engine:
            for version, model in enumerate(steps, start=1):
                names = await engine.update_weights(list(model.state_dict().items()), version)
                assert names == sorted(model.state_dict())
                outputs = []
                for url in urls:  # each worker, by itself
                    async with SGLangEngine(SGLangEngineConfig(worker_urls=(url,))) as one:
                        outputs.append(await greedy(one))
                seen.append((await engine.weight_versions(), outputs))
        return seen

    with one_torch_thread(), workers(tmp_path, 2) as servers:
        urls = [s.url for s in servers]
        seen = asyncio.run(session(urls))
    for version, (model, (labels, outputs)) in enumerate(zip(steps, seen), start=1):
        assert labels == {u: str(version) for u in urls}
        reference = greedy_reference(model, PROMPT, GREEDY.max_new_tokens)
        assert outputs == [reference, reference]
    # The weights changed the answers: a stale worker would not pass.
    assert len({tuple(o[0]) for _, o in seen}) > 1


@pytest.mark.slow
def test_a_killed_worker_fails_the_broadcast_with_a_clear_error_within_the_timeout_and_the_next_update_rebuilds(
        tmp_path) -> None:
    model = tiny_model(seed=21)

    async def session(servers) -> tuple[float, WeightBroadcastError, dict[str, str]]:
        urls = [s.url for s in servers]
        async with SGLangEngine(broadcast_config(urls)) as engine:
            await engine.update_weights(list(model.state_dict().items()), 1)
            os.killpg(servers[1].process.pid, signal.SIGKILL)
            servers[1].process.wait()
            started = time.monotonic()
            with pytest.raises(WeightBroadcastError) as err:
                await engine.update_weights(list(model.state_dict().items()), 2)
            elapsed = time.monotonic() - started
        # The survivor alone (a new worker list): a new group, and the update goes through.
        async with SGLangEngine(broadcast_config(urls[:1])) as engine:
            await engine.update_weights(list(model.state_dict().items()), 3)
            return elapsed, err.value, await engine.weight_versions()

    with one_torch_thread(), workers(tmp_path, 2) as servers:
        elapsed, error, labels = asyncio.run(session(servers))
    assert elapsed < 2 * TIMEOUT_S + 5, elapsed
    assert servers[1].url in str(error) or "the trainer's side" in str(error), str(error)
    assert labels == {servers[0].url: "3"}


@pytest.mark.slow
def test_a_worker_killed_before_the_group_is_rebuilt_fails_the_join_with_a_clear_error(tmp_path) -> None:
    """A worker said to have restarted (reset_weight_group) is dead when the group is built again."""
    model = tiny_model(seed=3)

    async def session(servers) -> float:
        async with SGLangEngine(broadcast_config([s.url for s in servers])) as engine:
            await engine.update_weights(list(model.state_dict().items()), 1)
            os.killpg(servers[1].process.pid, signal.SIGKILL)
            servers[1].process.wait()
            engine.reset_weight_group()
            started = time.monotonic()
            with pytest.raises(WeightBroadcastError,
                               match=f"joining weight group .*worker {servers[1].url} failed.*could not be reached"):
                await engine.update_weights(list(model.state_dict().items()), 2)
            return time.monotonic() - started

    with one_torch_thread(), workers(tmp_path, 2) as servers:
        assert asyncio.run(session(servers)) < TIMEOUT_S + 5


@pytest.mark.slow
def test_a_stopped_worker_is_detected_within_the_timeout(tmp_path) -> None:
    """SIGSTOP mid-update: nothing answers, nothing closes a connection; the group's timeout ends the wait."""
    model = tiny_model(seed=4)

    async def session(servers) -> float:
        async with SGLangEngine(broadcast_config([s.url for s in servers], weight_bucket_mb=0.004)) as engine:
            await engine.update_weights(list(model.state_dict().items()), 1)
            os.killpg(servers[1].process.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(WeightBroadcastError):
                    await engine.update_weights(list(model.state_dict().items()), 2)
                return time.monotonic() - started
            finally:
                os.killpg(servers[1].process.pid, signal.SIGCONT)

    with one_torch_thread(), workers(tmp_path, 2) as servers:
        assert asyncio.run(session(servers)) < 2 * TIMEOUT_S + 5


def test_workers_of_an_older_release_are_refused_naming_them() -> None:
    async def session(url: str) -> None:
        async with SGLangEngine(broadcast_config([url])) as engine:
            await engine.update_weights(list(tiny_model(seed=2).state_dict().items()), 1)

    with one_torch_thread(), live_server(tiny_model(), sglang_compat="0.5.3") as server:
        with pytest.raises(InvalidArgumentError, match=f"{server.url} \\(SGLang 0.5.3\\) predate it"):
            asyncio.run(session(server.url))


# Units ---------------------------------------------------------------------------------------------

def test_buckets_keep_the_order_and_the_size_limit() -> None:
    tensors = [("a", torch.zeros(10)), ("b", torch.zeros(20)), ("c", torch.zeros(100)), ("d", torch.zeros(5))]
    grouped = list(buckets(tensors, bucket_bytes=120))
    assert [[n for n, _ in b] for b in grouped] == [["a", "b"], ["c"], ["d"]]
    assert [n for b in grouped for n, _ in b] == ["a", "b", "c", "d"]


def test_dtype_names_are_sglangs() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert parse_dtype(dtype_name(dtype)) is dtype
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(InvalidArgumentError, match="not a torch dtype"):
        parse_dtype("Tensor")


def test_the_master_address_is_the_one_the_workers_reach() -> None:
    assert master_address_for(["http://127.0.0.1:30000"]) == "127.0.0.1"


def test_weight_sync_settings_are_validated() -> None:
    assert SGLangEngineConfig(worker_urls=("http://a:1",)).weight_sync == "tensor"
    assert SGLangEngineConfig(worker_urls=("http://a:1",), weight_sync_dir="/x").weight_sync == "disk"
    with pytest.raises(ConfigError, match="weight_sync must be one of"):
        SGLangEngineConfig(worker_urls=("http://a:1",), weight_sync="nccl")
    with pytest.raises(ConfigError, match="needs weight_sync_dir"):
        SGLangEngineConfig(worker_urls=("http://a:1",), weight_sync="disk")
    with pytest.raises(ConfigError, match="weight_sync_timeout_s"):
        SGLangEngineConfig(worker_urls=("http://a:1",), weight_sync_timeout_s=0)


@pytest.mark.parametrize("body, field", [
    ({"master_address": "h", "master_port": 1, "rank_offset": 0, "world_size": 2}, "rank_offset"),
    ({"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 1}, "world_size"),
    ({"master_address": "h", "master_port": 0, "rank_offset": 1, "world_size": 2}, "master_port"),
    ({"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "mpi"}, "backend"),
    ({"master_address": "", "master_port": 1, "rank_offset": 1, "world_size": 2}, "master_address"),
])
def test_init_weights_update_group_bodies_are_checked(body, field) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        sglang_wire.parse_init_weights_group(body)


@pytest.mark.parametrize("body, field", [
    ({"names": ["a"], "dtypes": ["float32", "float32"], "shapes": [[1]]}, "dtypes"),
    ({"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]]}, "shapes"),
    ({"names": [], "dtypes": [], "shapes": []}, "names"),
    ({"names": ["a", "a"], "dtypes": ["float32"] * 2, "shapes": [[1]] * 2}, "repeat"),
    ({"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "load_format": "flattened_bucket"}, "load_format"),
])
def test_update_weights_from_distributed_bodies_are_checked(body, field) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        sglang_wire.parse_weights_from_distributed(body)
