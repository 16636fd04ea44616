"""weight_sync="broadcast" on Ray: trainer rank 0 (an actor) is rank 0 of the engines' weight group and
broadcasts each bucket of its own export; the driver only posts the HTTP side. On a local Ray cluster with the
real sglang-router and embedded engines (gloo on CPU).

- 2 ranks (DDP), 2 engines: after each step every engine reports the step's weight version and generates
  greedily as a reference model loaded with the trainer's export; every byte came from rank 0's sender, none
  from the driver's.
- Megatron ranks with pipeline parallelism (PP=2): each stage's first rank hosts a weight group of its own and
  broadcasts only its stage, which only its stage's ranks gather; the engines generate as the whole export.
- An engine's server SIGKILLed while rank 0 broadcasts: the update goes again to the engine left, the run
  goes on, and the engine restarted by Ray rejoins with the current weights (exported and broadcast again).
- weight_sync="tensor", colocated, 2 ranks of data parallel: each rank posts its export to the engine beside it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import urllib.request

import pytest
import torch
from _ray_utils import RAY, TINY, label, needs, ray_cluster, ray_run, run_headers  # noqa: F401 (fixture)
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext.cluster.rank_export import RankHost
from april_ext.model import load_pretrained
from april_ext.training import TrainConfig, TrainingRun

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread", "ray_cluster"), needs("ray", "sglang_router")]

TINY = {**TINY, "hidden_size": 32}
RAY = {**RAY, "weight_sync": "broadcast", "weight_sync_bucket_mb": 0.004}
NEW_TOKENS = 6
PROMPTS = [[1, 2, 1], [2, 2, 1, 1, 2], [1]]


def _reference(run: TrainingRun):
    """The engines' model (their initial checkpoint) with the trainer's current weights, pulled through the driver."""
    model = load_pretrained(os.path.join(run.config.output_dir, "sglang", "initial_model"), device="cpu")
    exported = dict(run.trainer.export_weights())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(exported[name])
    return model


def _greedy_reference(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor(ids)[None])[0, -1].argmax()))
    return ids[len(prompt):]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                     **run_headers()})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _engine_view(url: str) -> tuple[str, list[list[int]]]:
    """(the weight version the engine reports, its greedy continuations of PROMPTS)."""
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    outputs = [list(_post(f"{url}/generate", {"input_ids": p, "sampling_params": sampling, "stream": False})
                    ["output_ids"]) for p in PROMPTS]
    return label(url), outputs


async def _train_and_view(run: TrainingRun) -> dict:
    """Runs every step; after each, every engine's view and the greedy continuations of a model loaded with the
    trainer's export."""
    seen: dict = {"views": [], "references": []}
    while not run.done:
        await run.step()
        reference = _reference(run)
        seen["references"].append([_greedy_reference(reference, p) for p in PROMPTS])
        seen["views"].append([await asyncio.to_thread(_engine_view, s.url) for s in run.engine.pool.slots])
    return seen


def _check_views(seen: dict, engines: int) -> None:
    """After each step, every engine reported the step's version and generated as the trainer's export."""
    for step, (views, reference) in enumerate(zip(seen["views"], seen["references"], strict=True), start=1):
        assert views == [(str(step), reference)] * engines, step


def test_rank_0_broadcasts_every_update_and_the_engines_generate_as_its_export(tmp_path) -> None:
    config = TrainConfig(**TINY, **RAY, num_steps=3, output_dir=str(tmp_path / "run"), actor_num_gpus_per_node=2,
                         rollout_num_gpus=2)

    async def run() -> dict:
        async with ray_run(config) as run:
            engine, trainer = run.engine, run.trainer
            model_bytes = sum(p.numel() * p.element_size() for p in _reference(run).parameters())
            seen = await _train_and_view(run)
            seen["rank0_sent"] = trainer.weight_bytes_sent()
            seen["driver_sent"] = engine.inner._broadcaster.local.sender.bytes_sent
            seen["host"] = engine.inner._broadcaster._groups[0].host
            seen["model_bytes"] = model_bytes
            await run.finish()
            return seen

    seen = asyncio.run(asyncio.wait_for(run(), 600))  # a hang fails the test instead of stalling the suite
    _check_views(seen, engines=2)
    # Rank 0 sent each update's weights, once per update; the driver's own sender sent nothing.
    assert isinstance(seen["host"], RankHost)
    assert seen["rank0_sent"] == 3 * seen["model_bytes"] and seen["driver_sent"] == 0


def test_each_pipeline_stage_first_rank_broadcasts_its_stage(tmp_path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'april_ext[megatron]')")
    import ray

    config = TrainConfig(**{**TINY, "num_layers": 2}, **RAY, trainer="megatron", pipeline_model_parallel_size=2,
                         num_steps=2, output_dir=str(tmp_path / "run"), actor_num_gpus_per_node=2,
                         rollout_num_gpus=2)

    async def run() -> dict:
        async with ray_run(config) as run:
            engine, trainer = run.engine, run.trainer
            seen = await _train_and_view(run)
            exported = dict(trainer.export_weights())
            seen["stage_bytes"] = [sum(t.numel() * t.element_size() for n, t in exported.items()
                                       if _stage_of(n) == stage) for stage in (0, 1)]
            seen["sent"] = ray.get([a.weight_bytes_sent.remote() for a in trainer.actors])
            seen["hosts"] = [(g.host.rank, g.name) for _, g in sorted(engine.inner._broadcaster._groups.items())]
            await run.finish()
            return seen

    seen = asyncio.run(asyncio.wait_for(run(), 600))  # a hang fails the test instead of stalling the suite
    _check_views(seen, engines=2)
    # Two groups, one per stage, hosted by each stage's rank; each rank sent its own stage, once per update.
    assert [rank for rank, _ in seen["hosts"]] == [0, 1] and seen["hosts"][0][1] != seen["hosts"][1][1]
    assert seen["sent"] == [2 * b for b in seen["stage_bytes"]] and min(seen["stage_bytes"]) > 0


