"""Bad input found by fuzzing the configs and the command lines: each is refused with an AprilError naming what
was wrong (a ConfigError for a setting), never a Python exception from deeper down, and the CLI exits 2 with one
line instead of a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from april_ext.data.records import read_records
from april_ext.engine.config import EngineConfig
from april_ext.errors import ConfigError, InvalidArgumentError
from april_ext.sim.lengths import TraceLengths
from april_ext.sim.pipeline import PipelineConfig
from april_ext.sim.runner import SimConfig
from april_ext.trainer.config import TrainerConfig
from april_ext.trainer.megatron.parallel import MegatronParallelConfig
from april_ext.training.config import TrainConfig

HUGE = 2**70
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("build, match", [
    (lambda: TrainConfig(seed=HUGE), r"TrainConfig\.seed=.* an int in \[0, 2\*\*63 - 1\]"),
    (lambda: TrainConfig(num_threads=HUGE), r"TrainConfig\.num_threads=.* \[1, 4096\]"),
    (lambda: TrainConfig(distributed_timeout_minutes=float(HUGE)), r"distributed_timeout_minutes=.* \(0, 1e7\]"),
    (lambda: TrainConfig(distributed_timeout_minutes=float("nan")), r"distributed_timeout_minutes=nan"),
    (lambda: TrainConfig(ray_timeout_s=1e9), r"TrainConfig\.ray_timeout_s=.* at most 6e\+08"),
    (lambda: TrainConfig(weight_sync_timeout_s=1e9), r"TrainConfig\.weight_sync_timeout_s=.* at most 6e\+08"),
    (lambda: EngineConfig(seed=HUGE), r"EngineConfig\.seed must be an integer in \[0, 2\*\*63 - 1\]"),
    (lambda: EngineConfig(seed=True), r"EngineConfig\.seed"),
    (lambda: EngineConfig(device="gpu"), r"EngineConfig\.device must be a torch device string"),
    (lambda: EngineConfig(device=1.5), r"EngineConfig\.device"),
    (lambda: TrainerConfig(device=HUGE), r"TrainerConfig\.device"),
    (lambda: MegatronParallelConfig(timeout_s=float("inf")), r"MegatronParallelConfig\.timeout_s .* \(0, 6e8\]"),
    (lambda: MegatronParallelConfig(timeout_s=1e12), r"MegatronParallelConfig\.timeout_s"),
    (lambda: SimConfig(strategy=[]), r"SimConfig\.strategy=\[\] is not allowed"),
    (lambda: SimConfig(prompt_len=2**40), r"SimConfig\.prompt_len=.* \[1, 2\*\*20\]"),
    (lambda: PipelineConfig(gpu=[]), r"PipelineConfig\.gpu=\[\]"),
    (lambda: PipelineConfig(rollout_batch_size="x"), r"PipelineConfig\.rollout_batch_size='x'"),
    (lambda: PipelineConfig(max_staleness="x"), r"PipelineConfig\.max_staleness='x'"),
])
def test_a_bad_setting_is_a_config_error(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_valid_edges_are_still_accepted():
    assert TrainConfig(seed=2**63 - 1, num_threads=4096).seed == 2**63 - 1
    assert EngineConfig(seed=2**63 - 1, device="cuda:1").device == "cuda:1"  # a name: no device needed to build
    assert MegatronParallelConfig(timeout_s=6e8).timeout_s == 6e8


@pytest.mark.parametrize("name", ["prompts.jsonl", "lengths.jsonl", "lengths.csv", "config.toml"])
def test_a_file_that_is_not_utf8_is_refused_naming_it(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b'{"prompt_id": 1}\n\xff\xfe\x00 not text\n')
    if name == "prompts.jsonl":
        with pytest.raises(InvalidArgumentError, match=f"{path}: not UTF-8 text"):
            list(read_records(path))
    elif name == "config.toml":
        with pytest.raises(ConfigError, match=f"{path}: not valid TOML"):
            TrainConfig.from_toml(path)
    else:
        with pytest.raises(InvalidArgumentError, match=f"{path}: not UTF-8 text"):
            TraceLengths.from_file(path)


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "april_ext.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("argv, message", [
    (["train", "--config", "{tmp}"], "april-ext train: error: config file '{tmp}' cannot be read"),
    (["train", "--num-steps", "1", "--no-plots", "--no-progress", "--output-dir", "{blocked}/out"],
     "april-ext train: error: cannot create directory '{blocked}/out'"),
    (["simulate", "--steps", "2", "--output-dir", "{blocked}/out"],
     "april-ext simulate: error: cannot create directory '{blocked}/out'"),
    (["train", "--seed", str(HUGE), "--num-steps", "1"], "TrainConfig.seed=" + str(HUGE) + " is not allowed"),
    (["serve", "--device", "gpu", "--random-init-config", "{tmp}"], "EngineConfig.device must be"),
])
def test_the_command_line_refuses_bad_input_in_one_line(tmp_path, argv, message):
    blocked = tmp_path / "a_file"
    blocked.write_text("a file where a directory is asked for")
    fill = {"tmp": str(tmp_path), "blocked": str(blocked)}
    proc = _cli(*(a.format(**fill) for a in argv), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message.format(**fill) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_train_config_replace_and_from_dict_refuse_what_is_no_setting():
    with pytest.raises(ConfigError, match=r"TrainConfig\.replace: unknown setting\(s\) \['bogus'\]"):
        TrainConfig().replace(bogus=1)
    with pytest.raises(ConfigError, match="a table of settings is required, got list"):
        TrainConfig.from_dict([1])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="setting names are strings, got 1"):
        TrainConfig.from_dict({1: 2})  # type: ignore[dict-item]
    assert TrainConfig().replace(lr=0.5).lr == 0.5
