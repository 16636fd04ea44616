"""Hugging Face checkpoint directories: config.json plus safetensors (single file or sharded with an index)."""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from april_ext.errors import ConfigError, CorruptStateError, InvalidArgumentError, PersistenceError
from april_ext.model.config import ModelConfig
from april_ext.model.llama import LlamaForCausalLM
from april_ext.persistence import atomic_write, atomic_write_json, ensure_dir, fsync_dir

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# safetensors' names of the torch dtypes a checkpoint may hold.
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def safetensors_files(directory: str | os.PathLike[str]) -> list[str]:
    """The safetensors files of a checkpoint directory: the index's shards (PersistenceError naming one that
    is missing), else model.safetensors, else every *.safetensors file."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise InvalidArgumentError(f"checkpoint path {directory!r} is not a directory")
    index = os.path.join(directory, _INDEX)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as handle:
                weight_map = dict(json.load(handle)["weight_map"])
        except OSError as err:
            raise PersistenceError(f"reading {index!r} failed: {err}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CorruptStateError(f"{index}: not a safetensors index ({type(err).__name__}: {err})") from None
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            _check_contained(directory, shard, index)
            _check_shard(directory, shard, weight_map)
        return [os.path.join(directory, shard) for shard in shards]
    if os.path.exists(os.path.join(directory, _SINGLE)):
        return [os.path.join(directory, _SINGLE)]
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise InvalidArgumentError(f"checkpoint directory {directory!r} holds no .safetensors file")
    return [os.path.join(directory, f) for f in files]


def _check_contained(directory: str, shard: Any, index: str) -> None:
    """PersistenceError for a shard name that is not a file name inside ``directory``: an index listing an
    absolute path, ``..`` or a link out of the directory would have the loader open and parse any file."""
    if not isinstance(shard, str) or not shard:
        raise PersistenceError(f"{index}: shard {shard!r} is not a file name; the index may name only files "
                               f"inside {directory}")
    root = os.path.realpath(directory)
    if os.path.isabs(shard) or os.path.commonpath([root, os.path.realpath(os.path.join(root, shard))]) != root:
        raise PersistenceError(f"{index}: shard {shard!r} lies outside the checkpoint directory {directory}; the "
                               "index may name only files inside it (relative names without '..', no links out)")


def _check_shard(directory: str, shard: str, weight_map: dict[str, str]) -> None:
    """PersistenceError naming a shard the index lists that the directory lacks, with the tensors it holds:
    every layout needs them all (read whole, or sliced by the ranks whose parameters they make)."""
    if os.path.isfile(os.path.join(directory, shard)):
        return
    held = sorted(name for name, file in weight_map.items() if file == shard)
    raise PersistenceError(f"{os.path.join(directory, shard)}: missing from the checkpoint; {_INDEX} puts "
                           f"{len(held)} tensor(s) in it, such as {', '.join(held[:3])}, and the model "
                           f"needs every one: restore the file (or the whole directory)")


def iter_safetensors(directory: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) of every tensor of a checkpoint directory, one file open at a time. A
    malformed file (truncated, garbage, a damaged header) raises CorruptStateError naming it; damage
    inside the tensor data is found only by a checksum (training.CheckpointManager keeps them)."""
    for file in safetensors_files(directory):
        yield from iter_safetensors_file(file)