def _stage_of(name: str) -> int:
    """The stage of a 2-layer model split in two that holds HF tensor ``name``: the embedding and layer 0 on
    the first, layer 1, the final norm and the output layer on the last."""
    return 0 if name.startswith(("model.embed_tokens.", "model.layers.0.")) else 1


# One rank of the torch trainer; Megatron at PP=2, the engine killed when the second stage starts sending (after
# the first stage's group has received its part).
KILL_LAYOUTS = {"torch": ({"actor_num_gpus_per_node": 1}, 0),
                "megatron_pp2": ({"actor_num_gpus_per_node": 2, "trainer": "megatron", "num_layers": 2,
                                  "pipeline_model_parallel_size": 2}, 1)}


@pytest.mark.parametrize("layout", sorted(KILL_LAYOUTS))
def test_an_engine_killed_while_rank_0_broadcasts_is_left_out_then_rejoins_with_current_weights(
        tmp_path, monkeypatch, caplog, layout: str) -> None:
    if layout != "torch":
        pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    changes, sender = KILL_LAYOUTS[layout]
    config = TrainConfig(**{**TINY, "rollout_batch_size": 4, **changes}, **RAY, num_steps=4,
                         output_dir=str(tmp_path / "run"), rollout_num_gpus=2, weight_sync_timeout_s=20.0)
    armed: list = []
    send = RankHost.send

    async def send_then_fault(self, name: str) -> None:
        if armed and self.rank == sender:
            armed.pop()()
        await send(self, name)

    monkeypatch.setattr(RankHost, "send", send_then_fault)

    async def run() -> dict:
        async with ray_run(config) as run:
            engine, seen = run.engine, {}
            await run.step()
            killed = engine.pool.slots[0]
            server = await asyncio.wrap_future(killed.actor.server_pid.remote().future())
            seen["killed_url"] = killed.url
            armed.append(lambda: os.kill(server, signal.SIGKILL))
            start = asyncio.get_running_loop().time()
            await asyncio.wait_for(run.step(), 240)  # the fault comes with the sync's first bucket
            seen["step_s"] = asyncio.get_running_loop().time() - start
            assert not armed, "the step sent no bucket"
            seen["survivor"] = await asyncio.to_thread(_engine_view, engine.pool.slots[1].url)
            seen["reference"] = [_greedy_reference(_reference(run), p) for p in PROMPTS]
            deadline = asyncio.get_running_loop().time() + 120
            while not (engine.rejoins == 1 and engine.pool.states()[0] == "up"):
                assert asyncio.get_running_loop().time() < deadline, "the killed engine did not rejoin"
                await asyncio.sleep(0.2)
            label = (await asyncio.to_thread(_engine_view, killed.url))[0]
            seen["rejoined"] = (killed.url, label, str(run.trainer.version))
            while not run.done:
                await run.step()
            seen["labels"] = sorted({(await asyncio.to_thread(_engine_view, s.url))[0]
                                     for s in engine.pool.slots})
            seen["listed"] = sorted(engine.pool.router.workers())
            await run.finish()
            seen["history"] = run.history
            return seen

    caplog.set_level(logging.WARNING, logger="april_ext.cluster.ray_engine")
    seen = asyncio.run(asyncio.wait_for(run(), 600))  # a hang fails the test instead of stalling the suite
    print(f"step 2 with the fault: {seen['step_s']:.1f} s")
    # Step 2's update failed, went again to the engine left, and the run went on.
    assert "weight update 2 failed" in caplog.text and "sending it again to the engines left" in caplog.text
    assert seen["survivor"] == ("2", seen["reference"])  # every part of the update, sent again, reached it
    new_url, label, version = seen["rejoined"]
    assert new_url != seen["killed_url"] and label == version
    assert [r["step"] for r in seen["history"]] == [1, 2, 3, 4]
    assert seen["labels"] == ["4"] and len(seen["listed"]) == 2


def test_colocated_ranks_each_post_their_export_to_the_engine_beside_them_with_the_tensor_path(tmp_path) -> None:
    import ray

    config = TrainConfig(**{**TINY, **RAY, "weight_sync": "tensor"}, colocate=True, num_steps=2,
                         actor_num_gpus_per_node=2, output_dir=str(tmp_path / "run"))

    async def run() -> dict:
        async with ray_run(config) as run:
            engine, trainer = run.engine, run.trainer
            model_bytes = sum(p.numel() * p.element_size() for p in _reference(run).parameters())
            seen: dict = {"views": [], "references": []}
            while not run.done:
                await run.step()
                await run.memory.to_rollout()  # the engines resident, the trainer paused: as for a rollout
                seen["views"].append([await asyncio.to_thread(_engine_view, s.url) for s in engine.pool.slots])
                await run.memory.to_training()
                seen["references"].append([_greedy_reference(_reference(run), p) for p in PROMPTS])
            seen["sent"] = ray.get([a.weight_bytes_sent.remote() for a in trainer.actors])
            seen["kept"] = engine.inner._weights
            seen["model_bytes"] = model_bytes
            await run.finish()
            return seen

    seen = asyncio.run(asyncio.wait_for(run(), 600))  # a hang fails the test instead of stalling the suite
    _check_views(seen, engines=2)
    # Each rank (DDP, colocated: gradients averaged in its memory tag) posted each update once, to its own
    # engine; the driver keeps no tensor for a rejoining engine, only the ranks' poster.
    assert seen["sent"] == [2 * seen["model_bytes"]] * 2
    assert type(seen["kept"]).__name__ == "RankPoster"
