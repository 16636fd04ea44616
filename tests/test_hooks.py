"""Reward and filter functions imported by path (--custom-rm-path, --dynamic-sampling-filter-path): the
three kinds, sync and async, errors naming the function, a slow one not delaying the abort, and a run."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import textwrap
import time

import numpy as np
import pytest
from _loop_utils import ScriptedEngine
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext import ListDataSource, Prompt, Scheduler, SchedulerConfig
from april_ext.errors import ConfigError, InvalidStateError
from april_ext.rollout import RolloutLoop
from april_ext.training import TrainConfig, train
from april_ext.training.hooks import ImportedFilter, ImportedReward, reward_kind

REWARDS = '''
import asyncio
import time

calls = []

def by_sample(prompt, response):
    return float(len(response))

async def by_sample_async(prompt, response):
    await asyncio.sleep(0)
    return float(len(response))

def by_group(prompt, responses):
    return [float(len(r)) for r in responses]

async def by_batch_async(prompts, responses):
    return [float(len(r)) for p, r in zip(prompts, responses)]

def declared(a, b):
    return [float(len(r)) for r in b]
declared.reward_kind = "group"

def fails(prompt, response):
    raise KeyError("label")

def slow(prompt, response):
    time.sleep(5)
    return 0.0

def wrong_count(prompt, responses):
    return [1.0]

def three(a, b, c):
    return 0.0

def slow_on_p1(prompt, responses):
    if prompt.id == "p1":
        time.sleep(0.5)
        calls.append(time.perf_counter())
    return [float(r[0] % 2 + len(r)) for r in responses]

def length_reward(prompt, response):
    calls.append(len(response))
    return len(response) / 100

def keep_all(rewards):
    calls.append(list(rewards))
    return True

def broken_filter(rewards):
    return "yes"
'''


@pytest.fixture
def hooks_module(tmp_path, monkeypatch):
    name = f"user_rewards_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, importlib.import_module(name)
    sys.modules.pop(name, None)


PROMPT = Prompt("q0", [1, 2, 3])
RESPONSES = [np.arange(n, dtype=np.int32) for n in (1, 2, 5)]


@pytest.mark.parametrize("fn, kind", [("by_sample", "sample"), ("by_sample_async", "sample"), ("by_group", "group"),
                                      ("by_batch_async", "batch"), ("declared", "group")])
def test_each_kind_scores_a_group_the_same(hooks_module, fn, kind):
    name, _ = hooks_module
    reward = ImportedReward.from_path(f"{name}:{fn}")
    assert reward.kind == kind
    assert asyncio.run(reward.score_group(PROMPT, RESPONSES)) == [1.0, 2.0, 5.0]
    assert asyncio.run(reward(PROMPT, RESPONSES[2])) == 5.0
    # "pkg.module.fn" works too, and a declared kind wins over the signature.
    assert ImportedReward.from_path(f"{name}.{fn}").kind == kind
    assert ImportedReward.from_path(f"{name}:by_group", kind="batch").kind == "batch"


@pytest.mark.parametrize("fn, message", [
    ("fails", r"reward function {m}:fails failed on prompt 'q0': KeyError: 'label'"),
    ("slow", r"reward function {m}:slow took more than 0.2 s on prompt 'q0'"),
    ("wrong_count", r"reward function {m}:wrong_count \(group\) returned \[1.0\] on prompt 'q0': a list of 3"),
])
def test_a_failing_or_slow_reward_is_an_error_naming_it(hooks_module, fn, message):
    name, _ = hooks_module
    reward = ImportedReward.from_path(f"{name}:{fn}", timeout_s=0.2)
    start = time.perf_counter()
    with pytest.raises(InvalidStateError, match=message.format(m=name)):
        asyncio.run(reward.score_group(PROMPT, RESPONSES))
    assert time.perf_counter() - start < 4  # the slow one is not waited for


def test_a_reward_built_with_decode_gets_text(hooks_module):
    name, _ = hooks_module
    reward = ImportedReward.from_path(f"{name}:by_group", decode=lambda ids: "x" * (2 * len(ids)))
    assert asyncio.run(reward.score_group(PROMPT, RESPONSES)) == [2.0, 4.0, 10.0]


def test_bad_paths_and_signatures_are_config_errors(hooks_module):
    name, module = hooks_module
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        ImportedReward.from_path("no_such_module_xyz:fn")
    with pytest.raises(ConfigError, match=f"module '{name}' has no attribute 'nope'"):
        ImportedReward.from_path(f"{name}:nope")
    with pytest.raises(ConfigError, match=r"required parameters \['a', 'b', 'c'\]"):
        ImportedReward.from_path(f"{name}:three")
    with pytest.raises(ConfigError, match="is a list, not a function"):
        ImportedReward.from_path(f"{name}:calls")
    assert reward_kind(module.three, "x", "sample") == "sample"


def test_filter_errors_name_the_filter(hooks_module):
    name, _ = hooks_module
    assert ImportedFilter.from_path(f"{name}:keep_all")([1.0, 0.0]) is True
    with pytest.raises(InvalidStateError, match=rf"group filter {name}:broken_filter returned 'yes'"):
        ImportedFilter.from_path(f"{name}:broken_filter")([1.0])


def test_a_slow_imported_reward_does_not_delay_the_abort(hooks_module):
    """As tests/test_rollout.py's slow-reward test, through an imported group-level sync reward: group 0
    is rewarded at once (step done), group 1's reward takes 0.5 s, group 2 is long; the abort is issued
    before group 1's reward finishes, which still reaches the scheduler for the next step."""
    name, module = hooks_module
    engine = ScriptedEngine(lambda ids: int(ids[2]), delay=0.01)
    data = ListDataSource([Prompt(f"p{i}", [1, 5, n, 3]) for i, n in enumerate([3, 3, 150])])
    sched = Scheduler(SchedulerConfig(rollout_batch_size=1, n_samples_per_prompt=2, over_sampling_batch_size=3,
                                      max_response_len=200), data)

    async def run():
        loop = RolloutLoop(engine, sched, ImportedReward.from_path(f"{name}:slow_on_p1"), clock=time.perf_counter)
        first = await loop.run_step(0)
        abort_at, pending = time.perf_counter(), loop.pending_rewards
        await engine.update_weights({}, 1)
        second = await loop.run_step(1)
        return first, abort_at, pending, second

    first, abort_at, pending, second = asyncio.run(run())
    assert first.batch.prompt_ids == ["p0"] and first.metrics.aborted_samples == 2
    assert pending >= 1 and module.calls and abort_at < module.calls[0]
    assert first.metrics.wall_s < 0.5
    assert second.batch.prompt_ids == ["p1"]


