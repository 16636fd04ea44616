"""The transports: how new weights reach every worker of an SGLang-speaking engine (SGLang's servers or the
embedded one), tagged with the version later tokens carry.

A checkpoint directory (which the servers must see at the same path) is loaded with
/update_weights_from_disk, unless the sync is "broadcast", which reads it here and broadcasts it. Named
tensors go the way SGLangEngineConfig.weight_sync says:
- "disk": written to ``weight_sync_dir`` as Hugging Face's sharded safetensors (one shard per bucket) and
  loaded with /update_weights_from_disk (any SGLang release; the servers need a shared file system);
- "tensor": one /update_weights_from_tensor per bucket, each a base64 safetensors blob, which only the
  embedded server reads (SGLang's own serializer passes CUDA IPC handles between processes of one machine);
  from this process, or from the process that holds them when given as a TensorPoster (a Ray run's trainer
  ranks, which call post_tensors);
- "broadcast": SGLang's collective update from this process (april_ext.weights.broadcast), or from the process
  that holds them when given as a BroadcastSource or a StagedSource (a Ray run's trainer ranks).
The current release runs tensor and collective updates inside a weight-update session
(/begin_weight_update ... /end_weight_update), which is opened on the workers of that release.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import torch
from safetensors import safe_open

from april_ext.errors import InvalidArgumentError
from april_ext.model.checkpoint import iter_safetensors, safetensors_files, save_safetensors_sharded
from april_ext.protocol import sglang_wire
from april_ext.protocol.sglang_errors import SGLangHTTPError
from april_ext.protocol.sglang_wire import encode_named_tensors
from april_ext.weights.broadcast import WeightBroadcaster
from april_ext.weights.sources import BroadcastSource, StagedSource, TensorPoster, WeightsSource, buckets
from april_ext.weights.workers import WorkerProfile, Workers


async def push_weights(workers: Workers, weights: WeightsSource, version: int,
                       weight_sync: str, weight_sync_dir: str | None, broadcaster: WeightBroadcaster, *,
                       flush_cache: bool = True) -> list[str]:
    """Loads the weights on every worker with weight_version str(version), flushing their caches unless
    flush_cache=False (SGLang fails a flush while requests are held by an in_place pause) and keeping their
    requests (SGLang holds the update until they end, or runs it at once while paused); returns the names
    loaded. Named tensors are read once, in order: the disk and tensor syncs stream them in buckets of
    ``broadcaster.bucket_bytes`` (one bucket held at a time), the broadcast keeps them all for its retry. A
    BroadcastSource (weight_sync "broadcast" only) is read bucket by bucket by its host, here nothing; a
    StagedSource part by part, each by its own host."""
    if isinstance(weights, (BroadcastSource, StagedSource)):
        if weight_sync != "broadcast":
            raise InvalidArgumentError(f"weights broadcast by their holder need weight_sync='broadcast', not "
                                       f"{weight_sync!r}")
        return await broadcaster.push(weights, version, flush_cache=flush_cache)
    if isinstance(weights, TensorPoster):
        if weight_sync != "tensor":
            raise InvalidArgumentError(f"weights posted by their holder need weight_sync='tensor', not {weight_sync!r}")
        return await weights.post(await workers.worker_urls(), version, flush_cache)
    if isinstance(weights, (str, os.PathLike)):
        path = os.path.abspath(os.fspath(weights))
        if weight_sync == "broadcast":
            return await _broadcast(broadcaster, list(iter_safetensors(path)), version, flush_cache)
        return await _from_disk(workers, path, version, flush_cache)
    tensors = weights.items() if isinstance(weights, Mapping) else weights
    if weight_sync == "broadcast":
        return await _broadcast(broadcaster, list(tensors), version, flush_cache)
    if weight_sync == "tensor":
        names: list[str] = []
        await _in_session(workers, lambda: _from_tensors(workers, tensors, broadcaster.bucket_bytes, version,
                                                                flush_cache, names))
        return sorted(names)
    assert weight_sync_dir is not None  # SGLangEngineConfig requires it for "disk"
    save_safetensors_sharded(tensors, weight_sync_dir, broadcaster.bucket_bytes)
    return await _from_disk(workers, weight_sync_dir, version, flush_cache)


async def post_tensors(workers: Workers, tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       bucket_bytes: int, flush_cache: bool) -> list[str]:
    """The tensor sync made by the process that holds the tensors (a TensorPoster's, with workers of its own:
    april_ext.sglang.workers.workers_at): what push_weights does for weight_sync "tensor", one bucket held at a
    time; returns the names loaded."""
    names: list[str] = []
    await _in_session(workers, lambda: _from_tensors(workers, tensors, bucket_bytes, version, flush_cache, names))
    return sorted(names)


async def _from_tensors(workers: Workers, tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                        version: int, flush_cache: bool, names: list[str]) -> None:
    """One /update_weights_from_tensor per bucket. Every bucket but the last loads its tensors and leaves
    the server's version and cache alone (no weight_version, flush_cache false); the last sets both, so
    the new version is announced only once every tensor is in. A bucket is sent when the next tensor does
    not fit, so the last one is known without reading ahead."""
    pending: list[tuple[str, torch.Tensor]] | None = None
    for bucket in buckets(tensors, bucket_bytes):
        if pending is not None:
            await _send_bucket(workers, pending, None, False)
        names.extend(name for name, _ in bucket)
        pending = bucket
    # No tensors at all: one empty call still sets the version (and flushes).
    await _send_bucket(workers, pending or [], version, flush_cache)


async def _send_bucket(workers: Workers, bucket: list[tuple[str, torch.Tensor]], version: int | None,
                       flush_cache: bool) -> None:
    payload = {"serialized_named_tensors": [encode_named_tensors(dict(bucket))], "load_format": None}
    bucket.clear()  # the blob holds the bytes now
    await _load(workers, "/update_weights_from_tensor", payload, version, flush_cache)


async def _broadcast(broadcaster: WeightBroadcaster, tensors: list[tuple[str, torch.Tensor]],
                     version: int, flush_cache: bool) -> list[str]:
    return await broadcaster.push(tensors, version, flush_cache=flush_cache)


async def _from_disk(workers: Workers, path: str, version: int, flush_cache: bool) -> list[str]:
    names = []
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as handle:
            names.extend(handle.keys())
    await _load(workers, "/update_weights_from_disk", {"model_path": path, "load_format": None}, version,
                flush_cache)
    return sorted(names)


async def _in_session(workers: Workers, update: Callable[[], Awaitable[None]]) -> None:
    """Runs the update inside a weight-update session on the workers whose release has them."""
    async def call(endpoint: str) -> None:
        async def one(profile: WorkerProfile) -> None:
            if profile.dialect is sglang_wire.CURRENT:
                await workers.post(profile.url, endpoint, {})

        await workers.each(one)

    await call("/begin_weight_update")
    try:
        await update()
    finally:
        await call("/end_weight_update")


async def _load(workers: Workers, endpoint: str, payload: dict[str, Any], version: int | None,
                flush_cache: bool) -> None:
    """Each worker gets the fields its SGLang release defines (0.4.x has no weight_version, flush_cache came
    with 0.5.x, ...); a server without weight versions still loads the weights, and the adapter tags their
    tokens with its own version."""
    payload.update(flush_cache=flush_cache, abort_all_requests=False)
    if version is not None:
        payload["weight_version"] = str(version)
    for url, answer in await workers.broadcast(endpoint, lambda profile: profile.fields(endpoint, payload)):
        if not isinstance(answer, dict) or not answer.get("success", False):
            raise SGLangHTTPError(f"{url}{endpoint}", 200, f"weight update failed: {answer!r}")


__all__ = ["post_tensors", "push_weights"]
