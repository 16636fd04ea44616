"""Weight sync: how new weights reach every SGLang worker, tagged with the version later tokens carry.

A checkpoint directory (which the servers must see at the same path) is loaded with
/update_weights_from_disk, which real SGLang servers accept. Named tensors are written to
``weight_sync_dir`` and loaded the same way when it is set; otherwise they travel to
/update_weights_from_tensor as a base64 safetensors blob, which only the embedded server reads (SGLang's
own serializer passes CUDA IPC handles between processes of one machine).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from safetensors import safe_open

from april_ext.model.checkpoint import safetensors_files, save_safetensors
from april_ext.protocol.sglang_wire import encode_named_tensors
from april_ext.sglang.errors import SGLangHTTPError
from april_ext.sglang.workers import WorkerPool

WeightsSource = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | str | os.PathLike[str]


async def push_weights(workers: WorkerPool, weights: WeightsSource, version: int,
                       weight_sync_dir: str | None, *, flush_cache: bool = True) -> list[str]:
    """Loads the weights on every worker with weight_version str(version), flushing their caches unless
    flush_cache=False (SGLang fails a flush while requests are held by an in_place pause) and keeping their
    requests (SGLang holds the update until they end, or runs it at once while paused); returns the names
    loaded."""
    if not isinstance(weights, (str, os.PathLike)):
        tensors = dict(weights.items() if isinstance(weights, Mapping) else weights)
        if weight_sync_dir is None:
            payload = {"serialized_named_tensors": [encode_named_tensors(tensors)], "load_format": None}
            await _load(workers, "/update_weights_from_tensor", payload, version, flush_cache)
            return sorted(tensors)
        save_safetensors(tensors, weight_sync_dir)
        weights = weight_sync_dir
    path = os.path.abspath(os.fspath(weights))
    names = []
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as handle:
            names.extend(handle.keys())
    await _load(workers, "/update_weights_from_disk", {"model_path": path, "load_format": None}, version,
                flush_cache)
    return sorted(names)


async def _load(workers: WorkerPool, endpoint: str, payload: dict[str, Any], version: int,
                flush_cache: bool) -> None:
    """Each worker gets the fields its SGLang release defines (0.4.x has no weight_version, flush_cache came
    with 0.5.x, ...); a server without weight versions still loads the weights, and the adapter tags their
    tokens with its own version."""
    payload.update(weight_version=str(version), flush_cache=flush_cache, abort_all_requests=False)
    for url, answer in await workers.broadcast(endpoint, lambda profile: profile.fields(endpoint, payload)):
        if not isinstance(answer, dict) or not answer.get("success", False):
            raise SGLangHTTPError(f"{url}{endpoint}", 200, f"weight update failed: {answer!r}")


__all__ = ["WeightsSource", "push_weights"]