@pytest.mark.usefixtures("one_thread")
def test_a_run_with_a_custom_reward_path_and_a_filter_path(hooks_module, tmp_path):
    name, module = hooks_module
    config = TrainConfig(counting_max_count=12, counting_symbols=2, hidden_size=16, num_layers=1,
                         rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=4, max_num_seqs=64,
                         num_blocks=256, progress=False, plots=False, num_steps=2, output_dir=str(tmp_path / "run"),
                         custom_rm_path=f"{name}:length_reward", dynamic_sampling_filter_path=f"{name}.keep_all")
    result = train(config)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 == len(result.history)
    for row in rows:  # the batch's rewards are the imported function's: length / 100
        assert row["rollout/reward_mean"] == pytest.approx(np.mean(row["rollout/response_lens"]) / 100)
    lengths = [c for c in module.calls if isinstance(c, int)]
    groups = [c for c in module.calls if isinstance(c, list)]
    assert len(lengths) >= 16 and len(groups) * 4 == len(lengths)
    assert all(len(g) == 4 for g in groups)


def test_a_bad_reward_path_fails_before_the_run_starts(tmp_path):
    with pytest.raises(ConfigError, match="custom_rm_path='no_such_module_xyz:fn'"):
        train(TrainConfig(output_dir=str(tmp_path / "run"), progress=False, custom_rm_path="no_such_module_xyz:fn"))