def iter_safetensors_file(file: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) of one safetensors file; CorruptStateError naming it when it is malformed."""
    file = os.fspath(file)
    try:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
    except SafetensorError as err:
        raise CorruptStateError(f"{file}: not a valid safetensors file ({err})") from None
    except OSError as err:
        raise PersistenceError(f"reading {file!r} failed: {err}") from None


def load_pretrained(directory: str | os.PathLike[str], *, device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None) -> LlamaForCausalLM:
    """Builds the model from `directory/config.json` and loads its safetensors weights."""
    config = ModelConfig.from_pretrained(directory)
    model = LlamaForCausalLM(config, device=device, dtype=dtype)
    model.load_weights(iter_safetensors(directory))
    return model


def save_pretrained(model: LlamaForCausalLM, directory: str | os.PathLike[str]) -> None:
    """Writes config.json and model.safetensors (HF names; a tied model stores no lm_head.weight)."""
    if not isinstance(model, LlamaForCausalLM):
        raise ConfigError(f"save_pretrained expects a LlamaForCausalLM, got {type(model).__name__}")
    model.config.replace(dtype=str(model.lm_head.weight.dtype).removeprefix("torch.")).save_pretrained(directory)
    save_safetensors(dict(model.named_parameters()), directory)


def save_safetensors(tensors: Mapping[str, torch.Tensor], directory: str | os.PathLike[str],
                     filename: str = _SINGLE) -> None:
    """Writes `directory/filename` (host copies of the tensors) atomically, creating the directory."""
    ensure_dir(directory)
    host = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    atomic_write(os.path.join(directory, filename), lambda temp: save_file(host, temp, metadata={"format": "pt"}))


def shard_name(k: int, n: int) -> str:
    """Hugging Face's name of shard ``k`` (from 1) of ``n``."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def save_safetensors_sharded(tensors: Iterable[tuple[str, torch.Tensor]], directory: str | os.PathLike[str],
                             shard_bytes: int) -> list[str]:
    """Writes a stream of named tensors as Hugging Face's sharded layout (``model-0000k-of-0000n.safetensors``
    of at most ``shard_bytes`` each, one larger tensor alone in its shard, plus ``model.safetensors.index.json``)
    into ``directory``, holding at most one shard's host copies at a time; removes the safetensors files of
    an earlier write there. Returns the names in stream order.

    Each shard is serialized here, writing every tensor's bytes straight from its host copy (safetensors'
    ``save_file`` builds the whole file in memory first, a second copy of the shard)."""
    if shard_bytes <= 0:
        raise InvalidArgumentError(f"shard_bytes must be > 0, got {shard_bytes}")
    directory = ensure_dir(directory)
    staged: list[tuple[str, list[str]]] = []
    bucket: list[tuple[str, torch.Tensor]] = []
    size = total = 0
    seen: set[str] = set()

    def flush() -> None:
        path = os.path.join(directory, f".model-{len(staged) + 1:05d}.safetensors.staged")
        atomic_write(path, lambda temp: _write_safetensors(temp, bucket))
        staged.append((path, [name for name, _ in bucket]))
        bucket.clear()

    try:
        for name, tensor in tensors:
            if name in seen:
                raise InvalidArgumentError(f"the weights hold {name!r} twice")
            seen.add(name)
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > shard_bytes:
                flush()
                size = 0
            bucket.append((name, _host_copy(tensor)))
            size += nbytes
            total += nbytes
            del tensor
        if bucket or not staged:
            flush()
        n = len(staged)
        weight_map = {}
        for k, (path, names) in enumerate(staged, start=1):
            os.replace(path, os.path.join(directory, shard_name(k, n)))
            weight_map.update(dict.fromkeys(names, shard_name(k, n)))
        fsync_dir(directory)
    except BaseException:
        for path, _ in staged:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        raise
    atomic_write_json(os.path.join(directory, _INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map},
                      indent=2)
    keep = set(weight_map.values())
    for entry in os.listdir(directory):
        if entry.endswith(".safetensors") and entry not in keep:
            os.remove(os.path.join(directory, entry))
    return list(weight_map)


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor holding only ``tensor``'s bytes (a view into a larger storage, e.g. q of a
    fused qkv, is copied so that the larger one is not kept alive)."""
    if tensor.dtype not in _DTYPES:
        raise InvalidArgumentError(f"safetensors cannot hold dtype {tensor.dtype}; allowed: "
                                   f"{sorted(map(str, _DTYPES))}")
    host = tensor.detach().to("cpu").contiguous()
    if host.untyped_storage().nbytes() != host.numel() * host.element_size():
        host = host.clone()
    return host


def _write_safetensors(path: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """The safetensors format: an 8-byte little-endian header length, the JSON header (padded to 8
    bytes), then each tensor's little-endian bytes in header order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for _, tensor in tensors:
            if tensor.numel():
                handle.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
