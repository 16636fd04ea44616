"""Weights of a GPTModel split across tensor-, pipeline- and expert-parallel ranks, in and out in HF names.

In: every rank converts the HF tensors it needs (``hf_to_megatron``) and copies its own slice into its
parameters: tensor-parallel parameters carry megatron-core's ``partition_dim`` (0: column-parallel,
the vocabulary and output columns; 1: row-parallel, input columns); the fused SwiGLU ``linear_fc1``
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

import re
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from april_ext.errors import InvalidArgumentError
from april_ext.model import ModelConfig
from april_ext.trainer.megatron.conversion import hf_to_megatron, split_qkv

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


def _tp_slice(full: torch.Tensor, param: torch.Tensor, name: str) -> torch.Tensor:
    rank, size, _ = _tp_group(name)
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return full
    dim = param.partition_dim
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
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
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for local, name in global_names(gpt).items():
        param = gpt.get_parameter(local)
        if name not in full:
            raise InvalidArgumentError(f"the HF weights have nothing for {name!r}")
        tensor = full[name]
        if name in _VOCAB_ROWS and param.shape[0] * tp > tensor.shape[0]:
            tensor = torch.cat((tensor, tensor.new_zeros(param.shape[0] * tp - tensor.shape[0], *tensor.shape[1:])))
        shard = _tp_slice(tensor, param, name)
        if tuple(shard.shape) != tuple(param.shape):
            raise InvalidArgumentError(f"{name!r}: this rank's slice has shape {tuple(shard.shape)}, the parameter "
                                       f"{tuple(param.shape)}")
        param.copy_(shard)


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
    names = global_names(gpt)
    n_local = _local_experts(gpt)
    for stage in range(pp_size):
        mine = stage == pp_rank
        local = [(n, p) for n, p in gpt.named_parameters()
                 if not (config.tie_word_embeddings and names[n] == "output_layer.weight")] if mine else []
        count = [len(local)]
        if pp_size > 1:
            dist.broadcast_object_list(count, src=ranks[stage], group=pp_group)
        for i in range(count[0]):
            if mine:
                pieces = _gather(local[i][1], local[i][0], names[local[i][0]], n_local, config)
            if pp_size > 1:
                # Names and shapes are known only on the stage that holds the parameter.
                meta = [[(n, tuple(t.shape), t.dtype) for n, t in pieces] if mine else None]
                dist.broadcast_object_list(meta, src=ranks[stage], group=pp_group)
                if not mine:
                    pieces = [(n, torch.empty(shape, dtype=dtype, device=_device())) for n, shape, dtype in meta[0]]
                for _, tensor in pieces:
                    dist.broadcast(tensor.contiguous() if mine else tensor, src=ranks[stage], group=pp_group)
            while pieces:
                name, tensor = pieces.pop(0)
                yield from _to_hf(name, tensor, config)
                del tensor  # not held while the next parameter is gathered


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


__all__ = ["global_names", "is_expert", "iter_hf_weights", "load_hf_weights", "padded_vocab_size"]
