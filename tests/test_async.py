"""Asynchronous APRIL (training.pipeline): the rollout of the next batches runs while the trainer trains, at most
max_head_offpolicyness versions ahead, over the real embedded engine and trainer (and SGLang-API servers).

The property test draws d, the step boundary, a staleness bound and its policy, and a stop and resume; every
trained model token, rescored by the weights of the version it claims, equals its behavior logprob, no token is
trained with a lag above the bound, no sample is trained twice, every group whole, across the restart too."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from april_ext import ConfigError
from april_ext.model import LlamaForCausalLM
from april_ext.trainer.process import ProcessTrainer
from april_ext.training import TrainConfig, train
from april_ext.training.engines import build_engine
from april_ext.batch import version_lags
from april_ext.training.pipeline import RolloutPipeline
from april_ext.training.run import TrainingRun, run_model_config
from april_ext.training.trainers import build_trainer

from _torch_threads import one_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(counting_median=3.0, counting_sigma=0.8, counting_max_count=12, counting_symbols=2, hidden_size=16,
            num_layers=1, rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=4,
            max_num_seqs=64, num_blocks=256, lr=0.003, progress=False, plots=False, num_threads=1)


def tiny(tmp_path, name: str = "run", **changes: Any) -> TrainConfig:
    return TrainConfig(**{**TINY, "output_dir": str(tmp_path / name), "num_steps": 4, **changes})


def _rows(path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _same_training(a: list[dict], b: list[dict]) -> None:
    keys = ("rollout/reward_mean", "rollout/response_lens", "rollout/generated_tokens", "train/loss")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]


# ------------------------------------------------------------------------------------------------ settings

@pytest.mark.parametrize("changes, flag", [
    (dict(max_head_offpolicyness=-1), "--max-head-offpolicyness"),
    (dict(async_rollout=True, colocate=True), "--colocate"),
    (dict(async_rollout=True, engine="sglang", sglang_launch=True, custom_generate_function_path="pkg.mod:generate"),
     "--custom-generate-function-path"),
    (dict(async_rollout=True, max_head_offpolicyness=2, max_staleness=1, staleness_policy="restart"),
     "--max-staleness 1"),
])
def test_what_cannot_run_asynchronously_is_refused_when_the_config_is_built(tmp_path, changes, flag):
    with pytest.raises(ConfigError, match=flag.replace("-", r"\-")):
        tiny(tmp_path, **changes)


def test_the_decoupled_loss_is_on_by_default_in_an_asynchronous_run_unless_it_corrects_with_tis(tmp_path):
    assert not tiny(tmp_path).decoupled_loss
    assert tiny(tmp_path, async_rollout=True).decoupled_loss
    assert not tiny(tmp_path, async_rollout=True, tis_cap=2.0).decoupled_loss
    assert not tiny(tmp_path, async_rollout=True, use_decoupled_loss=False).decoupled_loss


def test_the_command_line_takes_the_asynchronous_flags():
    from april_ext.cli import build_parser
    from april_ext.cli.train import config_from_args

    args = build_parser().parse_args(["train", "--async-rollout", "--max-head-offpolicyness", "2"])
    config = config_from_args(args)
    assert config.async_rollout and config.max_head_offpolicyness == 2


# ------------------------------------------------------------------------------------------------ pipeline

def _result(version: int) -> Any:
    batch = type("Batch", (), {"n_groups": 1})()
    return type("Result", (), {"batch": batch, "version": version,
                               "metrics": type("M", (), {"scheduler": {"data_exhausted": False}})()})()


def test_the_pipeline_runs_at_most_d_versions_ahead_and_a_failed_sync_publishes_nothing():
    async def scenario() -> None:
        started: list[int] = []

        async def rollout(version: int) -> Any:
            started.append(version)
            await asyncio.sleep(0)
            return _result(version)

        pipeline = RolloutPipeline(rollout, 2, first=0, last=5, held=lambda b: False)
        result, _ = await pipeline.next_batch()
        for _ in range(20):
            await asyncio.sleep(0)
        # Batches 0, 1 and 2 under version 0 (2 ahead of it); batch 3 waits for version 1.
        assert started == [0, 0, 0] and pipeline.ready == 2

        async def failing() -> None:
            raise RuntimeError("the engine refused the weights")

        with pytest.raises(RuntimeError, match="refused"):
            await pipeline.publish(1, failing)
        for _ in range(20):
            await asyncio.sleep(0)
        assert pipeline.published == 0 and started == [0, 0, 0]

        async def ok() -> None:
            pass

        await pipeline.publish(1, ok)
        for _ in range(20):
            await asyncio.sleep(0)
        assert started == [0, 0, 0, 1]
        await pipeline.cancel()

    asyncio.run(scenario())


def test_a_batch_after_a_checkpoint_waits_for_its_release():
    async def scenario() -> None:
        started: list[int] = []

        async def rollout(version: int) -> Any:
            started.append(version)
            return _result(version)

        pipeline = RolloutPipeline(rollout, 1, first=0, last=3, held=lambda b: b == 2)
        await pipeline.next_batch()
        await pipeline.publish(1, lambda: asyncio.sleep(0))
        for _ in range(20):
            await asyncio.sleep(0)
        assert started == [0, 0]  # batch 2 may run under version 1, but it waits for the step before it
        await pipeline.release(2)
        for _ in range(20):
            await asyncio.sleep(0)
        assert started == [0, 0, 1]
        await pipeline.cancel()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------------------------ runs

def test_with_d_0_an_asynchronous_run_trains_what_the_synchronous_one_does(tmp_path):
    sync = train(tiny(tmp_path, "sync"))
    overlapped = train(tiny(tmp_path, "async", async_rollout=True, max_head_offpolicyness=0))
    _same_training(sync.history, overlapped.history)
    # Each batch generated under the version it is trained at: nothing runs ahead.
    assert all(r["variant"] == "april_async" and r["policy_version"] == r["step"] - 1 for r in overlapped.history)


def test_with_d_1_the_rollout_runs_a_version_ahead_in_a_trainer_process_and_a_seeded_run_repeats(tmp_path):
    first = train(tiny(tmp_path, "a", async_rollout=True, num_steps=5))
    again = train(tiny(tmp_path, "b", async_rollout=True, num_steps=5))
    _same_training(first.history, again.history)
    rows = first.history
    # The first two batches are generated under version 0; from then on each under the version before its own.
    assert [r["policy_version"] for r in rows] == [0, 0, 1, 2, 3]
    assert rows[0]["async/version_lag_max"] == 0
    for r in rows[1:]:
        # Every trained token is at least a version behind (generated under the version before its batch's).
        assert min(int(lag) for lag in r["async/version_lag_histogram"]) >= 1
        assert r["train/version"] == r["step"]
    assert rows[-1]["time/elapsed_s"] > 0 and all("async/trainer_idle_s" in r for r in rows)


def test_version_lags_count_trained_tokens_and_samples_spanning_versions():
    from april_ext.batch import TrainingBatch

    # Two samples of a 1-token prompt: [v1, v1, v2] and [v2]; the second's last token is masked.
    batch = TrainingBatch(
        tokens=np.zeros(6, np.int32), offsets=np.array([0, 4, 6]), prompt_lens=np.array([1, 1], np.int32),
        loss_mask=np.array([0, 1, 1, 1, 0, 0], np.uint8), behavior_logprobs=np.zeros(6, np.float32),
        versions=np.array([-1, 1, 1, 2, -1, 2], np.int32), rewards=np.zeros(2, np.float32),
        group_index=np.zeros(2, np.int32), sample_ids=np.array([0, 1]), finish_reasons=np.zeros(2, np.uint8),
        policy_version=3)
    lags = version_lags(batch)
    assert lags["version_lag_histogram"] == {"1": 1, "2": 2} and lags["version_lag_max"] == 2
    assert lags["version_lag_mean"] == pytest.approx(5 / 3) and lags["multi_version_frac"] == 0.5


def test_an_asynchronous_run_evaluates_pinned_to_a_version_checkpoints_and_resumes(tmp_path):
    first = train(tiny(tmp_path, async_rollout=True, num_steps=4, save_interval=2, eval_interval=2,
                       eval_counting_prompts=4))
    evals = [r for r in first.history if "eval/policy_version" in r]
    # Started after steps 2 and 4, under the weights those steps published.
    assert [r["eval/policy_version"] for r in evals] == [2, 4]
    resumed = train(tiny(tmp_path, async_rollout=True, num_steps=6, save_interval=2, resume=True))
    assert resumed.resumed_from == 4
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["time/elapsed_s"] > rows[3]["time/elapsed_s"]


def test_a_failed_weight_sync_stops_the_run_without_advancing_the_engines_version(tmp_path):
    calls = {"n": 0}

    @contextlib.asynccontextmanager
    async def flaky_engine(config, trainer, model_config, prefix):
        async with build_engine(config, trainer, model_config, prefix) as engine:
            update = engine.update_weights

            async def update_weights(weights, version):
                calls["n"] += 1
                if calls["n"] == 2:
                    raise RuntimeError("the engine refused the weights")
                return await update(weights, version)

            engine.update_weights = update_weights
            yield engine

    async def scenario() -> tuple[int, int]:
        async with TrainingRun(tiny(tmp_path, async_rollout=True), engine_factory=flaky_engine) as run:
            await run.step()
            with pytest.raises(RuntimeError, match="refused"):
                await run.step()
            assert run._pipeline is not None
            return run._pipeline.published, run.trainer.version

    published, trained = asyncio.run(scenario())
    assert (published, trained) == (1, 2)


@pytest.mark.slow
def test_an_asynchronous_run_over_sglang_api_servers(tmp_path):
    result = train(tiny(tmp_path, async_rollout=True, num_steps=3, engine="sglang", sglang_launch=True,
                        sglang_module="april_ext.server", sglang_launch_timeout_s=120.0,
                        sglang_args="--num-blocks 256 --max-running-requests 64 --seed 0", deterministic_rollout=False))
    rows = result.history
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["async/version_lag_max"] <= 2 for r in rows) and rows[-1]["async/version_lag_max"] >= 1


@pytest.mark.slow
def test_a_multi_turn_task_trains_asynchronously(tmp_path):
    result = train(TrainConfig(
        task="lookup", hidden_size=16, num_layers=1, rollout_batch_size=2, n_samples_per_prompt=4,
        over_sampling_batch_size=4, max_num_seqs=64, num_blocks=256, lr=0.003, progress=False, plots=False,
        tool_latency_median_s=0.05, tool_latency_p99_s=0.3, deterministic_rollout=False, num_threads=1,
        output_dir=str(tmp_path / "run"), num_steps=4, async_rollout=True))
    rows = result.history
    assert len(rows) == 4 and all("env/tool_calls" in r for r in rows)
    assert max(r["async/version_lag_max"] for r in rows) >= 1


# ------------------------------------------------------------------------------------------------ property

class _Recording:
    """The run's trainer, recording each batch it trains and the weights of every version it publishes."""

    def __init__(self, inner: Any, weights: dict[int, dict[str, torch.Tensor]], batches: list[Any]) -> None:
        self._inner, self._weights, self._batches = inner, weights, batches
        self._weights.setdefault(inner.version, dict(inner.export_weights(to_cpu=True).tensors))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def version(self) -> int:
        return self._inner.version

    def train_step(self, batch: Any) -> dict[str, float]:
        self._batches.append(batch)
        metrics = self._inner.train_step(batch)
        self._weights[self._inner.version] = dict(self._inner.export_weights(to_cpu=True).tensors)
        return metrics

    def load_checkpoint(self, path: Any) -> dict[str, Any]:
        extra = self._inner.load_checkpoint(path)
        self._weights.setdefault(self._inner.version, dict(self._inner.export_weights(to_cpu=True).tensors))
        return extra


