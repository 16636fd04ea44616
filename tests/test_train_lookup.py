"""`april-ext train --task lookup` end to end (seconds): the multi-turn lookup task trains on the embedded engine
with APRIL, writes the environment's metrics, saves the trajectories' state beside the scheduler's (a tool
call running at the save is run again after the resume), and refuses settings it cannot honour."""

from __future__ import annotations

import json
import os
import pickle

import pytest
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext import ConfigError
from april_ext.training import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")

# Slow tools next to a fast engine: trajectories are still with their tool when a step's batch is taken.
TINY = dict(task="lookup", hidden_size=16, num_layers=1, rollout_batch_size=2, n_samples_per_prompt=4,
            over_sampling_batch_size=4, max_num_seqs=64, num_blocks=256, lr=0.003, progress=False, plots=False,
            tool_latency_median_s=0.05, tool_latency_p99_s=0.3, deterministic_rollout=False)


def _config(tmp_path, **changes) -> TrainConfig:
    return TrainConfig(**{**TINY, "output_dir": str(tmp_path / "run"), "num_steps": 4, **changes})


def test_the_lookup_task_trains_saves_its_trajectories_and_resumes(tmp_path) -> None:
    result = train(_config(tmp_path, save_interval=2))
    assert [r["step"] for r in result.history] == [1, 2, 3, 4]
    for row in result.history:
        assert row["rollout/batch_groups"] == 2
        assert {"env/tool_calls", "env/waiting_at_boundary", "env/engine_idle_while_tools"} <= row.keys()
        assert 0.0 <= row["env/engine_idle_while_tools"] <= 1.0
    assert sum(r["env/tool_calls"] for r in result.history) > 0
    assert sum(r["rollout/batch_response_tokens"] for r in result.history) > 0
    saved = os.path.join(tmp_path, "run", "checkpoints", "step_000004", "environment.pkl")
    assert pickle.loads(open(saved, "rb").read())["format"] == "april_ext.trajectories/1"
    with open(os.path.join(tmp_path, "run", "checkpoints", "step_000004", "manifest.json"), encoding="utf-8") as f:
        assert "environment.pkl" in json.load(f)["files"]
    resumed = train(_config(tmp_path, num_steps=7, resume=True))
    assert resumed.resumed_from == 4 and [r["step"] for r in resumed.history] == list(range(1, 8))
    assert all(r["rollout/batch_groups"] == 2 for r in resumed.history)
    assert resumed.summary["tool_calls_per_step"] > 0


@pytest.mark.parametrize(("changes", "message"), [
    ({"max_turns": 1}, r"TrainConfig.max_turns must be >= max_hops \+ 1"),
    ({"lookup_max_hops": 3, "max_tool_calls": 2}, r"TrainConfig.max_tool_calls must be >= max_hops"),
    ({"tool_latency_median_s": 0.5, "tool_latency_p99_s": 0.1}, r"TrainConfig.tool_latency_median_s"),
    ({"tool_timeout_s": 0.0}, r"TrainConfig.tool_timeout_s=0.0 is not allowed"),
    ({"max_concurrent_tool_calls": 0}, r"TrainConfig.max_concurrent_tool_calls=0 is not allowed"),
    ({"eval_interval": 2}, r"TrainConfig.eval_interval=2 is not allowed: 0 with task='lookup'"),
    ({"custom_rm_path": "pkg.mod:fn"}, r"the environment gives each trajectory its final reward"),
])
def test_settings_a_lookup_run_cannot_honour_are_refused_naming_them(tmp_path, changes, message) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, **changes)


