"""Parallel layouts the model or the world cannot take are refused by `april-ext train` itself, before torchrun
launches a rank or a model is built, with ConfigError naming the flag, its value, the model's numbers and
what is allowed (formerly megatron-core's own ValueError / AssertionError on every rank, mid-build). The
counting task's tiny model has 4 attention heads, 2 KV heads and 2 layers (--num-layers) and is dense."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed
import torch.distributed.run
from _refused import forbidden, refused

from april_ext import cli
from april_ext.cli.train import check_before_start
from april_ext.errors import ConfigError
from april_ext.tasks import CountingTask, CountingTaskConfig
from april_ext.trainer.megatron import parallel
from april_ext.trainer.megatron.distributed_trainer import DistributedMegatronTrainer
from april_ext.trainer.megatron.parallel import MegatronParallelConfig
from april_ext.trainer.megatron.trainer import MegatronTrainerConfig
from april_ext.training.config import TrainConfig

MEGATRON = ["--trainer", "megatron"]


def moe_model_dir(tmp_path: Path) -> str:
    """A Qwen3-MoE config.json (4 experts; layer 1 dense) for the counting vocabulary, no weights: the
    refusals read the architecture only."""
    config = CountingTask(CountingTaskConfig()).model_config(
        hidden_size=32, intermediate_size=64, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, mlp_only_layers=(1,))
    config.save_pretrained(tmp_path / "moe")
    return str(tmp_path / "moe")


@pytest.mark.parametrize("tp", [3, 4])
def test_a_tensor_parallel_size_not_dividing_the_heads_or_kv_heads_is_refused_before_launch(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tp: int) -> None:
    # TP=3 divides neither; TP=4 divides the 4 heads but not the 2 KV heads (megatron-core would replicate
    # them, which the sharded weight loading does not do).
    err = refused(monkeypatch, tmp_path, *MEGATRON, "--tensor-model-parallel-size", str(tp), "--nproc-per-node",
                  str(tp))
    assert isinstance(err, ConfigError)
    message = str(err)
    assert f"--tensor-model-parallel-size {tp} must divide" in message
    assert "4 attention heads (num_attention_heads), 2 KV heads (num_key_value_heads)" in message
    assert message.endswith("allowed: 1 or 2")


@pytest.mark.parametrize(("pp", "layers", "wording", "allowed"), [
    (4, 2, "is more than the model's 2 layers", "1 or 2"),
    (3, 4, "does not divide the model's 4 layers", "1, 2 or 4")])
def test_a_pipeline_size_above_or_not_dividing_the_layers_is_refused_before_launch(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pp: int, layers: int, wording: str, allowed: str) -> None:
    err = refused(monkeypatch, tmp_path, *MEGATRON, "--pipeline-model-parallel-size", str(pp), "--num-layers",
                  str(layers), "--nproc-per-node", str(pp))
    assert isinstance(err, ConfigError)
    assert f"--pipeline-model-parallel-size {pp} {wording} (num_hidden_layers)" in str(err)
    assert str(err).endswith(f"allowed: {allowed}")


def test_expert_parallelism_on_a_dense_model_is_refused_before_launch(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    err = refused(monkeypatch, tmp_path, *MEGATRON, "--expert-model-parallel-size", "2", "--nproc-per-node", "2")
    assert isinstance(err, ConfigError)
    assert "--expert-model-parallel-size 2 needs a mixture-of-experts model" in str(err)
    assert "is dense: num_experts is 0; allowed: 1" in str(err)


def test_an_expert_parallel_size_not_dividing_the_experts_is_refused_before_launch(monkeypatch: pytest.MonkeyPatch,
                                                                                   tmp_path: Path) -> None:
    err = refused(monkeypatch, tmp_path, *MEGATRON, "--model", moe_model_dir(tmp_path), "--expert-model-parallel-size",
                  "3", "--nproc-per-node", "3")
    assert isinstance(err, ConfigError)
    assert "--expert-model-parallel-size 3 does not divide the model's 4 experts (num_experts)" in str(err)
    assert str(err).endswith("allowed: 1, 2 or 4")


def test_a_moe_model_split_by_tensor_parallelism_without_sequence_parallel_is_refused_before_launch(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    err = refused(monkeypatch, tmp_path, *MEGATRON, "--model", moe_model_dir(tmp_path), "--tensor-model-parallel-size",
                  "2", "--nproc-per-node", "2")
    assert isinstance(err, ConfigError)
    assert "--tensor-model-parallel-size 2 without --sequence-parallel, 4 experts" in str(err)


def test_a_world_that_tp_x_pp_does_not_divide_is_refused_before_launch(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    # Data parallel is derived (the world / TP x PP x CP): the world must be a multiple of TP x PP x CP.
    err = refused(monkeypatch, tmp_path, *MEGATRON, "--tensor-model-parallel-size", "2", "--nproc-per-node", "3")
    assert isinstance(err, ConfigError)
    assert "the run has 3 rank(s), not a multiple of tensor x pipeline x context parallel = 2 x 1 x 1 = 2" in str(err)
    assert "--tensor-model-parallel-size 2" in str(err) and "--nproc-per-node" in str(err)
    # Under torchrun (its environment): every rank refuses before the run starts.
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    err = refused(monkeypatch, tmp_path, *MEGATRON, "--tensor-model-parallel-size", "2")
    assert "the run has 3 rank(s), not a multiple of" in str(err)


def test_an_expert_parallel_size_not_dividing_the_data_parallel_size_is_refused_before_launch(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    err = refused(monkeypatch, tmp_path, *MEGATRON, "--model", moe_model_dir(tmp_path), "--expert-model-parallel-size",
                  "4", "--nproc-per-node", "2")
    assert isinstance(err, ConfigError)
    assert "--expert-model-parallel-size 4 must divide the data x context parallel size 2" in str(err)
    assert str(err).endswith("allowed: 1 or 2")


def test_sequence_parallel_without_tensor_parallelism_is_refused_before_launch(monkeypatch: pytest.MonkeyPatch,
                                                                               tmp_path: Path) -> None:
    err = refused(monkeypatch, tmp_path, *MEGATRON, "--sequence-parallel", "--nproc-per-node", "2")
    assert isinstance(err, ConfigError)
    assert "--sequence-parallel splits the tokens over the tensor-parallel ranks" in str(err)
    assert "--tensor-model-parallel-size is 1" in str(err)


def test_the_command_line_reports_the_refusal_and_exits_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.distributed.run, "run", forbidden("torchrun launched ranks"))
    assert cli.main(["train", *MEGATRON, "--pipeline-model-parallel-size", "4", "--nproc-per-node", "4",
                     "--output-dir", str(tmp_path / "run")]) == 2
    assert ("april-ext train: error: --pipeline-model-parallel-size 4 is more than the model's 2 layers"
            in capsys.readouterr().err)


def test_the_distributed_trainer_refuses_the_layout_before_it_joins_a_process_group() -> None:
    model = CountingTask(CountingTaskConfig()).model_config(hidden_size=32, intermediate_size=64)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 4 is more than the model's 2 layers"):
        DistributedMegatronTrainer(MegatronTrainerConfig(
            model=model, parallel=MegatronParallelConfig(pipeline_model_parallel_size=4)))
    assert not torch.distributed.is_initialized()
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size 4 must divide"):
        parallel.validate_layout(MegatronParallelConfig(tensor_model_parallel_size=4), model)


def ray_config(tp: int, gpus: int) -> TrainConfig:
    """A Megatron run on Ray whose trainer has ``gpus`` actor ranks (on one node), split by TP=``tp``."""
    return TrainConfig.from_dict({"trainer": "megatron", "ray": True, "actor_num_gpus_per_node": gpus,
                                  "tensor_model_parallel_size": tp}, where="test")


def test_a_ray_run_is_checked_against_its_actor_ranks_not_the_launch() -> None:
    # The driver is one process; the trainer's world is actor_num_nodes x actor_num_gpus_per_node.
    check_before_start(ray_config(tp=2, gpus=2), 1)


@pytest.mark.parametrize(("tp", "gpus", "wording"), [
    (2, 1, "the run has 1 rank(s), not a multiple of tensor x pipeline x context parallel = 2 x 1 x 1 = 2 "
           "(--tensor-model-parallel-size 2"),
    (2, 1, "change --actor-num-nodes (1) x --actor-num-gpus-per-node (1) (2 ranks or a multiple)"),
    (3, 3, "--tensor-model-parallel-size 3 must divide the model's 4 attention heads")])
def test_a_ray_layout_its_actor_ranks_do_not_fit_is_refused(tp: int, gpus: int, wording: str) -> None:
    # TP=2 does not divide one rank; TP=3 divides three ranks but not the model's heads.
    with pytest.raises(ConfigError) as caught:
        check_before_start(ray_config(tp=tp, gpus=gpus), 1)
    assert wording in str(caught.value)


def test_a_ray_run_launched_in_several_ranks_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--ray starts the trainer's ranks as Ray actors \(--actor-num-nodes 1 x "
                                          r"--actor-num-gpus-per-node 2\); this launch has 2 ranks"):
        check_before_start(ray_config(tp=2, gpus=2), 2)
