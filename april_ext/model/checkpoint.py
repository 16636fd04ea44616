"""Hugging Face checkpoint directories: config.json plus safetensors (single file or sharded with an index)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from april_ext.errors import ConfigError, InvalidArgumentError
from april_ext.model.config import ModelConfig
from april_ext.model.llama import LlamaForCausalLM

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def safetensors_files(directory: str | os.PathLike[str]) -> list[str]:
    """The safetensors files of a checkpoint directory: the index's shards, else model.safetensors,
    else every *.safetensors file."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise InvalidArgumentError(f"checkpoint path {directory!r} is not a directory")
    index = os.path.join(directory, _INDEX)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as handle:
                shards = sorted(set(json.load(handle)["weight_map"].values()))
            return [os.path.join(directory, shard) for shard in shards]
        except (ValueError, LookupError, TypeError, AttributeError) as exc:
            raise InvalidArgumentError(f"{index} is not a valid index (JSON with a weight_map of file names): "
                                       f"{exc!r}") from exc
    if os.path.exists(os.path.join(directory, _SINGLE)):
        return [os.path.join(directory, _SINGLE)]
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise InvalidArgumentError(f"checkpoint directory {directory!r} holds no .safetensors file")
    return [os.path.join(directory, f) for f in files]


def iter_safetensors(directory: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) of every tensor of a checkpoint directory, one file open at a time. A file that
    is not safetensors (truncated, garbage) raises InvalidArgumentError naming it."""
    for file in safetensors_files(directory):
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except SafetensorError as exc:
            raise InvalidArgumentError(f"{file} is not a readable safetensors file ({exc})") from exc


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
    """Writes `directory/filename` (host copies of the tensors), creating the directory."""
    os.makedirs(directory, exist_ok=True)
    host = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    # Write to a temporary name first so a reader never sees a half-written file.
    final = os.path.join(directory, filename)
    partial = final + ".partial"
    save_file(host, partial, metadata={"format": "pt"})
    os.replace(partial, final)