def test_the_lookup_task_trains_over_the_sglang_adapter_against_launched_servers(tmp_path, capsys) -> None:
    from _trainer_utils import cli_flags

    from april_ext import cli

    out = tmp_path / "run"
    flags = {**TINY, "num_steps": 3, "output_dir": str(out), "engine": "sglang", "sglang_launch": True,
             "sglang_module": "april_ext.server", "sglang_launch_timeout_s": 120.0,
             "sglang_args": "--num-blocks 256 --max-running-requests 64 --seed 0"}
    assert cli.main(["train", *cli_flags(flags)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/batch_groups"] == 2 for r in rows)
    assert sum(r["env/tool_calls"] for r in rows) > 0 and sum(r["rollout/batch_response_tokens"] for r in rows) > 0
    assert "tool calls/step" in capsys.readouterr().out


def test_a_slime_custom_generate_function_trains_the_lookup_task_from_the_command_line(tmp_path, monkeypatch) -> None:
    from _trainer_utils import cli_flags

    from april_ext import cli

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "examples"))
    out = tmp_path / "run"
    flags = {**TINY, "num_steps": 3, "output_dir": str(out), "engine": "sglang", "sglang_launch": True,
             "sglang_module": "april_ext.server", "sglang_launch_timeout_s": 120.0,
             "sglang_args": "--num-blocks 256 --max-running-requests 64 --seed 0",
             "custom_generate_function_path": "slime_generate_lookup.generate"}
    assert cli.main(["train", *cli_flags(flags)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["rollout/batch_groups"] == 2 for r in rows)
    assert sum(r["rollout/batch_response_tokens"] for r in rows) > 0


def test_a_custom_generate_function_needs_the_sglang_engine(tmp_path) -> None:
    with pytest.raises(ConfigError, match="custom_generate_function_path='m.fn' is not allowed: None with "
                                          "engine='embedded'"):
        _config(tmp_path, custom_generate_function_path="m.fn")


SLOW_TOOL = """import slime_generate_lookup


async def generate(args, sample, sampling_params):
    args.lookup_tool_latency_s = 0.3  # a slow tool: samples finish while their group does not
    return await slime_generate_lookup.generate(args, sample, sampling_params)
"""


def _function_rewards(checkpoint: str) -> dict[int, float]:
    with open(os.path.join(checkpoint, "environment.pkl"), "rb") as handle:
        return pickle.loads(handle.read())["rewards"]


@pytest.mark.slow
def test_a_custom_generate_run_with_a_slow_tool_resumes_after_sigkill_and_after_a_stop(tmp_path, monkeypatch) -> None:
    """`april-ext train --custom-generate-function-path` with a 0.3 s tool, SIGKILLed once a checkpoint holds
    rewards the function gave to samples whose group was not complete, resumes from it (those rewards were lost
    before, and the resume exited 2); then a plain stop and --resume. Every step trains its N groups."""
    import signal
    import subprocess
    import sys
    import time

    from _trainer_utils import cli_flags

    from april_ext import cli
    from april_ext.training.checkpoint import CheckpointManager

    examples = os.path.join(os.path.dirname(__file__), "..", "examples")
    (tmp_path / "slow_lookup.py").write_text(SLOW_TOOL)
    monkeypatch.syspath_prepend(examples)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    flags = {**TINY, "output_dir": str(out), "engine": "sglang", "sglang_launch": True,
             "sglang_module": "april_ext.server", "sglang_launch_timeout_s": 120.0,
             "sglang_args": "--num-blocks 256 --max-running-requests 64 --seed 0",
             "custom_generate_function_path": "slow_lookup.generate", "save_interval": 1, "keep_checkpoints": 3,
             "num_threads": 1}
    pythonpath = os.pathsep.join([examples, str(tmp_path), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-m", "april_ext.cli", "train", *cli_flags({**flags, "num_steps": 60})],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": pythonpath})
    manager = CheckpointManager(str(out / "checkpoints"))
    deadline, killed_at = time.monotonic() + 180, None
    try:
        while killed_at is None:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "no checkpoint held a function's reward within 180 s"
            latest = manager.latest()
            try:
                if latest is not None and _function_rewards(latest.path):
                    os.kill(proc.pid, signal.SIGKILL)  # its servers end with it (april_ext.sglang.parent_watch)
                    killed_at = latest.step
            except FileNotFoundError:
                pass  # pruned meanwhile
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    latest = manager.latest()
    assert latest is not None and latest.step >= killed_at and latest.step < 60
    resumed_steps = latest.step + 2
    assert cli.main(["train", *cli_flags({**flags, "num_steps": resumed_steps, "resume": True})]) == 0
    assert cli.main(["train", *cli_flags({**flags, "num_steps": resumed_steps + 2, "resume": True})]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, resumed_steps + 3))
    assert all(r["rollout/batch_groups"] == 2 for r in rows)


@pytest.mark.parametrize(("changes", "message"), [
    ({"step_boundary": "carry"}, r"step_boundary='carry' \(allowed: 'abort': .* must return at the step's end"),
    ({"strategy": "april_carry"}, r"step_boundary='carry' \(allowed: 'abort'"),
    ({"chunk_tokens": 4}, r"chunk_tokens=4 \(allowed: None: .* max_new_tokens itself"),
    ({"tail_batching": True, "tail_extra_samples": 1}, r"tail_extra_samples=1 \(allowed: 0: .* all at once"),
])
def test_scheduler_settings_a_custom_generate_function_cannot_run_under_are_refused_saying_why(
        tmp_path, changes, message) -> None:
    with pytest.raises(ConfigError, match=r"TrainConfig.custom_generate_function_path='m.fn': .*" + message):
        _config(tmp_path, engine="sglang", sglang_launch=True, custom_generate_function_path="m.fn", **changes)
