"""The april-ext command line: subcommand registry, flags named after the config fields, config-file
precedence, error reporting and ``train --compare``."""

from __future__ import annotations

import json

import pytest

from april_ext import cli
from april_ext.cli.train import config_from_args

from _torch_threads import one_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_train_is_registered_and_help_lists_rl_flags(capsys):
    assert "april_ext.cli.train" in cli.COMMANDS
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--rollout-batch-size", "--n-samples-per-prompt", "--over-sampling-batch-size",
                 "--partial-rollout", "--no-partial-rollout", "--max-response-len", "--num-steps", "--lr",
                 "--seed", "--save", "--save-interval", "--resume", "--colocate", "--output-dir", "--compare"):
        assert flag in out
    assert "N: groups (prompts) per training step" in out  # help texts come from the config's field docs


def test_flags_override_the_config_file_which_overrides_defaults(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('rollout_batch_size = 4\nlr = 0.01\nover_sampling_batch_size = "none"\nmax_response_len = 9\n')
    parser = cli.build_parser()
    args = parser.parse_args(["train", "--config", str(path), "--lr", "0.5", "--no-partial-rollout",
                              "--max-response-len", "none"])
    cfg = config_from_args(args)
    assert cfg.rollout_batch_size == 4 and cfg.lr == 0.5 and cfg.partial_rollout is False
    assert cfg.over_sampling_batch_size is None and cfg.max_response_len is None
    assert cfg.n_samples_per_prompt == 8  # default
    data = config_from_args(parser.parse_args(["train", "--data", "x.jsonl", "--tokenizer", "t", "--model", "m"]))
    assert data.task is None and data.data == "x.jsonl"


def test_errors_are_reported_with_exit_code_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--rollout-batch-size", "many"])
    assert exc.value.code == 2
    assert "'many' is not a valid int" in capsys.readouterr().err
    assert cli.main(["train", "--rollout-batch-size", "0"]) == 2
    assert "SchedulerConfig.rollout_batch_size=0 is not allowed" in capsys.readouterr().err


def test_compare_runs_the_baseline_april_and_asynchronous_april_and_times_each_whole_run(tmp_path, capsys):
    path = tmp_path / "tiny.toml"
    path.write_text("\n".join([
        "counting_median = 3.0", "counting_max_count = 12", "counting_symbols = 2", "hidden_size = 16",
        "num_layers = 1", "rollout_batch_size = 2", "n_samples_per_prompt = 4", "num_steps = 2",
        "max_num_seqs = 64", "num_blocks = 256", "progress = false", f'output_dir = "{tmp_path / "cmp"}"']))
    assert cli.main(["train", "--config", str(path), "--compare"]) == 0
    out = capsys.readouterr().out
    assert "baseline" in out and "april" in out and "rollout tokens/s" in out
    assert "APRIL rollout throughput vs baseline:" in out
    assert "tokens / engine step" in out and "engine bubble" in out
    assert "APRIL tokens per engine step vs baseline:" in out
    for label in ("wall-clock (s)", "vs baseline", "to baseline's reward (s)", "reward, equal steps",
                  "reward, equal time"):
        assert label in out
    figures = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert list(figures) == ["baseline", "april", "april_async"]
    assert figures["baseline"]["wall_clock_ratio"] == 1.0
    assert all(f["wall_clock_s"] > f["steps_s"] > 0 for f in figures.values())
    for f in figures.values():
        assert {"reward_at_equal_steps", "time_to_reference_reward_s", "reward_at_equal_time",
                "rollout_tokens_per_s", "tokens_per_engine_step", "bubble"} <= set(f)
        assert f["rollout_tokens_per_s"] > 0 and 0 < f["tokens_per_engine_step"] <= 64
    for name in ("baseline", "april", "april_async"):
        assert (tmp_path / "cmp" / name / "metrics.jsonl").is_file()
        assert (tmp_path / "cmp" / name / "checkpoints" / "step_000002").is_dir()
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 0
