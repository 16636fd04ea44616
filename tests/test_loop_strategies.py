"""Long-tail strategies in training runs: ``TrainConfig.strategy`` / ``april-ext train --strategy`` (the preset's
scheduler settings, explicit settings winning) and the synchronous baseline that --compare measures them against."""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import replace
from typing import Any

import pytest
from _loop_utils import SampleLengthEngine, ScriptedEngine
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext import ListDataSource, Prompt, Scheduler, SchedulerConfig, cli
from april_ext.cli.train import config_from_args
from april_ext.engine import AsyncEngine, EngineConfig, EngineCore
from april_ext.errors import ConfigError
from april_ext.model import LlamaForCausalLM
from april_ext.protocol import SamplingParams
from april_ext.rollout import RolloutLoop, scheduler_config_for
from april_ext.strategies import STRATEGIES, apply_strategy
from april_ext.tasks import CountingTask, CountingTaskConfig
from april_ext.training import TrainConfig, TrainingRun


def test_a_strategy_sets_its_scheduler_settings_for_the_task_cap() -> None:
    seer = TrainConfig(strategy="seer").scheduler_config(max_response_len=40)
    # The chunk follows the task's response cap, known only when the run builds its task.
    assert (seer.over_sampling_batch_size, seer.dispatch_order, seer.chunk_tokens) == (8, "longest_predicted_first", 5)
    rollpacker = TrainConfig(strategy="rollpacker").scheduler_config(40)
    assert rollpacker.tail_batching and rollpacker.tail_batching_restart and rollpacker.over_sampling_batch_size == 16
    assert rollpacker.tail_extra_samples == 0
    assert TrainConfig(strategy="april").scheduler_config(40) == TrainConfig().scheduler_config(40)


def test_explicit_scheduler_settings_win_over_the_strategy() -> None:
    config = TrainConfig(strategy="seer", over_sampling_batch_size=12, chunk_tokens=7, dispatch_order="shortest_first")
    seer = config.scheduler_config(40)
    assert (seer.over_sampling_batch_size, seer.chunk_tokens, seer.dispatch_order) == (12, 7, "shortest_first")
    assert TrainConfig(strategy="april_tail", refill="continuous").scheduler_config(40).refill == "continuous"


def test_a_setting_given_may_rely_on_one_the_strategy_sets() -> None:
    # tail_extra_samples needs tail_batching, which rollpacker sets: the combination is what is validated.
    config = TrainConfig(strategy="rollpacker", tail_extra_samples=2).scheduler_config(40)
    assert config.tail_batching and config.tail_batching_restart and config.tail_extra_samples == 2
    parser = cli.build_parser()
    args = parser.parse_args(["train", "--strategy", "rollpacker", "--tail-extra-samples", "2"])
    assert config_from_args(args).scheduler_config(40).tail_extra_samples == 2
    with pytest.raises(ConfigError, match="tail_extra_samples"):
        TrainConfig(strategy="seer", tail_extra_samples=2)  # seer has no tail batching


def test_an_unknown_strategy_is_refused_with_the_names() -> None:
    with pytest.raises(ConfigError, match="TrainConfig.strategy='fast' is not allowed: None or one of 'april'"):
        TrainConfig(strategy="fast")
    assert all(f"'{name}'" in str(pytest.raises(ConfigError, TrainConfig, strategy="x").value) for name in STRATEGIES)


def test_strategy_flag_and_config_key(tmp_path, capsys) -> None:
    parser = cli.build_parser()
    config = config_from_args(parser.parse_args(["train", "--strategy", "sortedrl", "--max-response-len", "32"]))
    assert config.strategy == "sortedrl" and config.scheduler_config().dispatch_order == "shortest_first"
    path = tmp_path / "run.toml"
    path.write_text('strategy = "april_seer"\nchunk_tokens = 3\n')
    from_file = config_from_args(parser.parse_args(["train", "--config", str(path)]))
    assert from_file.scheduler_config(40).chunk_tokens == 3
    assert from_file.scheduler_config(40).dispatch_order == "longest_predicted_first"
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "--strategy" in capsys.readouterr().out
    assert cli.main(["train", "--strategy", "nope"]) == 2
    assert "TrainConfig.strategy='nope' is not allowed" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_baseline_is_the_plain_synchronous_one_whatever_the_strategy(name) -> None:
    baseline = scheduler_config_for(TrainConfig(strategy=name).scheduler_config(40), partial_rollout=False)
    plain = scheduler_config_for(TrainConfig().scheduler_config(40), partial_rollout=False)
    # Carry changes nothing in the baseline (nothing runs when its batch is taken).
    assert replace(baseline, step_boundary="abort") == plain


