"""`april-ext train` over SGLang servers (launched through the launcher with april_ext.server as the
stand-in, or already running) and with the Megatron-core trainer: real components on loopback with the
tiny counting model; configs that cannot work are refused with the field named."""

from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.error
import urllib.request

import pytest
import torch
from _sglang_utils import counting_checkpoint, live_server
from _torch_threads import one_thread  # noqa: F401 (fixture)
from _trainer_utils import cli_flags

from april_ext import ConfigError, cli, memory
from april_ext.cli.train import config_from_args
from april_ext.model import LlamaForCausalLM, iter_safetensors, load_pretrained
from april_ext.sglang import SGLangLaunchError
from april_ext.tasks import CountingTask, CountingTaskConfig
from april_ext.training import TrainConfig, TrainingRun, train
from april_ext.training.config import SCHEDULER_SETTINGS

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(counting_median=3.0, counting_sigma=0.8, counting_max_count=12, counting_symbols=2, hidden_size=16,
            num_layers=1, rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=4,
            max_num_seqs=64, num_blocks=256, lr=0.003, progress=False, plots=False)
SERVER_ARGS = "--num-blocks 256 --max-running-requests 64 --seed 0"


def _rows(path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2):
            return True
    except (urllib.error.URLError, OSError):
        return False


def _check_rows(rows: list[dict], steps: int, *, sglang: bool) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["policy_version"] for r in rows] == list(range(steps))
    # A step may be served entirely by groups finished during the step before, not every step generates.
    assert sum(r["rollout/generated_tokens"] for r in rows) > 0
    for r in rows:
        assert r["variant"] == "april"
        assert r["rollout/batch_groups"] == TINY["rollout_batch_size"]
        assert len(r["rollout/response_lens"]) == TINY["rollout_batch_size"] * TINY["n_samples_per_prompt"]
        assert 0 <= r["rollout/reward_mean"] <= 1
        assert r["train/version"] == r["step"] and torch.isfinite(torch.tensor(r["train/loss"]))
        if sglang:
            # What the servers report after the step's weight sync: the trainer's new version.
            assert r["engine/server_weight_versions"] == [str(r["step"])]
        else:
            assert "engine/server_weight_versions" not in r


def test_cli_train_launches_sglang_servers_and_syncs_weights_every_step(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["train", *cli_flags({**TINY, "num_steps": 3, "output_dir": str(out), "engine": "sglang",
                                       "sglang_launch": True, "sglang_num_servers": 2,
                                       "sglang_module": "april_ext.server", "sglang_args": SERVER_ARGS,
                                       "sglang_launch_timeout_s": 120.0})])
    assert code == 0
    rows = _rows(out / "metrics.jsonl")
    _check_rows(rows, 3, sglang=True)
    # APRIL over HTTP: a step resumed partial samples of the step before.
    assert any(r["rollout/carried_token_ratio"] > 0 for r in rows[1:])
    assert any(0 < r["rollout/off_policy_token_ratio"] for r in rows[1:])
    # The servers started on the trainer's initial weights: the initial model is the counting model of the seed.
    task = CountingTask(CountingTaskConfig(n_symbols=2, max_count=12, median_count=3.0, sigma=0.8, seed=0))
    reference = LlamaForCausalLM(task.model_config(hidden_size=16, intermediate_size=48, num_hidden_layers=1,
                                                   max_position_embeddings=8 + task.max_response_len() + 8))
    reference.init_weights(0)
    initial = dict(iter_safetensors(out / "sglang" / "initial_model"))
    for name, param in reference.named_parameters():
        assert torch.equal(initial[name], param.detach()), name
    # The last weights synced through the shared directory are the final checkpoint's policy.
    synced = dict(iter_safetensors(out / "sglang" / "weight_sync"))
    final = load_pretrained(out / "checkpoints" / "step_000003" / "trainer")
    for name, param in final.named_parameters():
        assert torch.equal(synced[name], param.detach()), name
    # The servers are gone once the run ended (their logs name their urls).
    for i in range(2):
        log = (out / "sglang" / f"server_{i}.log").read_text()
        url = re.search(r"listening on (http://\S+)", log).group(1)
        assert not _reachable(url)
    assert "rollout tokens/s" in capsys.readouterr().out
    # Resumed onto a fresh server: it starts on the checkpoint's weights, labelled with its version.
    assert cli.main(["train", *cli_flags({**TINY, "num_steps": 4, "output_dir": str(out), "engine": "sglang",
                                       "sglang_launch": True, "sglang_module": "april_ext.server",
                                       "sglang_args": SERVER_ARGS, "resume": True})]) == 0
    rows = _rows(out / "metrics.jsonl")
    _check_rows(rows, 4, sglang=True)
    relaunched = dict(iter_safetensors(out / "sglang" / "initial_model"))
    assert all(torch.equal(relaunched[name], param.detach()) for name, param in final.named_parameters())


