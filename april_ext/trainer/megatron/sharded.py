"""Weights of a GPTModel split across tensor- and pipeline-parallel ranks, in and out in HF names.

In: every rank converts the HF tensors it needs (``hf_to_megatron``) and copies its own slice into its
parameters: tensor-parallel parameters carry megatron-core's ``partition_dim`` (0: column-parallel,
the vocabulary and output columns; 1: row-parallel, input columns); the fused SwiGLU ``linear_fc1``
holds [gate_r; up_r] on rank r, not a plain chunk of [gate; up]. A pipeline stage holds the layers
``layer_number - 1`` of its decoder (global numbering), the embedding on the first stage, the final norm
and the output layer on the last.

Out: ``iter_hf_weights`` yields the whole model in HF names one tensor at a time on every rank: the
pipeline stages take turns; the stage's tensor-parallel ranks gather one parameter, convert it and
broadcast it to the other stages, so no rank holds more than one full parameter (plus its shards) at once.
Collective: every rank of the world must iterate it to the end.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from april_ext.errors import InvalidArgumentError
from april_ext.model import ModelConfig
from april_ext.trainer.megatron.conversion import hf_to_megatron, split_qkv

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")

# Megatron (local spec) -> HF suffix of the parameters that are renamed one to one.
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}
_MODEL_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def global_names(gpt: nn.Module) -> dict[str, str]:
    """This stage's parameter names -> the names of the whole model (decoder layers renumbered globally)."""
    offsets = {i: layer.layer_number - 1 for i, layer in enumerate(gpt.decoder.layers)}
    names = {}
    for name, _ in gpt.named_parameters():
        match = _LAYER.match(name)
        names[name] = f"decoder.layers.{offsets[int(match[1])]}.{match[2]}" if match else name
    return names


def _tp_slice(full: torch.Tensor, param: torch.Tensor, name: str, rank: int, size: int) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return full
    dim = param.partition_dim
    if name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")):
        gate, up = full.chunk(2, dim=0)
        return torch.cat((gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]), dim=0)
    return full.chunk(size, dim=dim)[rank]


@torch.no_grad()
def load_hf_weights(gpt: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig) -> None:
    """Copies this rank's slice of the HF-named ``weights`` (the whole model) into ``gpt``'s parameters."""
    from megatron.core import parallel_state

    full = hf_to_megatron(weights, config)
    if config.tie_word_embeddings:
        # The last stage of a pipeline keeps its own copy of the shared embedding as output_layer.weight.
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    rank = parallel_state.get_tensor_model_parallel_rank()
    size = parallel_state.get_tensor_model_parallel_world_size()
    for local, name in global_names(gpt).items():
        param = gpt.get_parameter(local)
        if name not in full:
            raise InvalidArgumentError(f"the HF weights have nothing for {name!r}")
        shard = _tp_slice(full[name], param, name, rank, size)
        if tuple(shard.shape) != tuple(param.shape):
            raise InvalidArgumentError(f"{name!r}: this rank's slice has shape {tuple(shard.shape)}, the parameter "
                                       f"{tuple(param.shape)}")
        param.copy_(shard)


def _gather_tp(param: torch.Tensor, name: str) -> torch.Tensor:
    """The whole parameter from its tensor-parallel shards, built in place: each rank broadcasts its shard
    into its slice of the one full-size tensor (through a shard-sized buffer where the slice is not
    contiguous), so at most one shard is held beside it (an all-gather holds all of them, gloo's into-tensor
    variant a second full-size buffer)."""
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return param.detach()
    group = parallel_state.get_tensor_model_parallel_group()
    me, dim = parallel_state.get_tensor_model_parallel_rank(), param.partition_dim
    local = param.detach()
    shape = list(local.shape)
    shape[dim] *= size
    full = torch.empty(shape, dtype=local.dtype, device=local.device)
    # A rank's fused SwiGLU shard [gate_r; up_r] goes to two places of [gate; up]; any other shard to one.
    pieces = local.chunk(2, dim=0) if name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")) else (local,)
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
    if suffix.startswith("mlp.linear_fc1."):
        kind = suffix.rsplit(".", 1)[1]
        gate, up = tensor.chunk(2, dim=0)
        return [(f"{prefix}mlp.gate_proj.{kind}", gate), (f"{prefix}mlp.up_proj.{kind}", up)]
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
    names = global_names(gpt)
    for stage in range(pp_size):
        mine = stage == pp_rank
        local = [(n, p) for n, p in gpt.named_parameters()
                 if not (config.tie_word_embeddings and names[n] == "output_layer.weight")] if mine else []
        listing = [[(names[n], p.dtype) for n, p in local]]
        if pp_size > 1:
            dist.broadcast_object_list(listing, src=ranks[stage], group=pp_group)
        for i, (name, dtype) in enumerate(listing[0]):
            if mine:
                full = _gather_tp(local[i][1], local[i][0])
            if pp_size > 1:
                # The gathered shape is known only on the stage that holds the parameter.
                shape = [tuple(full.shape) if mine else None]
                dist.broadcast_object_list(shape, src=ranks[stage], group=pp_group)
                if not mine:
                    full = torch.empty(shape[0], dtype=dtype, device=_device())
                full = full.contiguous()
                dist.broadcast(full, src=ranks[stage], group=pp_group)
            yield from _to_hf(name, full, config)
            del full  # not held while the next parameter is gathered


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


__all__ = ["global_names", "iter_hf_weights", "load_hf_weights"]
