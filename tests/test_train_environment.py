"""A user's own multi-turn Environment by import path (`--environment-path`, TrainConfig.environment_path) over a
prompt file, run as a user runs it: examples/calculator_env.py writes its demo model, tokenizer and prompts, and
`april-ext train` trains on them in a subprocess, with multi-turn evaluation, checkpoints and a resume; a record
whose environment cannot start ends its trajectory with "start_error" and the run goes on. The same through
TrainingRun over launched SGLang servers and under every long-tail strategy, and a ConfigError naming
environment_path for each bad input."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext import ConfigError
from april_ext.data import load_tokenizer
from april_ext.strategies import STRATEGIES
from april_ext.training import TrainConfig, train
from april_ext.training.hooks import load_environment

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
ROOT = str(Path(__file__).resolve().parents[1])
RUN = dict(rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=4, max_response_len=24,
           max_num_seqs=64, num_blocks=256, progress=False, plots=False, num_threads=1)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([EXAMPLES, ROOT, os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's demo, written by its command line; every fifth record's label is not a number."""
    out = tmp_path_factory.mktemp("calculator")
    subprocess.run([sys.executable, os.path.join(EXAMPLES, "calculator_env.py"), str(out)], check=True, env=_env(),
                   timeout=120, capture_output=True)
    records = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    for i in range(0, len(records), 5):
        records[i]["label"] = "seven"
    (out / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


def _flags(settings: dict[str, Any]) -> list[str]:
    from _trainer_utils import cli_flags

    return cli_flags(settings)


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_users_environment_trains_from_the_command_line_with_evaluation_and_resumes(demo, tmp_path) -> None:
    out = tmp_path / "run"
    flags = {**RUN, "data": str(demo / "mixed.jsonl"), "model": str(demo / "model"),
             "environment_path": "calculator_env:CalculatorEnv", "eval_interval": 2,
             "eval_prompt_data": str(demo / "eval.jsonl"), "output_dir": str(out), "save_interval": 2}
    for steps in (4, 6):
        cmd = [sys.executable, "-m", "april_ext.cli", "train", *_flags({**flags, "num_steps": steps}),
               *(["--resume"] if steps == 6 else [])]
        done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and all(r["rollout/batch_groups"] == 2 for r in rows)
    assert sum(r["env/tool_calls"] for r in rows) > 0 and sum(r["env/observations"] for r in rows) > 0
    assert sum(r.get("env/finished_start_error", 0) for r in rows) > 0  # the bad records ended; the run went on
    assert all("eval/turns_mean" in r and 0 <= r["eval/reward_mean"] <= 1 for r in rows if r["step"] % 2 == 0)
    saved = out / "checkpoints" / "step_000006" / "environment.pkl"
    assert pickle.loads(saved.read_bytes())["format"] == "april_ext.trajectories/1"
    config = json.loads((out / "config.json").read_text())
    assert config["environment_path"] == "calculator_env:CalculatorEnv"


@pytest.mark.slow
def test_a_users_environment_trains_through_training_run_over_launched_sglang_servers(
        demo, tmp_path, monkeypatch, one_thread) -> None:
    monkeypatch.syspath_prepend(EXAMPLES)
    result = train(TrainConfig(**RUN, task=None, data=str(demo / "train.jsonl"), model=str(demo / "model"),
                               environment_path="calculator_env:CalculatorEnv", engine="sglang", sglang_launch=True,
                               sglang_module="april_ext.server", sglang_launch_timeout_s=120.0,
                               sglang_args="--num-blocks 256 --max-running-requests 64 --seed 0", eval_interval=2,
                               eval_prompt_data=str(demo / "eval.jsonl"), num_steps=2,
                               output_dir=str(tmp_path / "run")))
    assert [r["rollout/batch_groups"] for r in result.history] == [2, 2]
    assert sum(r["env/tool_calls"] for r in result.history) > 0 and "eval/turns_mean" in result.history[1]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [None, *STRATEGIES])
def test_a_users_environment_trains_under_every_long_tail_strategy(demo, tmp_path, monkeypatch, one_thread,
                                                                   strategy) -> None:
    monkeypatch.syspath_prepend(EXAMPLES)
    result = train(TrainConfig(**{**RUN, "over_sampling_batch_size": 3}, task=None, data=str(demo / "train.jsonl"),
                               model=str(demo / "model"), environment_path="calculator_env:CalculatorEnv",
                               strategy=strategy, partial_rollout=strategy is not None, num_steps=3,
                               output_dir=str(tmp_path / "run")))
    assert [r["rollout/batch_groups"] for r in result.history] == [2, 2, 2]
    assert sum(r["env/tool_calls"] for r in result.history) > 0


BAD = {
    "not_a_module": ("no_such_module:make", r"cannot import module 'no_such_module'"),
    "no_attribute": ("bad_envs:missing", r"module 'bad_envs' has no attribute 'missing'"),
    "not_an_environment": ("bad_envs:NUMBER", r"is a int: an Environment .* or a callable returning one"),
    "sync_methods": ("bad_envs:SyncEnv", r"returned a SyncEnv, which is not an Environment: it needs async start"),
    "returns_other": ("bad_envs:returns_none", r"returned a NoneType, which is not an Environment"),
    "factory_raises": ("bad_envs:broken", r"building the environment raised RuntimeError: no tool server"),
    "two_parameters": ("bad_envs:two", r"takes 2 required parameters \['tokenizer', 'other'\]"),
    "bad_stop_tokens": ("bad_envs:bad_stops", r"stop_token_ids='x' must be token ids"),
}
BAD_ENVS = """
import calculator_env

NUMBER = 3


class SyncEnv:
    def start(self, prompt):
        return {}

    def step(self, state, model_turn):
        return None


def returns_none(tokenizer):
    return None


def broken():
    raise RuntimeError("no tool server")


def two(tokenizer, other):
    return None


def bad_stops(tokenizer):
    env = calculator_env.CalculatorEnv(tokenizer)
    env.stop_token_ids = "x"
    return env
"""


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_bad_environment_path_is_a_config_error_naming_it(demo, tmp_path, monkeypatch, capsys, case) -> None:
    from april_ext import cli

    (tmp_path / "bad_envs.py").write_text(BAD_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(EXAMPLES)
    path, message = BAD[case]
    flags = {**RUN, "data": str(demo / "train.jsonl"), "model": str(demo / "model"), "environment_path": path,
             "output_dir": str(tmp_path / "run"), "num_steps": 1}
    assert cli.main(["train", *_flags(flags)]) == 2
    err = capsys.readouterr().err
    assert f"environment_path={path!r}" in err
    assert re.search(message, err), err
    with pytest.raises(ConfigError, match=message):  # the same through the API
        load_environment(path, load_tokenizer(str(demo / "model")))


@pytest.mark.parametrize(("changes", "message"), [
    ({"task": "counting", "data": None, "model": None}, r"environment_path='m:make' is not allowed: None unless data"),
    ({"custom_rm_path": "m:fn"}, r"custom_rm_path='m:fn' is not allowed: None with environment_path \(the environment"),
    ({"environment_path": "not a path"}, r"environment_path='not a path' is not allowed: an import path"),
])
def test_settings_a_users_environment_cannot_run_with_are_refused(changes, message) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{"task": None, "data": "p.jsonl", "model": "ckpt", "environment_path": "m:make", **changes})