def test_running_servers_get_the_initial_weights_and_each_new_version(tmp_path):
    ckpt = counting_checkpoint(tmp_path / "ckpt")
    # A label left by an earlier run: the run must relabel the servers with its own version.
    with live_server(load_pretrained(ckpt), weight_version="17", block_size=16,
                     max_num_seqs=64) as server:
        config = TrainConfig(**{**TINY, "num_steps": 2, "output_dir": str(tmp_path / "run"), "engine": "sglang",
                                "sglang_urls": (server.url,), "model": ckpt,
                                "sglang_stream": False})
        result = train(config)
        _check_rows(result.history, 2, sglang=True)
        with urllib.request.urlopen(f"{server.url}/model_info", timeout=5) as resp:
            assert json.loads(resp.read())["weight_version"] == "2"


def test_megatron_trainer_with_the_embedded_engine(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'april_ext[megatron]')")
    from april_ext.trainer.megatron import MegatronTrainer

    out = tmp_path / "run"
    assert cli.main(["train", *cli_flags({**TINY, "num_steps": 2, "output_dir": str(out), "trainer": "megatron",
                                       "over_sampling": "adaptive", "target_inflight_samples": 12})]) == 0
    _check_rows(_rows(out / "metrics.jsonl"), 2, sglang=False)
    state = torch.load(out / "checkpoints" / "step_000002" / "trainer" / "trainer_state.pt", weights_only=False)
    assert state["format"] == MegatronTrainer.checkpoint_format
    assert not torch.distributed.is_initialized()  # the run tore its process group down


def test_megatron_trainer_colocated_with_an_sglang_server_releases_memory_in_turn(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'april_ext[megatron]')")
    ckpt = counting_checkpoint(tmp_path / "ckpt")
    with live_server(load_pretrained(ckpt), memory_saver=True, block_size=16, max_num_seqs=64,
                     memory_tag_prefix="wiring-colocated-") as server:
        result = train(TrainConfig(**{**TINY, "num_steps": 2, "output_dir": str(tmp_path / "run"),
                                      "engine": "sglang", "sglang_urls": (server.url,), "model": str(ckpt),
                                      "trainer": "megatron", "colocate": True}))
        _check_rows(result.history, 2, sglang=True)
    tags = memory.stats()
    trainer = tags[result.memory_tag_prefix + "trainer"]
    kv, weights = tags["wiring-colocated-kv_cache"], tags["wiring-colocated-weights"]
    # The server released everything for each training step (/release_memory_occupation) and took the
    # weights back before each update, the KV cache before each rollout; the trainer paused for each rollout.
    assert kv.pauses == 2 and weights.pauses == 2 and not kv.paused and not weights.paused
    assert trainer.pauses == 2 and trainer.resumes == 2 and not trainer.paused


def test_a_server_that_cannot_start_fails_the_run_with_its_log(tmp_path):
    config = TrainConfig(**{**TINY, "num_steps": 1, "output_dir": str(tmp_path / "run"), "engine": "sglang",
                            "sglang_launch": True, "sglang_module": "april_ext.no_such_server",
                            "sglang_launch_timeout_s": 60.0})
    with pytest.raises(SGLangLaunchError, match="no_such_server"):
        train(config)


def test_sglang_flags_parse_into_the_config():
    parser = cli.build_parser()
    cfg = config_from_args(parser.parse_args([
        "train", "--engine", "sglang", "--sglang-urls", "http://a:1, http://b:2", "--model", "m",
        "--trainer", "megatron", "--over-sampling", "adaptive", "--target-inflight-samples", "32",
        "--sglang-args", "--mem-fraction-static 0.7", "--no-sglang-stream"]))
    assert cfg.sglang_urls == ("http://a:1", "http://b:2") and cfg.trainer == "megatron"
    assert cfg.over_sampling == "adaptive" and cfg.target_inflight_samples == 32
    assert cfg.sglang_args == "--mem-fraction-static 0.7" and cfg.sglang_stream is False