def test_the_scheduler_config_is_built_once_with_the_train_config() -> None:
    config = TrainConfig(strategy="seer")
    assert config.scheduler_config() is config.scheduler_config()
    # The task's cap stands in for a max_response_len of None; a config's own cap wins over it.
    assert config.scheduler_config(40).chunk_tokens == 5
    capped = TrainConfig(strategy="seer", max_response_len=64)
    assert capped.scheduler_config(40) is capped.scheduler_config() and capped.scheduler_config().chunk_tokens == 8


@pytest.mark.parametrize("changes", [dict(step_boundary="carry"), dict(strategy="april_carry"),
                                     dict(strategy="april_carry", partial_rollout=False)])
def test_colocated_carry_over_sglang_is_refused_when_the_config_is_built(tmp_path, changes) -> None:
    sglang: dict[str, Any] = dict(engine="sglang", sglang_urls=("http://127.0.0.1:1",), model=str(tmp_path))
    given = "--strategy april_carry" if "strategy" in changes else "--step-boundary carry"
    with pytest.raises(ConfigError, match=r"TrainConfig\.step_boundary='carry' with colocate needs the embedded "
                                          rf"engine: .* \({given}, --colocate, --engine sglang\): use "):
        TrainConfig(colocate=True, **sglang, **changes)
    assert TrainConfig(**sglang, **changes).scheduler_config().step_boundary == "carry"  # not colocated
    assert TrainConfig(colocate=True, **changes).colocate  # the embedded engine


def _tail_share(lengths: list[int]) -> float:
    sched = Scheduler(SchedulerConfig(rollout_batch_size=len(lengths), n_samples_per_prompt=1,
                                      over_sampling_batch_size=len(lengths), max_response_len=100),
                      ListDataSource([Prompt(f"p{i}", [1, 5, n, 3]) for i, n in enumerate(lengths)]))
    loop = RolloutLoop(ScriptedEngine(lambda ids: int(ids[2])), sched, lambda prompt, response: 1.0)
    return asyncio.run(loop.run_step(0)).metrics.tail_share


def test_tail_share_is_the_time_spent_on_the_last_tenth_of_the_samples() -> None:
    # Nine samples of 4 tokens and one of 60: most of the step waits on that one.
    assert _tail_share([4] * 9 + [60]) > 0.8
    assert _tail_share([10] * 10) < 0.05


def test_a_group_completed_by_its_cancelled_samples_abort_is_rewarded_in_the_same_step() -> None:
    # n = 2 of 3 slots: slots 0 and 1 finish first, slot 2 is cancelled while running and its abort completes
    # the group. The loop hands that group to the reward before deciding what runs next (it once saw nothing
    # running, no reward pending and raised "rollout loop stalled").
    config = SchedulerConfig(rollout_batch_size=1, n_samples_per_prompt=2, over_sampling_batch_size=1,
                             max_response_len=60, tail_batching=True, tail_extra_samples=1)
    sched = Scheduler(config, ListDataSource([Prompt(f"p{i}", [1, 5, 4, 3]) for i in range(3)]))
    engine = SampleLengthEngine(lambda sid: [2, 3, 50][sid % 3])
    loop = RolloutLoop(engine, sched, lambda prompt, response: 1.0)

    async def steps() -> list[Any]:
        results = []
        for version in range(3):
            results.append(await asyncio.wait_for(loop.run_step(version), 30))
            await engine.update_weights({}, version + 1)
        return results

    for result in asyncio.run(steps()):
        assert result.batch.n_groups == 1 and result.batch.response_lens.tolist() == [2, 3]
        assert result.metrics.scheduler["surplus_samples_cancelled"] == 1


TASK = CountingTask(CountingTaskConfig(n_symbols=2, max_count=24, median_count=3, sigma=1.0, seed=2))
_prefixes = itertools.count()


