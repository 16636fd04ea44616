"""Exported weights stream (issue 11): an export is read once; the disk sync writes Hugging Face's sharded
layout one shard at a time, the tensor sync sends one /update_weights_from_tensor per bucket and commits
the version with the last, and the embedded engine copies a stream tensor by tensor."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _engine_utils import engine, greedy_reference, tiny_model
from _sglang_utils import live_server
from _torch_threads import one_torch_thread

from april_ext.errors import InvalidArgumentError, InvalidStateError
from april_ext.model import load_pretrained, save_pretrained
from april_ext.model.checkpoint import iter_safetensors
from april_ext.protocol import SamplingParams
from april_ext.sglang import SGLangEngine, SGLangEngineConfig
from april_ext.weights import transport
from april_ext.trainer import TorchTrainer

PROMPT = [5, 17, 33, 2, 60]


def test_an_export_is_read_once() -> None:
    exported = TorchTrainer(tiny_model()).export_weights()
    assert len(dict(exported.tensors)) == len(list(tiny_model().parameters()))
    with pytest.raises(InvalidStateError, match="already read"):
        iter(exported)


def test_sharded_safetensors_hold_a_bucket_each_and_replace_an_earlier_write(tmp_path) -> None:
    from april_ext.model.checkpoint import save_safetensors_sharded, shard_name

    model = tiny_model(seed=3)
    save_pretrained(tiny_model(seed=4), tmp_path)  # an earlier single-file checkpoint in the same directory
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    bucket = 3 * max(sizes.values())
    names = save_safetensors_sharded(((n, p.detach()) for n, p in model.named_parameters()), tmp_path, bucket)
    assert names == list(sizes)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) > 2 and shards == [shard_name(k, len(shards)) for k in range(1, len(shards) + 1)]
    assert index["metadata"]["total_size"] == sum(sizes.values())
    for shard in shards:
        assert sum(sizes[n] for n, f in index["weight_map"].items() if f == shard) <= bucket
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == shards  # model.safetensors is gone
    loaded = load_pretrained(tmp_path)
    for name, param in model.named_parameters():
        assert torch.equal(loaded.get_parameter(name), param)
    # A second write with fewer, larger shards leaves none of the first's behind.
    save_safetensors_sharded(((n, p.detach()) for n, p in model.named_parameters()), tmp_path, 2**30)
    assert [p.name for p in tmp_path.glob("*.safetensors")] == [shard_name(1, 1)]
    assert {n: t for n, t in iter_safetensors(tmp_path)}.keys() == sizes.keys()


def test_tensor_sync_sends_buckets_and_commits_the_version_with_the_last(monkeypatch) -> None:
    new = tiny_model(seed=1)
    want = greedy_reference(new, PROMPT, 8)
    fresh = [(name, p.detach().clone()) for name, p in new.named_parameters()]
    largest = max(t.numel() * t.element_size() for _, t in fresh)
    calls: list[dict[str, Any]] = []
    load = transport._load

    async def recording(workers: Any, endpoint: str, payload: dict[str, Any], version: int | None,
                        flush_cache: bool) -> None:
        await load(workers, endpoint, payload, version, flush_cache)
        calls.append({"endpoint": endpoint, "version": version, "flush": flush_cache,
                      "labels": await engine_ref[0].weight_versions()})

    monkeypatch.setattr(transport, "_load", recording)
    engine_ref: list[SGLangEngine] = []

    async def body(url: str) -> tuple[list[str], list[Any]]:
        config = SGLangEngineConfig(worker_urls=(url,), weight_sync="tensor", weight_bucket_mb=2 * largest / 2**20)
        async with SGLangEngine(config) as adapter:
            engine_ref.append(adapter)
            names = await adapter.update_weights(iter(fresh), 7)
            chunks = [c async for c in adapter.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                               ignore_eos=True), "after")]
            return names, chunks

    with one_torch_thread(), live_server(weight_version="3") as server:
        names, chunks = asyncio.run(body(server.url))
    assert names == sorted(n for n, _ in fresh)
    assert len(calls) > 2 and {c["endpoint"] for c in calls} == {"/update_weights_from_tensor"}
    assert [c["version"] for c in calls] == [None] * (len(calls) - 1) + [7]
    assert [c["flush"] for c in calls] == [False] * (len(calls) - 1) + [True]
    # The servers report the old version until the last bucket is in.
    assert [set(c["labels"].values()) for c in calls] == [{"3"}] * (len(calls) - 1) + [{"7"}]
    assert [t for c in chunks for t in c.token_ids] == want and {c.weight_version for c in chunks} == {7}


def test_the_embedded_engine_copies_a_stream_tensor_by_tensor() -> None:
    core = engine(tiny_model(seed=0))
    new = dict(tiny_model(seed=1).named_parameters())
    params = dict(core.model.named_parameters())
    seen: list[str] = []

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in new.items():
            # Every tensor read before this one is in the model already: nothing is staged.
            assert all(torch.equal(params[n], new[n]) for n in seen)
            seen.append(name)
            yield name, tensor.detach()
        yield "model.no_such.weight", tensor.detach()

    with pytest.raises(InvalidArgumentError, match=f"the {len(new)} tensors before it are already copied"):
        core.update_weights(stream(), 1)
    assert all(torch.equal(params[n], t) for n, t in new.items())
    assert core.weight_version == 0


def test_a_ray_trainer_rank_hands_its_export_out_bucket_by_bucket(tmp_path) -> None:
    from april_ext.cluster.network import RunNetwork
    from april_ext.cluster.trainer_actor import TrainerRank
    from april_ext.training.config import TrainConfig

    model = tiny_model(seed=2)
    want = {name: p.detach().clone() for name, p in model.named_parameters()}
    bucket_bytes = 3 * max(t.numel() * t.element_size() for t in want.values())
    config = TrainConfig(hidden_size=16, num_layers=1, output_dir=str(tmp_path), progress=False, plots=False,
                         weight_sync_bucket_mb=bucket_bytes / 2**20)
    rank = TrainerRank(config, 0, 1, RunNetwork(loopback=True))
    rank.setup(("127.0.0.1", 0), model, "")
    try:
        assert rank.begin_export(False, True) == 0
        buckets = []
        while (bucket := rank.next_bucket()) is not None:
            buckets.append(bucket)
        with pytest.raises(InvalidStateError, match="no export is being read"):
            rank.next_bucket()
    finally:
        rank.close()
    assert len(buckets) > 2
    assert all(sum(t.numel() * t.element_size() for _, t in b) <= bucket_bytes for b in buckets)
    got = [(name, t) for b in buckets for name, t in b]
    assert [n for n, _ in got] == list(want) and all(torch.equal(t, want[n]) for n, t in got)


def test_a_ray_trainer_rank_holds_one_bucket_for_the_broadcast_and_refuses_another_version(tmp_path) -> None:
    """Rank 0 of a Ray run's weight broadcast: each bucket stays on the rank (the driver gets its names, dtypes
    and shapes); an export asked for as another version than the trainer's is refused (a train step came
    between the update and a rejoining engine's export)."""
    from april_ext.cluster.network import RunNetwork
    from april_ext.cluster.trainer_actor import TrainerRank
    from april_ext.training.config import TrainConfig

    model = tiny_model(seed=2)
    bucket_bytes = 3 * max(p.numel() * p.element_size() for p in model.parameters())
    config = TrainConfig(hidden_size=16, num_layers=1, output_dir=str(tmp_path), progress=False, plots=False,
                         weight_sync_bucket_mb=bucket_bytes / 2**20)
    rank = TrainerRank(config, 0, 1, RunNetwork(loopback=True))
    rank.setup(("127.0.0.1", 0), model, "")
    try:
        with pytest.raises(InvalidStateError, match="version 0, not 1"):
            rank.begin_export(False, True, 1)
        rank.begin_export(False, True, 0)
        metas = []
        while (meta := rank.next_bucket_held()) is not None:
            metas.append(meta)
        with pytest.raises(InvalidStateError, match="no weight group 'g'"):
            rank.weight_send("g")  # the last bucket is held until sent (or dropped by end_export)
        rank.end_export()
        rank._sender._groups["g"] = object()  # a group, so that only the held bucket is missing
        with pytest.raises(InvalidStateError, match="no bucket is held"):
            rank.weight_send("g")
        rank._sender._groups.clear()
    finally:
        rank.close()
    assert len(metas) > 2 and all(m.backend == "gloo" for m in metas)
    assert [n for m in metas for n in m.names] == [n for n, _ in model.named_parameters()]
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    assert all(shape == shapes[n] for m in metas for n, shape in zip(m.names, m.shapes))