def _recording_factory(weights: dict[int, dict[str, torch.Tensor]], batches: list[Any]) -> Any:
    @contextlib.contextmanager
    def factory(config: TrainConfig, initial: Any, prefix: str) -> Iterator[Any]:
        with build_trainer(config, initial, prefix) as inner:
            yield _Recording(inner, weights, batches)

    return factory


def _check_rescored(config: TrainConfig, weights: dict[int, dict[str, torch.Tensor]], batches: list[Any],
                    bound: int | None) -> None:
    """With step_boundary "carry" a sample running across an update keeps the KV cache its earlier tokens (and
    prompt) got under the older weights, so only its tokens of its first version are exactly that version's; with
    "abort" a resumed sample is prefilled again under the new weights, and every token is its version's."""
    models: dict[int, LlamaForCausalLM] = {}
    for batch in batches:
        for i in range(batch.n_samples):
            start, end, plen = int(batch.offsets[i]), int(batch.offsets[i + 1]), int(batch.prompt_lens[i])
            versions = batch.versions[start + plen:end]
            trained = batch.loss_mask[start + plen:end].astype(bool)
            assert (versions <= batch.policy_version).all()
            if bound is not None:
                assert (batch.policy_version - versions[trained] <= bound).all()
            ids = torch.as_tensor(batch.tokens[start:end], dtype=torch.int64)
            made = np.unique(versions[versions >= 0]).tolist()
            for version in made[:1] if config.scheduler_config().step_boundary == "carry" else made:
                if version not in models:
                    model = LlamaForCausalLM(run_model_config(config))
                    model.load_weights(iter(weights[version].items()))
                    models[version] = model.eval()
                with torch.no_grad():
                    logits = models[version](ids[None])[0].float()
                rescored = torch.log_softmax(logits, -1)[plen - 1:-1].gather(-1, ids[plen:, None]).squeeze(-1)
                mine = versions == version
                np.testing.assert_allclose(batch.behavior_logprobs[start + plen:end][mine],
                                           rescored.numpy()[mine], atol=2e-3)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(d=st.integers(0, 2), boundary=st.sampled_from(["abort", "carry"]),
       staleness=st.one_of(st.none(), st.tuples(st.integers(0, 1), st.sampled_from(["mask", "restart", "drop"]))),
       restart=st.booleans())