async def _chunked_step(**scheduler: object) -> tuple[Any, Any, Any]:
    """One rollout step of the counting task on the embedded engine (KV blocks of 4 tokens); returns the
    step's metrics and the engine's stats before and after it."""
    model = LlamaForCausalLM(TASK.model_config(hidden_size=32, intermediate_size=64, max_position_embeddings=96))
    model.init_weights(0)
    sched = Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=4, max_response_len=40,
                                      **scheduler), TASK)  # type: ignore[arg-type]
    core = EngineCore(model, EngineConfig(block_size=4, num_blocks=512, max_num_seqs=64,
                                          memory_tag_prefix=f"strategies-loop-{next(_prefixes)}-"))
    async with AsyncEngine(core) as engine:
        loop = RolloutLoop(engine, sched, TASK.reward, sampling=SamplingParams(stop_token_ids=(TASK.eos_id,)),
                           seed=3, engine_capacity=64)
        before = core.stats()
        result = await loop.run_step(0)
        return result.metrics, before, core.stats()


def test_a_divided_rollout_continues_its_chunks_from_the_engines_prefix_cache(one_thread) -> None:
    metrics, before, after = asyncio.run(_chunked_step(over_sampling_batch_size=2, chunk_tokens=5))
    stats = metrics.scheduler
    assert stats["chunk_returns"] > 0 and stats["continuation_requests"] == stats["chunk_returns"]
    assert stats["re_prefill_tokens"] == 0
    hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    # Every continuation finds all its full blocks but the one holding its last token (blocks of 4).
    assert hits >= stats["continuation_tokens"] - 4 * stats["continuation_requests"]
    # The engine prefilled the new prompts (the scheduler's prefill_tokens) and at most a block per continuation.
    prefilled = after.prefill_tokens - before.prefill_tokens
    assert prefilled <= stats["prefill_tokens"] + 4 * stats["continuation_requests"]


class _Recording(ScriptedEngine):
    def __init__(self) -> None:
        super().__init__(lambda ids: int(ids[2]))
        self.priorities: list[int | None] = []

    def generate(self, input_ids, params=None, request_id=None):
        self.priorities.append(params.priority)
        return super().generate(input_ids, params, request_id)


@pytest.mark.parametrize("order, sign", [("longest_predicted_first", 1), ("shortest_first", -1), ("fifo", None)])
def test_requests_carry_the_predicted_remaining_length_as_their_priority(order, sign) -> None:
    sched = Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=3,
                                      max_response_len=40, chunk_tokens=6, dispatch_order=order),
                      ListDataSource([Prompt(f"p{i}", [1, 5, n, 3]) for i, n in enumerate([3, 20, 30, 8])]))
    requests = []
    dispatch = sched.dispatch

    def recorded():
        out = dispatch()
        requests.extend(out)
        return out

    sched.dispatch = recorded
    engine = _Recording()
    asyncio.run(RolloutLoop(engine, sched, lambda prompt, response: 1.0).run_step(0))
    assert len(engine.priorities) == len(requests) > 6
    expected = [None if sign is None else sign * (r.predicted_len - (len(r.input_ids) - r.prompt_len))
                for r in requests]
    assert engine.priorities == expected
    assert sign is None or len(set(engine.priorities)) > 1


