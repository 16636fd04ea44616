"""`april-ext train` across ranks (real torchrun processes, gloo on the CPU): two ranks (torch DDP, and
Megatron TP=2) give the metrics and weights of the one-process run at the same seed, also across a
--resume; a rank that fails stops the run with its error; the settings and world checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _torch_threads import one_thread  # noqa: F401 (fixture)
from _trainer_utils import cli_flags

from april_ext import cli
from april_ext.cli.train import config_from_args
from april_ext.errors import ConfigError
from april_ext.model import ModelConfig, iter_safetensors
from april_ext.training import TrainConfig, train
from april_ext.training.ranks import check_world

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT_S = 600
TINY = dict(counting_median=3.0, counting_sigma=0.8, counting_max_count=12, counting_symbols=2, hidden_size=16,
            num_layers=1, rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=4,
            max_num_seqs=64, num_blocks=256, lr=0.003, progress=False, plots=False)
# What depends on the machine's speed: durations, and how many samples were in flight when (asynchronous).
UNTIMED = ("rollout/mean_inflight_samples", "rollout/occupancy", "rollout/tail_share")

pytestmark = pytest.mark.usefixtures("one_thread")


def _launch(nproc: int, settings: dict, *, pythonpath: tuple[Path, ...] = (),
            timeout_s: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """`april-ext train --nproc-per-node N ...` in a subprocess (it starts torchrun itself)."""
    path = os.pathsep.join([*map(str, pythonpath), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, "-m", "april_ext.cli", "train", "--nproc-per-node", str(nproc), *cli_flags(settings)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                          check=False)


def _rows(out: Path) -> list[dict]:
    with open(out / "metrics.jsonl", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _assert_same_rows(have: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in have] == [r["step"] for r in want]
    for a, b in zip(have, want, strict=True):
        assert sorted(a) == sorted(b)
        for name, value in b.items():
            if name.startswith("time/") or name.endswith(("_s", "per_s")) or name in UNTIMED:
                continue
            if isinstance(value, float):
                assert a[name] == pytest.approx(value, rel=1e-4, abs=1e-6), (b["step"], name)
            else:
                assert a[name] == value, (b["step"], name)


def _assert_same_weights(have: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(have) == sorted(want)
    # As tests/test_trainer_ddp.py: Adam's g / sqrt(v) magnifies reduction-order differences of tiny gradients.
    for name, tensor in want.items():
        torch.testing.assert_close(have[name], tensor, rtol=1e-4, atol=5e-5, msg=name)


def _two_ranks_with_a_resume(tmp_path: Path, settings: dict) -> Path:
    """Two ranks train 2 steps, then resume (two ranks) to 3; the rows of both launches are kept."""
    out = tmp_path / "ranks"
    first = _launch(2, {**settings, "num_steps": 2, "output_dir": out})
    assert first.returncode == 0, first.stderr[-4000:]
    assert [r["step"] for r in _rows(out)] == [1, 2]
    second = _launch(2, {**settings, "num_steps": 3, "output_dir": out, "resume": True})
    assert second.returncode == 0, second.stderr[-4000:]
    return out


def _one_process(tmp_path: Path, settings: dict) -> Path:
    out = tmp_path / "one"
    assert cli.main(["train", *cli_flags({**settings, "num_steps": 3, "output_dir": out})]) == 0
    return out


@pytest.mark.slow
def test_torch_ddp_on_two_ranks_equals_one_process_across_a_resume(tmp_path: Path) -> None:
    settings = {**TINY, "trainer": "torch"}
    ranks, one = _two_ranks_with_a_resume(tmp_path, settings), _one_process(tmp_path, settings)
    _assert_same_rows(_rows(ranks), _rows(one))
    step = "checkpoints/step_000003/trainer"
    _assert_same_weights(dict(iter_safetensors(ranks / step)), dict(iter_safetensors(one / step)))


def _megatron_weights(tmp_path: Path, settings: dict, checkpoint: Path, model_dir: Path,
                      **parallel_settings: object) -> dict[str, torch.Tensor]:
    """The sharded checkpoint of ranks, loaded in this process (a world of one: tensor parallel 1) with
    ``parallel_settings`` and exported in HF names."""
    from april_ext.trainer.megatron import (
        DistributedMegatronTrainer,
        MegatronParallelConfig,
        MegatronTrainerConfig,
        parallel,
    )
    from april_ext.training.trainers import trainer_config

    config = TrainConfig(**{**settings, "output_dir": str(tmp_path / "unused")})
    trainer = DistributedMegatronTrainer(MegatronTrainerConfig(
        model=ModelConfig.from_pretrained(model_dir), trainer=trainer_config(config), seed=config.seed,
        parallel=MegatronParallelConfig(**parallel_settings)))
    try:
        trainer.load_checkpoint(checkpoint)
        return dict(trainer.export_weights(to_cpu=True))
    finally:
        parallel.shutdown()


@pytest.mark.slow
def test_megatron_tp2_on_two_ranks_equals_one_process_across_a_resume(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'april_ext[megatron]')")
    settings = {**TINY, "trainer": "megatron", "tensor_model_parallel_size": 2}
    ranks = _two_ranks_with_a_resume(tmp_path, settings)
    # The one-process run: MegatronTrainer (tensor parallel 1 is the only layout of a world of one).
    single = {**settings, "tensor_model_parallel_size": 1}
    one = _one_process(tmp_path, single)
    _assert_same_rows(_rows(ranks), _rows(one))
    step = "checkpoints/step_000003/trainer"
    gathered = _megatron_weights(tmp_path, single, ranks / step, one / step)
    _assert_same_weights(gathered, dict(iter_safetensors(one / step)))


@pytest.mark.slow
def test_megatron_distributed_optimizer_on_two_ranks_equals_one_process_across_a_resume(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'april_ext[megatron]')")
    # DP=2: each rank holds half of Adam's state and of the fp32 main parameters, saved and resumed sharded.
    settings = {**TINY, "trainer": "megatron", "use_distributed_optimizer": True}
    ranks = _two_ranks_with_a_resume(tmp_path, settings)
    # The one-process run: MegatronTrainer with its whole optimizer (a world of one has nothing to shard).
    single = {**settings, "use_distributed_optimizer": False}
    one = _one_process(tmp_path, single)
    _assert_same_rows(_rows(ranks), _rows(one))
    step = "checkpoints/step_000003/trainer"
    # Loaded with the distributed optimizer (resharded from DP=2 to 1): a checkpoint of the plain optimizer
    # would not load this way, so this also shows the ranks ran the distributed one.
    gathered = _megatron_weights(tmp_path, single, ranks / step, one / step, use_distributed_optimizer=True)
    _assert_same_weights(gathered, dict(iter_safetensors(one / step)))


def _model_recording_module(tmp_path: Path) -> Path:
    """A sitecustomize that makes every rank append to OUT/rank<R>.jsonl (OUT: $APRIL_TEST_MODELS_OUT) one
    line per whole april_ext model it builds (LlamaForCausalLM: its april_ext callers) and per load of
    weights into one (whether they equal the checkpoint $APRIL_TEST_CHECKPOINT bit for bit)."""
    folder = tmp_path / "record_models"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') is not None and os.environ.get('APRIL_TEST_MODELS_OUT'):\n"
        "    import json, traceback\n"
        "    import torch\n"
        "    from april_ext.model import iter_safetensors, llama\n"
        "    def _record(**line):\n"
        "        path = os.path.join(os.environ['APRIL_TEST_MODELS_OUT'], f\"rank{os.environ['RANK']}.jsonl\")\n"
        "        with open(path, 'a') as handle:\n"
        "            handle.write(json.dumps(line) + '\\n')\n"
        "    _init, _load = llama.LlamaForCausalLM.__init__, llama.LlamaForCausalLM.load_weights\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        _init(self, *args, **kwargs)\n"
        "        _record(event='built', callers=[f.name for f in traceback.extract_stack()[:-1]\n"
        "                                        if 'april_ext' in f.filename])\n"
        "    def load_weights(self, *args, **kwargs):\n"
        "        names = _load(self, *args, **kwargs)\n"
        "        params = dict(self.named_parameters())\n"
        "        saved = dict(iter_safetensors(os.environ['APRIL_TEST_CHECKPOINT']))\n"
        "        _record(event='loaded', equals_checkpoint=saved.keys() == params.keys() and all(\n"
        "            torch.equal(params[n], t) for n, t in saved.items()))\n"
        "        return names\n"
        "    llama.LlamaForCausalLM.__init__ = __init__\n"
        "    llama.LlamaForCausalLM.load_weights = load_weights\n")
    return folder


@pytest.mark.slow
def test_megatron_ranks_read_their_slice_of_the_checkpoint_without_building_the_whole_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--trainer megatron --model DIR` on two ranks (TP=2): no rank builds the whole model from the
    checkpoint (before: each rank's make_model ran load_pretrained, and the trainer took its slice of that);
    the one whole model of the run is the embedded engine's on rank 0, filled from the trainer's first
    export, which equals the checkpoint: the ranks loaded their slices of it."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'april_ext[megatron]')")
    from april_ext.model import LlamaForCausalLM, save_pretrained
    from april_ext.tasks import CountingTask, CountingTaskConfig

    task = CountingTask(CountingTaskConfig(n_symbols=TINY["counting_symbols"], max_count=TINY["counting_max_count"],
                                           median_count=TINY["counting_median"], sigma=TINY["counting_sigma"]))
    model = LlamaForCausalLM(task.model_config(hidden_size=32, intermediate_size=96))
    model.init_weights(7)
    checkpoint = tmp_path / "hf"
    save_pretrained(model, checkpoint)
    records = tmp_path / "records"
    records.mkdir()
    monkeypatch.setenv("APRIL_TEST_MODELS_OUT", str(records))
    monkeypatch.setenv("APRIL_TEST_CHECKPOINT", str(checkpoint))
    proc = _launch(2, {**TINY, "trainer": "megatron", "tensor_model_parallel_size": 2, "model": checkpoint,
                       "num_steps": 1, "output_dir": tmp_path / "run"},
                   pythonpath=(_model_recording_module(tmp_path),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in _rows(tmp_path / "run")] == [1]
    seen = {rank: [json.loads(line) for line in (records / f"rank{rank}.jsonl").read_text().splitlines()]
            if (records / f"rank{rank}.jsonl").exists() else [] for rank in range(2)}
    assert seen[1] == [], seen[1]
    built = [line for line in seen[0] if line["event"] == "built"]
    assert len(built) == 1 and "_engine_model" in built[0]["callers"], seen[0]
    assert "load_pretrained" not in built[0]["callers"]
    # The engine's first weights (version 0) are the trainer's export right after the sharded load.
    assert seen[0][1] == {"event": "loaded", "equals_checkpoint": True}, seen[0]


def _failing_rank_module(tmp_path: Path) -> Path:
    """A sitecustomize that makes rank 1's trainer raise in its first step (the other processes are
    untouched)."""
    folder = tmp_path / "fail_rank1"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    from april_ext.trainer import TorchTrainer\n"
        "    def train_step(self, batch):\n"
        "        raise RuntimeError('rank 1 failed on purpose')\n"
        "    TorchTrainer.train_step = train_step\n")
    return folder


@pytest.mark.slow
def test_a_failing_follower_stops_the_run_with_its_error(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = _launch(2, {**TINY, "num_steps": 2, "output_dir": tmp_path / "run"},
                   pythonpath=(_failing_rank_module(tmp_path),))
    assert proc.returncode != 0
    assert "rank 1 failed on purpose" in proc.stderr
    assert "the run failed on rank 1" in proc.stderr
    assert time.monotonic() - start < LAUNCH_TIMEOUT_S / 4


@pytest.mark.slow
def test_rank_0_failing_stops_the_followers_with_its_error(tmp_path: Path) -> None:
    (tmp_path / "bad_reward.py").write_text("def reward(prompt, response_ids):\n"
                                            "    raise RuntimeError('the reward failed on purpose')\n")
    start = time.monotonic()
    proc = _launch(2, {**TINY, "num_steps": 2, "output_dir": tmp_path / "run", "custom_rm_path": "bad_reward:reward"},
                   pythonpath=(tmp_path,))
    assert proc.returncode != 0
    # Rank 1 says why it stopped: rank 0's error.
    assert "(rank 1): error: rank 0 stopped the run:" in proc.stderr
    assert "the reward failed on purpose" in proc.stderr
    assert time.monotonic() - start < LAUNCH_TIMEOUT_S / 4


@pytest.mark.slow
def test_the_followers_wait_longer_than_the_timeout_while_rank_0_generates(tmp_path: Path) -> None:
    # A rollout's rewards take seconds, the timeout is 1.8 s: rank 0's keep-alive keeps the followers waiting.
    (tmp_path / "slow_reward.py").write_text("import time\n"
                                             "def reward(prompt, response_ids):\n"
                                             "    time.sleep(0.5)\n"
                                             "    return 0.0\n")
    proc = _launch(2, {**TINY, "num_steps": 2, "output_dir": tmp_path / "run", "custom_rm_path": "slow_reward:reward",
                       "distributed_timeout_minutes": 0.03}, pythonpath=(tmp_path,))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    # The first rollout waits for its rewards (the second takes surplus groups rewarded meanwhile).
    assert rows[0]["rollout/wall_s"] > 1.8


def test_parallel_settings_are_flags_validated_by_megatron_parallel_config() -> None:
    args = cli.build_parser().parse_args([
        "train", "--trainer", "megatron", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
        "2", "--sequence-parallel", "--expert-model-parallel-size", "1", "--distributed-timeout-minutes", "2.5"])
    config = config_from_args(args)
    split = config.parallel_config()
    assert (split.tensor_model_parallel_size, split.pipeline_model_parallel_size, split.sequence_parallel,
            split.timeout_s) == (2, 2, True, 150.0)
    assert check_world(config, 8) == 2
    with pytest.raises(ConfigError, match=r"the run has 6 rank\(s\), not a multiple of .* = 2 x 2 x 1"):
        check_world(config, 6)
    with pytest.raises(ConfigError, match="MegatronParallelConfig.context_parallel_size must be 1"):
        TrainConfig(trainer="megatron", context_parallel_size=2)
    with pytest.raises(ConfigError, match="sequence_parallel needs tensor_model_parallel_size > 1"):
        TrainConfig(trainer="megatron", sequence_parallel=True)
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=2 is not allowed: 1 with trainer='torch'"):
        TrainConfig(tensor_model_parallel_size=2)
    with pytest.raises(ConfigError, match="use_distributed_optimizer=True is not allowed: False with trainer='torch'"):
        TrainConfig(use_distributed_optimizer=True)
    assert config_from_args(cli.build_parser().parse_args(
        ["train", "--trainer", "megatron", "--use-distributed-optimizer"])).parallel_config().use_distributed_optimizer
    offload = config_from_args(cli.build_parser().parse_args(
        ["train", "--trainer", "megatron", "--use-distributed-optimizer", "--optimizer-cpu-offload",
         "--optimizer-offload-fraction", "0.25"])).parallel_config()
    assert (offload.optimizer_cpu_offload, offload.optimizer_offload_fraction) == (True, 0.25)
    with pytest.raises(ConfigError, match="optimizer_cpu_offload=True needs use_distributed_optimizer=True"):
        TrainConfig(trainer="megatron", optimizer_cpu_offload=True)
    with pytest.raises(ConfigError, match="is not allowed: False with trainer='torch'"):
        TrainConfig(use_distributed_optimizer=True, optimizer_cpu_offload=True)
    assert check_world(TrainConfig(), 3) == 3  # the torch trainer: data parallel over any world
    small = TrainConfig(rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=2)
    with pytest.raises(ConfigError, match="optimizer step of 2 samples .* cannot be split across 3"):
        check_world(small, 3)


def test_a_split_model_in_one_process_says_how_to_launch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = TrainConfig(**{**TINY, "trainer": "megatron", "tensor_model_parallel_size": 2,
                            "output_dir": str(tmp_path / "run")})
    with pytest.raises(ConfigError, match="launch it with --nproc-per-node or torchrun"):
        train(config)
    assert cli.main(["train", "--compare", "--nproc-per-node", "2", "--output-dir", str(tmp_path / "c")]) == 2
    assert "--compare runs in one process" in capsys.readouterr().err
    assert cli.main(["train", "--trainer", "megatron", "--tensor-model-parallel-size", "2", "--nproc-per-node",
                     "3", "--output-dir", str(tmp_path / "c")]) == 2
    assert "the run has 3 rank(s), not a multiple" in capsys.readouterr().err
    assert cli.main(["train", "--nproc-per-node", "0", "--output-dir", str(tmp_path / "c")]) == 2
    assert "--nproc-per-node 0 is not allowed" in capsys.readouterr().err
    assert cli.main(["train", "--trainer", "megatron", "--use-distributed-optimizer", "--output-dir",
                     str(tmp_path / "c")]) == 2
    assert "use_distributed_optimizer=True needs a run across ranks" in capsys.readouterr().err
    # One rank is this process: a run of its own, no launch.
    assert cli.main(["train", *cli_flags({**TINY, "num_steps": 1, "output_dir": tmp_path / "one"}), "--nproc-per-node",
                     "1"]) == 0
    assert [r["step"] for r in _rows(tmp_path / "one")] == [1]