def test_toml_lists_urls(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('engine = "sglang"\nsglang_urls = ["http://a:1", "http://b:2"]\nmodel = "m"\n')
    assert TrainConfig.from_toml(path).sglang_urls == ("http://a:1", "http://b:2")


@pytest.mark.parametrize("changes, field", [
    (dict(engine="vllm"), "engine"),
    (dict(trainer="jax"), "trainer"),
    (dict(sglang_urls=("http://a:1",)), "sglang_urls"),          # engine is embedded
    (dict(sglang_launch=True), "sglang_launch"),
    (dict(engine="sglang"), "engine"),                             # no servers named
    (dict(engine="sglang", sglang_launch=True, sglang_urls=("http://a:1",)), "engine"),
    (dict(engine="sglang", sglang_urls=("http://a:1",)), "model"),  # which checkpoint do the servers serve?
    (dict(engine="sglang", sglang_urls=("a:1",), model="m"), "sglang_urls"),
    (dict(engine="sglang", sglang_urls="http://a:1", model="m"), "sglang_urls"),
    (dict(engine="sglang", sglang_router_url="ftp://r", model="m"), "sglang_router_url"),
    (dict(engine="sglang", sglang_launch=True, sglang_args="--port 3"), "sglang_args"),
    (dict(engine="sglang", sglang_launch=True, sglang_args="--x 'open"), "sglang_args"),
    (dict(engine="sglang", sglang_launch=True, sglang_num_servers=0), "sglang_num_servers"),
    (dict(engine="sglang", sglang_launch=True, sglang_launch_timeout_s=0.0), "sglang_launch_timeout_s"),
    (dict(engine="sglang", sglang_launch=True, sglang_module=""), "sglang_module"),
    (dict(over_sampling="dynamic"), "over_sampling"),
    (dict(over_sampling="adaptive"), "target_inflight_samples"),
    (dict(over_sampling="adaptive", target_inflight_samples=3), "target_inflight_samples"),
    (dict(target_inflight_samples=16), "target_inflight_samples"),
])
def test_bad_backend_configs_name_the_field(changes, field):
    # Scheduler settings are validated by SchedulerConfig, whose messages name it.
    owner = "SchedulerConfig" if field in SCHEDULER_SETTINGS else "TrainConfig"
    with pytest.raises(ConfigError, match=rf"{owner}\.{field}="):
        TrainConfig(**changes)


def test_adaptive_over_sampling_reaches_the_scheduler(tmp_path):
    async def scheduler_config(config: TrainConfig):
        async with TrainingRun(config) as run:
            return run.scheduler.config

    config = TrainConfig(**{**TINY, "output_dir": str(tmp_path / "run"), "over_sampling": "adaptive",
                            "target_inflight_samples": 12})
    sched = asyncio.run(scheduler_config(config))
    assert sched.over_sampling == "adaptive" and sched.target_inflight_samples == 12
    # The synchronous baseline has no over-sampling to adapt.
    sched = asyncio.run(scheduler_config(config.replace(partial_rollout=False)))
    assert sched.over_sampling == "fixed" and sched.target_inflight_samples is None


def test_the_example_config_selects_sglang_and_megatron():
    path = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "counting_sglang_megatron.toml")
    config = TrainConfig.from_toml(path)
    assert config.engine == "sglang" and config.sglang_launch and config.trainer == "megatron"
    assert config.sglang_module == "april_ext.server"  # runs on a CPU as written


def test_compare_launches_servers_per_run_and_refuses_shared_ones(tmp_path, capsys):
    out = tmp_path / "cmp"
    settings = {**TINY, "num_steps": 1, "output_dir": str(out), "engine": "sglang", "sglang_launch": True,
                "sglang_module": "april_ext.server", "sglang_args": SERVER_ARGS,
                "sglang_weight_sync_dir": str(tmp_path / "sync")}
    assert cli.main(["train", "--compare", *cli_flags(settings)]) == 0
    for name in ("baseline", "april"):
        assert _rows(out / name / "metrics.jsonl")[0]["engine/server_weight_versions"] == ["1"]
        assert (tmp_path / "sync" / name / "model.safetensors.index.json").is_file()
    capsys.readouterr()
    shared = {**TINY, "output_dir": str(out), "engine": "sglang", "sglang_urls": "http://127.0.0.1:1", "model": "m"}
    assert cli.main(["train", "--compare", *cli_flags(shared)]) == 2
    assert "--compare with engine='sglang' needs sglang_launch=true" in capsys.readouterr().err