def test_every_trained_token_is_the_claimed_versions_and_within_the_bound(tmp_path_factory, d, boundary, staleness,
                                                                          restart):
    tmp_path = tmp_path_factory.mktemp("prop")
    bound = None if staleness is None else d + staleness[0]
    changes: dict[str, Any] = dict(async_rollout=True, max_head_offpolicyness=d, step_boundary=boundary,
                                   max_response_len=24, save_interval=2, counting_symbols=1, counting_max_count=4,
                                   over_sampling_batch_size=6)
    if staleness is not None:
        changes.update(max_staleness=bound, staleness_policy=staleness[1])
    weights: dict[int, dict[str, torch.Tensor]] = {}
    batches: list[Any] = []
    factory = _recording_factory(weights, batches)
    config = tiny(tmp_path, num_steps=2 if restart else 4, **changes)
    train(config, trainer_factory=factory)
    if restart:
        train(dataclasses.replace(config, num_steps=4, resume=True), trainer_factory=factory)
    assert [b.policy_version for b in batches] == [0, 1, 2, 3]
    _check_rescored(config, weights, batches, bound)
    trained = np.concatenate([b.sample_ids for b in batches])
    assert len(set(trained.tolist())) == len(trained), "a sample was trained twice"
    for b in batches:  # every group whole
        assert np.bincount(b.group_index).tolist() == [config.n_samples_per_prompt] * b.n_groups


def test_the_trainer_process_answers_like_the_trainer_and_ends_with_its_pipe(tmp_path):
    from april_ext.training.trainers import _new_torch_trainer, trainer_config

    config = tiny(tmp_path)
    model = LlamaForCausalLM(run_model_config(config))
    model.init_weights(0)
    with ProcessTrainer(_new_torch_trainer, (model, trainer_config(config)), num_threads=1) as trainer:
        assert trainer.pid != os.getpid() and trainer.version == 0
        exported = dict(trainer.export_weights().tensors)
        assert all(torch.equal(exported[n], p) for n, p in model.named_parameters())
        trainer.save_checkpoint(tmp_path / "ckpt")
        assert trainer.load_checkpoint(tmp_path / "ckpt") == {}
        pid = trainer.pid
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