def test_compare_runs_the_strategy_against_the_plain_baseline(tmp_path, capsys, one_thread) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text("\n".join([
        "counting_median = 3.0", "counting_max_count = 12", "counting_symbols = 2", "hidden_size = 16",
        "num_layers = 1", "rollout_batch_size = 2", "n_samples_per_prompt = 4", "num_steps = 2",
        "max_num_seqs = 64", "num_blocks = 256", "progress = false", "plots = false",
        f'output_dir = "{tmp_path / "cmp"}"']))
    assert cli.main(["train", "--config", str(path), "--compare", "--strategy", "april_seer"]) == 0
    out = capsys.readouterr().out
    assert "strategy april_seer rollout throughput vs baseline:" in out and "tail (last 10%)" in out
    ran = {name: json.loads((tmp_path / "cmp" / name / "config.json").read_text())["scheduler"]
           for name in ("baseline", "april_seer")}
    assert ran["april_seer"]["dispatch_order"] == "longest_predicted_first" and ran["april_seer"]["chunk_tokens"] >= 1
    assert ran["baseline"]["dispatch_order"] == "fifo" and ran["baseline"]["chunk_tokens"] is None
    rows = [json.loads(line) for line in (tmp_path / "cmp" / "april_seer" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["rollout/continuation_requests"] for r in rows) > 0


async def _steps(steps: int, slots: int = 64, **scheduler: object) -> list[Any]:
    """Steps of the counting task on the embedded engine with ``slots`` sequences running at once (few: the
    groups run in waves, so a tail of started groups is left when the batch is taken)."""
    model = LlamaForCausalLM(TASK.model_config(hidden_size=32, intermediate_size=64, max_position_embeddings=96))
    model.init_weights(0)
    sched = Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=3, max_response_len=30,
                                      **scheduler), TASK)  # type: ignore[arg-type]
    core = EngineCore(model, EngineConfig(block_size=4, num_blocks=512, max_num_seqs=slots,
                                          memory_tag_prefix=f"strategies-loop-{next(_prefixes)}-"))
    results = []
    async with AsyncEngine(core) as engine:
        loop = RolloutLoop(engine, sched, TASK.reward, sampling=SamplingParams(stop_token_ids=(TASK.eos_id,)),
                           seed=5, engine_capacity=64)
        for version in range(steps):
            results.append(await asyncio.wait_for(loop.run_step(version), 120))
            await engine.update_weights({}, version + 1)
        await loop.abort_carried()
        await loop.drain_rewards()
    return results


@pytest.mark.parametrize("boundary", ["abort", "carry"])
@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "april_carry"])
def test_every_strategy_runs_the_loop_on_the_embedded_engine(name, boundary, one_thread) -> None:
    base = SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=3, over_sampling_batch_size=4,
                           max_response_len=30, step_boundary=boundary)
    config = apply_strategy(base, name)
    settings = {f: getattr(config, f) for f in ("over_sampling_batch_size", "dispatch_order", "resume_priority",
                                                "chunk_tokens", "tail_batching", "tail_batching_restart",
                                                "tail_extra_samples", "step_boundary")}
    results = asyncio.run(_steps(6, slots=4, **settings))
    assert [r.batch.n_groups for r in results] == [2] * 6
    for r in results:
        assert r.batch.n_samples == 6 and r.batch.versions.max() <= r.batch.policy_version
    if config.chunk_tokens is not None:
        assert sum(r.metrics.scheduler["continuation_requests"] for r in results) > 0
    if config.tail_batching:
        assert sum(r.metrics.scheduler["long_round"] for r in results) > 0
    if config.tail_extra_samples:  # rollpacker: groups gave up their extra samples
        assert sum(r.metrics.scheduler["surplus_samples_cancelled"] for r in results) > 0


def _tiny_run(tmp_path, **changes) -> TrainConfig:
    return TrainConfig(counting_median=3.0, counting_max_count=12, counting_symbols=2, hidden_size=16, num_layers=1,
                       rollout_batch_size=2, n_samples_per_prompt=4, max_num_seqs=64, num_blocks=256, num_steps=1,
                       progress=False, plots=False, output_dir=str(tmp_path / "run"), **changes)


def test_a_strategy_that_carries_sets_up_the_run_for_carry(tmp_path, one_thread) -> None:
    async def backup() -> bool:
        async with TrainingRun(_tiny_run(tmp_path, strategy="april_carry", colocate=True)) as run:
            return run.engine.core.config.kv_cache_cpu_backup  # type: ignore[attr-defined]

    # Colocated carry keeps the carried samples' KV in a host copy while the trainer has the device.
    assert asyncio.run(backup())
    with pytest.raises(ConfigError, match="step_boundary='carry' with colocate needs the embedded engine"):
        asyncio.run(TrainingRun(_tiny_run(tmp_path, strategy="april_carry", colocate=True, engine="sglang",
                                          sglang_urls=("http://127.0.0.1:1",), model=str(tmp_path))).__aenter__())


def test_the_compare_summary_keeps_a_long_strategy_name_apart_from_the_baseline(capsys) -> None:
    from april_ext.cli.train import _print_summary

    _print_summary({"baseline": {"steps": 300}, "rollpacker_extra": {"steps": 300}})
    header, steps = capsys.readouterr().out.splitlines()[:2]
    assert header.split() == ["baseline", "rollpacker_extra"] and steps.split() == ["steps", "300", "300"]
