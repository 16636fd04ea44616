"""Weights of a GPTModel split across tensor-, pipeline- and expert-parallel ranks, in and out in HF names.

In: every rank reads, parameter by parameter, only the rows / columns of the HF tensors its own slice is
made of (from tensors in memory, or a checkpoint directory's safetensors through ``get_slice``), converts
them (``fuse_qkv``, [gate; up]) and copies them into its parameters: tensor-parallel parameters carry
megatron-core's ``partition_dim`` (0: column-parallel, the vocabulary and output columns; 1: row-parallel,
input columns); the fused SwiGLU ``linear_fc1``
holds [gate_r; up_r] on rank r, not a plain chunk of [gate; up]. A pipeline stage holds the layers
``layer_number - 1`` of its decoder (global numbering), the embedding on the first stage, the final norm
and the output layer on the last. Expert-parallel rank r holds experts [r * n_local, (r + 1) * n_local)
of every MoE layer as ``local_experts.0 .. n_local - 1``, each split across the expert-tensor-parallel
ranks. A vocabulary padded to a multiple of the tensor-parallel size (``padded_vocab_size``) gets zero
rows past the real ones in the embedding and the output layer.

Out: ``iter_hf_weights`` yields the whole model in HF names one tensor at a time on every rank: the
pipeline stages take turns; the stage's tensor-parallel ranks gather one parameter (an expert's across the
expert-parallel ranks too: one tensor per expert), convert it, drop the vocabulary padding and broadcast it
to the other stages, so no rank holds more than one full parameter (the expert-parallel size times one
expert's, for experts) plus its shards at once. Collective: every rank of the world must iterate it to the
end.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from april_ext.errors import InvalidArgumentError
from april_ext.model import ModelConfig
from april_ext.model.checkpoint import safetensors_files
from april_ext.trainer.megatron.conversion import fuse_qkv, hf_names, split_qkv

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_EXPERT_SUFFIX = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")

# Megatron (local spec) -> HF suffix of the parameters that are renamed one to one.
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}
_MODEL_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
# The parameters with one row per vocabulary entry (padded past the real vocabulary).
_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int) -> int:
    """The vocabulary rounded up to a multiple of the tensor-parallel size (Megatron's
    ``make_vocab_size_divisible_by`` padding with a divisor of 1), so every rank holds an equal slice."""
    return -(-vocab_size // tensor_model_parallel_size) * tensor_model_parallel_size


def is_expert(name: str) -> bool:
    """Whether the parameter ``name`` belongs to one routed expert (held by one expert-parallel rank)."""
    return _EXPERT.match(name) is not None


def global_names(gpt: nn.Module) -> dict[str, str]:
    """This rank's parameter names -> the names of the whole model (decoder layers renumbered globally,
    local experts numbered by their expert-parallel rank)."""
    from megatron.core import parallel_state

    offsets = {i: layer.layer_number - 1 for i, layer in enumerate(gpt.decoder.layers)}
    first_expert = parallel_state.get_expert_model_parallel_rank() * _local_experts(gpt)
    names = {}
    for name, _ in gpt.named_parameters():
        match = _LAYER.match(name)
        full = f"decoder.layers.{offsets[int(match[1])]}.{match[2]}" if match else name
        expert = _EXPERT.match(full)
        names[name] = f"{expert[1]}{first_expert + int(expert[2])}{expert[3]}" if expert else full
    return names


def _local_experts(gpt: nn.Module) -> int:
    counts = {layer.mlp.experts.num_local_experts for layer in gpt.decoder.layers if hasattr(layer.mlp, "experts")}
    return counts.pop() if counts else 0


def _tp_group(name: str) -> tuple[int, int, dist.ProcessGroup]:
    """(rank, size, group) of the tensor-parallel split of ``name``: the expert-tensor-parallel one for
    experts."""
    from megatron.core import parallel_state as ps

    if is_expert(name):
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group())


HFWeights = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor] | str | os.PathLike[str]
"""HF-named weights of the whole model: named tensors in memory, or a checkpoint directory (safetensors)."""


class _Source:
    """Reads an HF tensor, or rows / columns of it, by name: views of tensors in memory, or just the bytes
    asked for from a checkpoint directory's safetensors (``get_slice``; each file is opened for one read,
    so no more of it stays mapped)."""

    def __init__(self, weights: HFWeights) -> None:
        self._files: dict[str, str] = {}
        self._tensors: Mapping[str, torch.Tensor] = {}
        if isinstance(weights, (str, os.PathLike)):
            for file in safetensors_files(weights):
                with safe_open(file, framework="pt") as handle:
                    self._files.update(dict.fromkeys(handle.keys(), file))
        else:
            self._tensors = dict(weights.items() if isinstance(weights, Mapping) else weights)

    def names(self) -> set[str]:
        return set(self._files or self._tensors)

    def read(self, name: str, needed_by: str, dim: int = 0, start: int | None = None,
             stop: int | None = None) -> torch.Tensor:
        """Rows (``dim`` 0) or columns (``dim`` 1) [start, stop) of ``name``; all of it when start is None."""
        if name not in self._files and name not in self._tensors:
            raise InvalidArgumentError(f"the HF weights have nothing for {name!r} (needed for {needed_by!r})")
        if name in self._tensors:
            tensor = self._tensors[name]
            return tensor if start is None else tensor.narrow(dim, start, stop - start)  # type: ignore[operator]
        with safe_open(self._files[name], framework="pt") as handle:
            if start is None:
                return handle.get_tensor(name)
            part = handle.get_slice(name)
            return part[start:stop] if dim == 0 else part[:, start:stop]


def _hf_parts(name: str, config: ModelConfig) -> tuple[str, list[str]]:
    """How the Megatron parameter ``name`` (global) is made of HF tensors: ("one", [hf]), ("qkv", [q, k, v])
    or ("fc1", [gate, up])."""
    if name in _MODEL_NAMES:
        hf = _MODEL_NAMES[name]
        return "one", ["model.embed_tokens.weight" if hf == "lm_head.weight" and config.tie_word_embeddings else hf]
    match = _LAYER.match(name)
    if match is None:
        raise InvalidArgumentError(f"no HF name for the Megatron parameter {name!r}")
    prefix, suffix = f"model.layers.{match[1]}.", match[2]
    kind = suffix.rsplit(".", 1)[1]
    if suffix.startswith("self_attention.linear_qkv."):
        return "qkv", [f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv"]
    expert = _EXPERT_SUFFIX.match(suffix)
    mlp = f"{prefix}mlp.experts.{expert[1]}." if expert else f"{prefix}mlp."
    if expert and expert[2] == "linear_fc2":
        return "one", [f"{mlp}down_proj.{kind}"]
    if expert or suffix.startswith("mlp.linear_fc1."):
        return "fc1", [f"{mlp}gate_proj.{kind}", f"{mlp}up_proj.{kind}"]
    if suffix in _LAYER_NAMES:
        return "one", [prefix + _LAYER_NAMES[suffix]]
    raise InvalidArgumentError(f"no HF name for the Megatron parameter {name!r}")


def _pieces(source: _Source, param: torch.Tensor, name: str,
            config: ModelConfig) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """This rank's slice of the Megatron parameter ``name``, read from only the HF rows / columns it holds,
    as (what, part of ``param``, its values): the fused SwiGLU ``linear_fc1`` as its gate rows, then its up
    rows (so no fused copy is made), any other parameter whole."""
    kind, parts = _hf_parts(name, config)
    if kind == "fc1":
        rank, size, _ = _tp_group(name)
        split = getattr(param, "tensor_model_parallel", False) and size > 1
        half = param.shape[0] // 2
        for k, (what, hf) in enumerate(zip(("gate rows", "up rows"), parts)):
            yield (what, param.narrow(0, k * half, half),
                   source.read(hf, name, 0, rank * half, (rank + 1) * half) if split else source.read(hf, name))
        return
    yield "slice", param, _shard(source, param, name, config, kind, parts)


def _shard(source: _Source, param: torch.Tensor, name: str, config: ModelConfig, kind: str,
           parts: list[str]) -> torch.Tensor:
    """This rank's slice of the Megatron parameter ``name`` (not the fused SwiGLU, see _pieces)."""
    rank, size, _ = _tp_group(name)
    split = getattr(param, "tensor_model_parallel", False) and size > 1
    if kind == "qkv":
        groups = config.num_key_value_heads // size if split else config.num_key_value_heads
        assert config.head_dim is not None and groups is not None
        q_rows = groups * (config.num_attention_heads // config.num_key_value_heads) * config.head_dim
        kv_rows = groups * config.head_dim
        q, k, v = (source.read(hf, name, 0, rank * rows, (rank + 1) * rows) if split else source.read(hf, name)
                   for hf, rows in zip(parts, (q_rows, kv_rows, kv_rows)))
        return fuse_qkv(q, k, v, config, groups=groups)
    if not split:
        tensor = source.read(parts[0], name)
    else:
        dim, n = param.partition_dim, param.shape[param.partition_dim]
        start, stop = rank * n, (rank + 1) * n
        rows = config.vocab_size if name in _VOCAB_ROWS else None
        if rows is not None and stop > rows:
            # Past the real vocabulary: zero rows (padded_vocab_size).
            real = source.read(parts[0], name, 0, min(start, rows), rows)
            return torch.cat((real, real.new_zeros(stop - max(start, rows), *real.shape[1:])))
        tensor = source.read(parts[0], name, dim, start, stop)
    if name in _VOCAB_ROWS and not split and param.shape[0] > tensor.shape[0]:
        tensor = torch.cat((tensor, tensor.new_zeros(param.shape[0] - tensor.shape[0], *tensor.shape[1:])))
    return tensor


@torch.no_grad()
def load_hf_weights(gpt: nn.Module, weights: HFWeights, config: ModelConfig) -> None:
    """Copies this rank's slice of the HF-named ``weights`` (the whole model: named tensors, or a checkpoint
    directory) into ``gpt``'s parameters, one parameter at a time, reading only the rows / columns this
    rank holds (its stage's layers, its tensor-parallel slice, its experts): a rank holds about one of its
    parameters beside the model, never a converted copy of the whole. HF names this config has no parameter
    for are an error."""
    source = _Source(weights)
    unknown = sorted(source.names() - hf_names(config) - {"lm_head.weight"})
    if unknown:
        raise InvalidArgumentError(f"the HF weights hold {len(unknown)} names this config has no parameter for, "
                                   f"e.g. {unknown[:3]}")
    for local, name in global_names(gpt).items():
        param = gpt.get_parameter(local)
        for what, target, values in _pieces(source, param, name, config):
            if tuple(values.shape) != tuple(target.shape):
                raise InvalidArgumentError(f"{name!r}: this rank's {what}: shape {tuple(values.shape)} in the HF "
                                           f"weights, {tuple(target.shape)} in the parameter")
            target.copy_(values)
            del values  # before the next piece is read


def _gather_tp(param: torch.Tensor, name: str) -> torch.Tensor:
    """The whole parameter from its tensor-parallel shards, built in place: each rank broadcasts its shard
    into its slice of the one full-size tensor (through a shard-sized buffer where the slice is not
    contiguous), so at most one shard is held beside it (an all-gather holds all of them, gloo's into-tensor
    variant a second full-size buffer)."""
    me, size, group = _tp_group(name)
    local = param.detach()
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return local
    dim = param.partition_dim
    shape = list(local.shape)
    shape[dim] *= size
    full = torch.empty(shape, dtype=local.dtype, device=local.device)
    # A rank's fused SwiGLU shard [gate_r; up_r] goes to two places of [gate; up]; any other shard to one.
    pieces = local.chunk(2, dim=0) if name.endswith(("linear_fc1.weight", "linear_fc1.bias")) else (local,)
    for r in range(size):
        for k, piece in enumerate(pieces):
            n = piece.shape[dim]
            target = full.narrow(dim, (k * size + r) * n, n)
            if target.is_contiguous():
                if r == me:
                    target.copy_(piece)
                dist.broadcast(target, group_src=r, group=group)
            else:
                buffer = piece.contiguous() if r == me else torch.empty(target.shape, dtype=local.dtype,
                                                                        device=local.device)
                dist.broadcast(buffer, group_src=r, group=group)
                target.copy_(buffer)
    return full


def _gather(param: torch.Tensor, local: str, name: str, n_local: int,
            config: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """The whole parameter ``name`` (this rank's ``local``), in global Megatron names: gathered across the
    tensor-parallel ranks without the vocabulary padding; an expert's from every expert-parallel rank."""
    from megatron.core import parallel_state

    full = _gather_tp(param, name)
    if name in _VOCAB_ROWS:
        full = full[:config.vocab_size]
    ep = parallel_state.get_expert_model_parallel_world_size()
    if not is_expert(name) or ep == 1:
        return [(name, full)]
    pieces = [torch.empty_like(full) for _ in range(ep)]
    dist.all_gather(pieces, full.contiguous(), group=parallel_state.get_expert_model_parallel_group())
    expert = _EXPERT.match(local)
    return [(f"{_EXPERT.match(name)[1]}{r * n_local + int(expert[2])}{expert[3]}", piece)
            for r, piece in enumerate(pieces)]


def _to_hf(name: str, tensor: torch.Tensor, config: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """One whole Megatron parameter (global name) -> its HF tensors."""
    if name in _MODEL_NAMES:
        return [(_MODEL_NAMES[name], tensor)]
    match = _LAYER.match(name)
    if match is None:
        raise InvalidArgumentError(f"no HF name for the Megatron parameter {name!r}")
    prefix, suffix = f"model.layers.{match[1]}.", match[2]
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = split_qkv(tensor, config)
        return [(f"{prefix}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v))]
    expert = _EXPERT_SUFFIX.match(suffix)
    mlp = f"{prefix}mlp.experts.{expert[1]}." if expert else f"{prefix}mlp."
    if expert and expert[2] == "linear_fc2":
        return [(f"{mlp}down_proj.{expert[3]}", tensor)]
    if expert or suffix.startswith("mlp.linear_fc1."):
        kind = suffix.rsplit(".", 1)[1]
        gate, up = tensor.chunk(2, dim=0)
        return [(f"{mlp}gate_proj.{kind}", gate), (f"{mlp}up_proj.{kind}", up)]
    if suffix in _LAYER_NAMES:
        return [(prefix + _LAYER_NAMES[suffix], tensor)]
    raise InvalidArgumentError(f"no HF name for the Megatron parameter {name!r}")


def iter_hf_weights(gpt: nn.Module, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model in HF names, one tensor at a time, on every rank (a collective; see the module
    docstring). A tied config yields no ``lm_head.weight``. Tensors are fresh copies or views of them."""
    from megatron.core import parallel_state

    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ranks = dist.get_process_group_ranks(pp_group)
    for stage in range(pp_size):
        mine = stage == pp_rank
        local = _exported_parameters(gpt, config) if mine else []
        count = [len(local)]
        if pp_size > 1:
            dist.broadcast_object_list(count, src=ranks[stage], group=pp_group)
        for i in range(count[0]):
            pieces = _gather(*local[i], config) if mine else []
            if pp_size > 1:
                # Names and shapes are known only on the stage that holds the parameter.
                meta = [[(n, tuple(t.shape), t.dtype) for n, t in pieces] if mine else None]
                dist.broadcast_object_list(meta, src=ranks[stage], group=pp_group)
                if not mine:
                    pieces = [(n, torch.empty(shape, dtype=dtype, device=_device())) for n, shape, dtype in meta[0]]
                for _, tensor in pieces:
                    dist.broadcast(tensor.contiguous() if mine else tensor, src=ranks[stage], group=pp_group)
            yield from _converted(pieces, config)


def iter_stage_hf_weights(gpt: nn.Module, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's part of the model in HF names, one tensor at a time, on every rank of the stage
    (a collective of the stage's tensor- and expert-parallel ranks only: the stages export at once, or in
    turn, each without the others). Over every stage, the tensors of ``iter_hf_weights``."""
    for param in _exported_parameters(gpt, config):
        yield from _converted(_gather(*param, config), config)


def _exported_parameters(gpt: nn.Module, config: ModelConfig) -> list[tuple[torch.Tensor, str, str, int]]:
    """This stage's exported parameters (all but a tied output layer), as ``_gather``'s arguments but the config."""
    names = global_names(gpt)
    n_local = _local_experts(gpt)
    return [(p, n, names[n], n_local) for n, p in gpt.named_parameters()
            if not (config.tie_word_embeddings and names[n] == "output_layer.weight")]


def _converted(pieces: list[tuple[str, torch.Tensor]], config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of gathered parameters, each dropped once yielded."""
    while pieces:
        name, tensor = pieces.pop(0)
        yield from _to_hf(name, tensor, config)
        del tensor  # not held while the next parameter is gathered


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


__all__ = ["HFWeights", "global_names", "is_expert", "iter_hf_weights", "iter_stage_hf_weights", "load_hf_weights",
           "padded_vocab_size"]
