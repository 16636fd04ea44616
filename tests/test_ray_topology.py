"""The Ray topology from slime's flags, without Ray: ranks, engines, bundles per role and each actor's
place, on GPUs and on CPUs, colocated and disaggregated; settings that cannot be placed are refused with
the setting named; the flags reach TrainConfig, ray_routing too (from a flag or a TOML key); a trainer actor
builds its trainer from TrainConfig.model's directory itself."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from april_ext import ConfigError
from april_ext.cli.train import add_parser, config_from_args
from april_ext.cluster import Placement, Topology
from april_ext.training import TrainConfig


def topology(**changes) -> Topology:
    return Topology.from_config(TrainConfig(ray=True, **changes))


def test_disaggregated_gpus_one_group_per_role() -> None:
    t = topology(device="cuda", engine="sglang", sglang_launch=True, actor_num_nodes=2, actor_num_gpus_per_node=8,
                 rollout_num_gpus=16, rollout_num_gpus_per_engine=4, ray_num_cpus_per_actor=2)
    assert (t.trainer_ranks, t.num_engines, t.gpus_per_engine) == (16, 4, 4)
    assert t.bundles("trainer") == [{"CPU": 2, "GPU": 1.0}] * 16
    assert t.bundles("rollout") == [{"CPU": 2, "GPU": 4.0}] * 4
    assert t.trainer(15) == Placement("trainer", 15, 2, 1.0)
    assert t.engine(3) == Placement("rollout", 3, 2, 4.0)


def test_colocated_engines_share_the_trainer_bundles() -> None:
    t = topology(device="cuda", colocate=True, actor_num_gpus_per_node=8)
    assert (t.trainer_ranks, t.num_engines) == (8, 8)  # rollout_num_gpus defaults to the trainer's
    assert t.bundles("trainer") == [{"CPU": 2.0, "GPU": 1.0}] * 8
    assert t.bundles("rollout") == []
    assert t.trainer(5) == Placement("trainer", 5, 1.0, 0.5)
    assert t.engine(5) == Placement("trainer", 5, 1.0, 0.5)


def test_cpu_only_cluster_places_cpus() -> None:
    t = topology(actor_num_gpus_per_node=2, rollout_num_gpus=3, ray_num_cpus_per_actor=0.25)
    assert t.bundles("trainer") == [{"CPU": 0.25}] * 2
    assert t.bundles("rollout") == [{"CPU": 0.25}] * 3
    assert t.engine(2) == Placement("rollout", 2, 0.25, 0.0)
    assert topology().num_engines == 1  # disaggregated default: one engine of rollout_num_gpus_per_engine


@pytest.mark.parametrize("changes, named", [
    ({"engine": "sglang", "sglang_launch": True, "rollout_num_gpus": 6, "rollout_num_gpus_per_engine": 4},
     "rollout_num_gpus=6"),
    ({"engine": "sglang", "sglang_launch": True, "rollout_num_gpus_per_engine": 16}, "rollout_num_gpus_per_engine=16"),
    ({"rollout_num_gpus_per_engine": 2, "rollout_num_gpus": 2}, "engine='embedded'"),
    ({"colocate": True, "actor_num_gpus_per_node": 2, "rollout_num_gpus": 4}, "colocate"),
    ({"actor_num_gpus_per_node": 9}, "actor_num_gpus_per_node=9"),
])
def test_unplaceable_settings_are_refused(changes, named) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        topology(**changes)


@pytest.mark.parametrize("changes, named", [
    ({"actor_num_nodes": 0}, "actor_num_nodes"), ({"rollout_num_gpus": 0}, "rollout_num_gpus"),
    ({"ray_num_cpus_per_actor": 0.0}, "ray_num_cpus_per_actor"), ({"ray_timeout_s": float("inf")}, "ray_timeout_s"),
    ({"ray_engine_max_restarts": -1}, "ray_engine_max_restarts"), ({"ray_router_url": "localhost:1"}, "ray_router_url"),
    ({"ray": True, "engine": "sglang", "sglang_urls": ("http://a:1",), "model": "m"}, "engine"),
])
def test_bad_ray_settings_name_the_setting(changes, named) -> None:
    with pytest.raises(ConfigError, match=f"TrainConfig.{named}"):
        TrainConfig(**changes)


def test_slime_flags_set_the_ray_settings() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--ray", "--ray-address", "auto", "--actor-num-nodes", "2",
                              "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "8",
                              "--rollout-num-gpus-per-engine", "2", "--num-gpus-per-node", "4", "--colocate",
                              "--ray-num-cpus-per-actor", "0.5", "--engine", "sglang", "--sglang-launch"])
    config = config_from_args(args)
    assert (config.ray, config.ray_address, config.actor_num_nodes, config.actor_num_gpus_per_node,
            config.rollout_num_gpus, config.rollout_num_gpus_per_engine, config.num_gpus_per_node, config.colocate,
            config.ray_num_cpus_per_actor) == (True, "auto", 2, 4, 8, 2, 4, True, 0.5)


def test_ray_routing_is_router_or_least_loaded_from_flags_or_toml(tmp_path) -> None:
    assert TrainConfig(ray=True).ray_routing == "router"
    with pytest.raises(ConfigError, match=r"TrainConfig.ray_routing='cache_aware' is not allowed: one of "
                                          r"\('router', 'least_loaded'\)"):
        TrainConfig(ray=True, ray_routing="cache_aware")
    with pytest.raises(ConfigError, match=r"TrainConfig.ray_router_url='http://r:1' is not allowed: None with "
                                          r"ray_routing='least_loaded'"):
        TrainConfig(ray=True, ray_routing="least_loaded", ray_router_url="http://r:1")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    toml = tmp_path / "run.toml"
    toml.write_text('ray = true\nray_routing = "least_loaded"\n')
    assert config_from_args(parser.parse_args(["train", "--config", str(toml)])).ray_routing == "least_loaded"
    flags = ["train", "--config", str(toml), "--ray-routing", "router"]
    assert config_from_args(parser.parse_args(flags)).ray_routing == "router"


def test_a_megatron_trainer_actor_reads_the_checkpoint_directory_without_building_the_whole_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TrainerRank.setup (the actor's code, called here without Ray, a world of one) gets TrainConfig.model's
    directory, not a model: the Megatron trainer reads it itself (across ranks each rank only its slice) and
    no whole april_ext model is built (before: setup ran load_pretrained)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'april_ext[megatron]')")
    from april_ext.cluster.network import RunNetwork
    from april_ext.cluster.trainer_actor import TrainerRank
    from april_ext.model import (
        LlamaForCausalLM,
        ModelConfig,
        iter_safetensors,
        save_pretrained,
    )

    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    model.init_weights(3)
    save_pretrained(model, tmp_path / "hf")
    built: list[LlamaForCausalLM] = []
    init = LlamaForCausalLM.__init__

    def counting_init(self: LlamaForCausalLM, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        built.append(self)

    monkeypatch.setattr(LlamaForCausalLM, "__init__", counting_init)
    rank = TrainerRank(TrainConfig(trainer="megatron", model=str(tmp_path / "hf"), output_dir=str(tmp_path / "run")),
                       0, 1, RunNetwork(loopback=True))
    try:
        rank.setup(("127.0.0.1", 0), str(tmp_path / "hf"), "actor-test-")
        exported = dict(rank.trainer.export_weights(to_cpu=True))
    finally:
        rank.close()
    assert built == []
    saved = dict(iter_safetensors(tmp_path / "hf"))
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[name], tensor) for name, tensor in saved.items())


def test_a_ray_run_without_the_cluster_factories_says_where_they_come_from(tmp_path) -> None:
    from april_ext.training import TrainingRun, train

    config = TrainConfig(ray=True, output_dir=str(tmp_path))
    for start in (lambda: TrainingRun(config), lambda: train(config)):
        with pytest.raises(ConfigError, match=r"RayTopologyRun\(config\)\.factories\(\)"):
            start()
