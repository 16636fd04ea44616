"""SchedulerConfig is the one definition of the scheduler's settings: every field is a TrainConfig field, a
TOML key and an ``april-ext train`` flag that reaches the Scheduler, a SimConfig field and an ``april-ext
simulate`` flag (but the ones each mode sets), with SchedulerConfig's type, default, docs and messages."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, fields

import pytest

from april_ext import cli
from april_ext.cli import simulate as sim_command
from april_ext.cli.train import config_from_args
from april_ext.errors import ConfigError, InvalidArgumentError
from april_ext.scheduler import SchedulerConfig
from april_ext.settings import adopt, settings
from april_ext.sim.runner import MODE_SETTINGS, SimConfig
from april_ext.training import TrainConfig, TrainingRun

from _torch_threads import one_thread  # noqa: F401 (fixture)

SCHEDULER_FIELDS = {f.name for f in fields(SchedulerConfig)}
ROOT = os.path.join(os.path.dirname(__file__), os.pardir)

# A valid value other than the default for every SchedulerConfig field (a tiny counting run can use them).
VALUES = dict(rollout_batch_size=3, n_samples_per_prompt=2, over_sampling_batch_size=5, max_response_len=20,
              refill="continuous", max_staleness=2, staleness_policy="mask", mask_offpolicy=True,
              resume_order="longest_first", keep_surplus=False, max_inflight_samples=6, over_sampling="adaptive",
              target_inflight_samples=4, step_boundary="carry", dispatch_order="shortest_first", resume_priority=False,
              chunk_tokens=7, tail_batching=True, tail_batching_restart=True, tail_extra_samples=1)
# A value that SchedulerConfig refuses, for every field (with what it needs to be checked).
BAD = dict(rollout_batch_size=dict(rollout_batch_size=0), n_samples_per_prompt=dict(n_samples_per_prompt="8"),
           over_sampling_batch_size=dict(over_sampling_batch_size=4), max_response_len=dict(max_response_len=0),
           refill=dict(refill="waves"), max_staleness=dict(max_staleness=-1),
           staleness_policy=dict(staleness_policy="ignore"), mask_offpolicy=dict(mask_offpolicy=1),
           resume_order=dict(resume_order="random"), keep_surplus=dict(keep_surplus="yes"),
           max_inflight_samples=dict(max_inflight_samples=3), over_sampling=dict(over_sampling="dynamic"),
           target_inflight_samples=dict(over_sampling="adaptive", target_inflight_samples=3),
           step_boundary=dict(step_boundary="keep"), dispatch_order=dict(dispatch_order="random"),
           resume_priority=dict(resume_priority=0), chunk_tokens=dict(chunk_tokens=0),
           tail_batching=dict(tail_batching="on"), tail_batching_restart=dict(tail_batching_restart=True),
           tail_extra_samples=dict(tail_extra_samples=1))
TINY = dict(counting_median=3.0, counting_sigma=0.8, counting_max_count=12, counting_symbols=2, hidden_size=16,
            num_layers=1, max_num_seqs=64, num_blocks=256, progress=False, plots=False)


def test_the_tables_cover_every_scheduler_field():
    # A new SchedulerConfig field needs a value in VALUES and BAD, so that the tests below check it.
    assert set(VALUES) == SCHEDULER_FIELDS and set(BAD) == SCHEDULER_FIELDS
    defaults = SchedulerConfig.__dataclass_fields__
    assert all(VALUES[name] != defaults[name].default for name in VALUES)
    assert SchedulerConfig(**VALUES).target_inflight_samples == 4


def test_train_settings_are_scheduler_config_fields():
    train, sched = settings(TrainConfig), settings(SchedulerConfig)
    for name in SCHEDULER_FIELDS:
        assert (train[name].kind, train[name].choices) == (sched[name].kind, sched[name].choices), name
        if name == "max_response_len":  # None: the task's cap
            assert train[name].optional and train[name].default is None
            continue
        assert train[name].optional == sched[name].optional and train[name].doc == sched[name].doc, name
        # The one default a run sets differently.
        assert train[name].default == (8 if name == "rollout_batch_size" else sched[name].default), name


def _toml(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else repr(value).replace("'", '"')


def _flags(values: dict) -> list[str]:
    out = []
    for name, value in values.items():
        flag = settings(SchedulerConfig)[name].flag
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


@pytest.mark.usefixtures("one_thread")
def test_every_scheduler_field_is_a_toml_key_and_a_flag_and_reaches_the_scheduler(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("".join(f"{name} = {_toml(value)}\n" for name, value in VALUES.items()))
    from_toml = TrainConfig.from_toml(path)
    from_flags = config_from_args(cli.build_parser().parse_args(["train", *_flags(VALUES)]))
    for name, value in VALUES.items():
        assert getattr(from_toml, name) == value and getattr(from_flags, name) == value, name

    async def scheduler_config(config: TrainConfig) -> SchedulerConfig:
        async with TrainingRun(config) as run:
            return run.scheduler.config

    config = from_flags.replace(**TINY, output_dir=str(tmp_path / "run"))
    assert asyncio.run(scheduler_config(config)) == SchedulerConfig(**VALUES)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_scheduler_value_gives_scheduler_config_message_everywhere(name):
    changes = {"rollout_batch_size": 8, **BAD[name]}
    with pytest.raises(ConfigError, match=rf"^SchedulerConfig\.{name}=") as expected:
        SchedulerConfig(**changes)
    with pytest.raises(ConfigError) as through_train:
        TrainConfig(**changes)
    assert str(through_train.value) == str(expected.value)
    if name not in MODE_SETTINGS:
        with pytest.raises(ConfigError) as through_sim:
            SimConfig(**{k: v for k, v in changes.items() if k not in MODE_SETTINGS})
        assert str(through_sim.value) == str(expected.value)


def test_a_bad_scheduler_flag_is_reported_with_scheduler_config_message(capsys):
    assert cli.main(["train", "--resume-order", "random"]) == 2
    assert "error: SchedulerConfig.resume_order='random' is not allowed: one of" in capsys.readouterr().err
    assert cli.main(["simulate", "--n-samples-per-prompt", "4", "--max-inflight-samples", "2"]) == 2
    assert "error: SchedulerConfig.max_inflight_samples=2 is not allowed" in capsys.readouterr().err


def test_every_scheduler_field_but_the_modes_is_a_simulate_setting_and_reaches_the_scheduler():
    sim, sched = settings(SimConfig), settings(SchedulerConfig)
    assert set(MODE_SETTINGS) < SCHEDULER_FIELDS
    adopted = SCHEDULER_FIELDS - set(MODE_SETTINGS)
    assert set(sim_command.SCHEDULER_FLAGS) == adopted
    for name in adopted:
        assert (sim[name].kind, sim[name].optional, sim[name].choices, sim[name].default) == (
            sched[name].kind, sched[name].optional, sched[name].choices, sched[name].default), name
    given = {name: VALUES[name] for name in adopted}
    config = sim_command.config_from_args(cli.build_parser().parse_args(["simulate", *_flags(given)]))
    assert {name: getattr(config, name) for name in adopted} == given
    # april-adaptive is continuous refill with adaptive over-sampling: VALUES' mode settings.
    assert SimConfig(**given, mode="april-adaptive").scheduler_config() == SchedulerConfig(**VALUES)
    assert SimConfig().over_sampling_batch_size == SchedulerConfig().over_sampling_batch_size  # N' = 2N


def _section(path: str, heading: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        text = handle.read()
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def test_the_docs_list_every_setting():
    readme = _section("README.md", "### `SchedulerConfig`")
    assert all(f"`{name}`" in readme for name in SCHEDULER_FIELDS)
    train_table = _section("README.md", "### `april-ext train`")
    assert all(f"`{name}`" in train_table for name in SCHEDULER_FIELDS)
    loop = _section("docs/loop.md", "## `april-ext` command line")
    assert [f.name for f in fields(TrainConfig) if f"`{f.name}`" not in loop] == []
    sim = _section("docs/sim.md", "# Rollout simulator")
    assert [name for name in sim_command.SCHEDULER_FLAGS if settings(SimConfig)[name].flag not in sim] == []


def test_adopt_copies_fields_and_names_unknown_ones():
    @dataclass(frozen=True)
    @adopt(SchedulerConfig, exclude=("refill",), defaults={"n_samples_per_prompt": 2}, docs={"keep_surplus": "K."})
    class Mini:
        max_response_len: int | None = None
        """Own."""

    mini = settings(Mini)
    assert set(mini) == SCHEDULER_FIELDS - {"refill"}
    assert mini["max_response_len"].optional and mini["max_response_len"].doc == "Own."
    assert mini["n_samples_per_prompt"].default == 2 and mini["keep_surplus"].doc == "K."
    assert mini["resume_order"].choices == ("oldest_first", "newest_first", "longest_first")
    assert Mini().rollout_batch_size == 32
    with pytest.raises(InvalidArgumentError, match=r"\['refil'\] are not fields of SchedulerConfig"):
        adopt(SchedulerConfig, exclude=("refil",))
