"""The weight-update requests: from a checkpoint on disk, from tensors in the body (base64 of a safetensors blob:
encode_named_tensors, decode_named_tensors), a new version label, and the collective update from a trainer's
broadcast (its group, the update, the session around them).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from safetensors.torch import load as _load_safetensors
from safetensors.torch import save as _save_safetensors

from april_ext.errors import InvalidArgumentError
from april_ext.protocol.sglang_dialects import BASE_REQ_FIELDS, CURRENT, SGLangDialect
from april_ext.protocol.sglang_json import (
    base_fields,
    bool_field,
    check_keys,
    int_field,
    json_object,
    show,
    str_field,
)


@dataclass(frozen=True)
class WeightsFromDisk:
    model_path: str
    weight_version: str | None
    abort_all_requests: bool


def parse_weights_from_disk(body: Any, dialect: SGLangDialect = CURRENT) -> WeightsFromDisk:
    """The fields of the dialect's release, strictly. flush_cache, the scheduling hints (is_async, keep_pause,
    token_step) and the GPU ones (torch_empty_cache, recapture_cuda_graph) are accepted: the engine always
    drops its KV cache on a weight update, so requests in flight are recomputed under the new weights.
    manifest (a list of the files to load) is accepted only as null: the server loads the whole directory."""
    what = "/update_weights_from_disk"
    body = json_object(body, what)
    check_keys(body, dialect.disk_fields + (BASE_REQ_FIELDS if dialect.base_req else ()), what)
    base_fields(body, what)
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError(f"{what}: model_path must be a checkpoint directory path, got {show(path)}")
    if body.get("load_format") not in (None, "auto", "safetensors"):
        raise InvalidArgumentError(f"{what}: load_format must be null, 'auto' or 'safetensors', "
                                   f"got {show(body['load_format'])}")
    if body.get("manifest") is not None:
        raise InvalidArgumentError(f"{what}: manifest is not supported by the embedded server (allowed: null: "
                                   f"the whole directory is loaded), got {show(body['manifest'])}")
    for key in ("flush_cache", "is_async", "torch_empty_cache", "keep_pause", "recapture_cuda_graph"):
        bool_field(body, key, False, what)
    int_field(body, "token_step", what)
    return WeightsFromDisk(path, str_field(body, "weight_version", what),
                           bool_field(body, "abort_all_requests", False, what))


@dataclass(frozen=True)
class WeightsFromTensor:
    serialized: list[str]
    weight_version: str | None
    abort_all_requests: bool


def parse_weights_from_tensor(body: Any, dialect: SGLangDialect = CURRENT) -> WeightsFromTensor:
    what = "/update_weights_from_tensor"
    body = json_object(body, what)
    check_keys(body, dialect.tensor_fields + (BASE_REQ_FIELDS if dialect.base_req else ()), what)
    base_fields(body, what)
    blobs = body.get("serialized_named_tensors")
    if not isinstance(blobs, list) or not blobs or not all(isinstance(b, str) for b in blobs):
        raise InvalidArgumentError(f"{what}: serialized_named_tensors must be a non-empty list of base64 strings "
                                   "(one per TP rank)")
    if body.get("load_format") not in (None, "safetensors"):
        raise InvalidArgumentError(f"{what}: load_format must be null or 'safetensors' (base64 of a safetensors "
                                   f"blob); SGLang's own serializer formats are not readable here, got "
                                   f"{show(body['load_format'])}")
    _update_options(body, what)
    return WeightsFromTensor(blobs, str_field(body, "weight_version", what),
                             bool_field(body, "abort_all_requests", False, what))


def parse_weight_version(body: Any) -> tuple[str, bool]:
    what = "/update_weight_version"
    body = json_object(body, what)
    check_keys(body, ("new_version", "abort_all_requests", *BASE_REQ_FIELDS), what)
    base_fields(body, what)
    version = str_field(body, "new_version", what)
    if version is None:
        raise InvalidArgumentError(f"{what}: new_version is required")
    return version, bool_field(body, "abort_all_requests", True, what)


def _update_options(body: Mapping[str, Any], what: str) -> None:
    """The fields a tensor or distributed weight update shares: checked, with nothing to do here."""
    # The embedded engine has one model: "target" or "all" of it; "draft" names a speculative model it lacks.
    if body.get("selector") not in (None, "all", "target"):
        raise InvalidArgumentError(f"{what}: selector must be null, 'all' or 'target' (no draft model here), "
                                   f"got {show(body['selector'])}")
    # 0.5.15's form of the same choice: skipping a draft model is all there is to do without one.
    if body.get("disable_draft_model") not in (None, False, True):
        raise InvalidArgumentError(f"{what}: disable_draft_model must be null or a bool, got "
                                   f"{show(body['disable_draft_model'])}")
    bool_field(body, "flush_cache", True, what)
    bool_field(body, "torch_empty_cache", False, what)


# The collective weight update (SGLang's update from a trainer's broadcast) ------------------------------

DEFAULT_GROUP_NAME = "weight_update_group"
# The fields of the current release's request classes (BASE_REQ_FIELDS aside), by endpoint.
WEIGHT_GROUP_FIELDS: dict[str, tuple[str, ...]] = {
    "/init_weights_update_group": ("master_address", "master_port", "rank_offset", "world_size", "group_name",
                                   "backend"),
    "/update_weights_from_distributed": ("names", "dtypes", "shapes", "group_name", "flush_cache",
                                         "abort_all_requests", "weight_version", "load_format", "selector",
                                         "torch_empty_cache"),
    "/destroy_weights_update_group": ("group_name",),
    "/begin_weight_update": ("selector",),
    "/end_weight_update": (),
}


@dataclass(frozen=True)
class InitWeightsGroup:
    """/init_weights_update_group: join the group hosted by the trainer at master_address:master_port as rank
    rank_offset of world_size (one TP rank per server here)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


def parse_init_weights_group(body: Any) -> InitWeightsGroup:
    what = "/init_weights_update_group"
    body = json_object(body, what)
    check_keys(body, WEIGHT_GROUP_FIELDS[what] + BASE_REQ_FIELDS, what)
    base_fields(body, what)
    address = body.get("master_address")
    if not isinstance(address, str) or not address:
        raise InvalidArgumentError(f"{what}: master_address must be a host name or address, got {show(address)}")
    port, offset, size = (int_field(body, key, what) for key in ("master_port", "rank_offset", "world_size"))
    if port is None or not 1 <= port <= 65535:
        raise InvalidArgumentError(f"{what}: master_port must be an integer in [1, 65535], got {show(port)}")
    if size is None or size < 2:
        raise InvalidArgumentError(f"{what}: world_size must be an integer >= 2 (the trainer and at least this "
                                   f"server), got {show(size)}")
    if offset is None or not 1 <= offset < size:
        raise InvalidArgumentError(f"{what}: rank_offset must be an integer in [1, world_size) (rank 0 is the "
                                   f"trainer), got {show(offset)}")
    name = _group_name(body, what)
    backend = body.get("backend")
    backend = "nccl" if backend is None else backend
    if backend not in ("gloo", "nccl"):
        raise InvalidArgumentError(f"{what}: backend must be 'gloo' (CPU) or 'nccl' (GPU), got {show(backend)}")
    return InitWeightsGroup(address, port, offset, size, name, backend)


@dataclass(frozen=True)
class WeightsFromDistributed:
    """/update_weights_from_distributed: receive these tensors, in order, by broadcast from rank 0."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    weight_version: str | None
    abort_all_requests: bool


def parse_weights_from_distributed(body: Any) -> WeightsFromDistributed:
    """flush_cache and torch_empty_cache are accepted (the engine drops its KV cache on every update);
    load_format only as null (one broadcast per tensor); selector as the tensor update's."""
    what = "/update_weights_from_distributed"
    body = json_object(body, what)
    check_keys(body, WEIGHT_GROUP_FIELDS[what] + BASE_REQ_FIELDS, what)
    base_fields(body, what)
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise InvalidArgumentError(f"{what}: names must be a non-empty list of parameter names")
    if not isinstance(dtypes, list) or len(dtypes) != len(names) or not all(isinstance(d, str) for d in dtypes):
        raise InvalidArgumentError(f"{what}: dtypes must be a list of {len(names)} dtype names (one per name)")
    if not isinstance(shapes, list) or len(shapes) != len(names) or not all(
            isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s)
            for s in shapes):
        raise InvalidArgumentError(f"{what}: shapes must be a list of {len(names)} shapes (lists of integers >= 0)")
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"{what}: names must not repeat")
    if body.get("load_format") is not None:
        raise InvalidArgumentError(f"{what}: load_format must be null here (one broadcast per tensor), got "
                                   f"{show(body['load_format'])}")
    _update_options(body, what)
    return WeightsFromDistributed(names, dtypes, shapes, _group_name(body, what),
                                  str_field(body, "weight_version", what),
                                  bool_field(body, "abort_all_requests", False, what))


def parse_destroy_weights_group(body: Any) -> str:
    """/destroy_weights_update_group: the group name."""
    what = "/destroy_weights_update_group"
    body = json_object(body, what)
    check_keys(body, WEIGHT_GROUP_FIELDS[what] + BASE_REQ_FIELDS, what)
    base_fields(body, what)
    return _group_name(body, what)


def parse_weight_update_session(body: Any, what: str) -> None:
    """/begin_weight_update (selector) and /end_weight_update (no field): the session that brackets the
    tensor and distributed updates of the current release."""
    body = json_object(body, what)
    check_keys(body, WEIGHT_GROUP_FIELDS[what] + BASE_REQ_FIELDS, what)
    base_fields(body, what)
    if body.get("selector") not in (None, "all", "target"):
        raise InvalidArgumentError(f"{what}: selector must be null, 'all' or 'target' (no draft model here), "
                                   f"got {show(body['selector'])}")
    # 0.5.15's form of the same choice: skipping a draft model is all there is to do without one.
    if body.get("disable_draft_model") not in (None, False, True):
        raise InvalidArgumentError(f"{what}: disable_draft_model must be null or a bool, got "
                                   f"{show(body['disable_draft_model'])}")


def _group_name(body: Mapping[str, Any], what: str) -> str:
    name = body.get("group_name")
    if name is None:
        return DEFAULT_GROUP_NAME
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"{what}: group_name must be a non-empty string, got {show(name)}")
    return name


def encode_named_tensors(tensors: Mapping[str, Any]) -> str:
    """Named tensors -> base64 of a safetensors blob (what /update_weights_from_tensor accepts here)."""
    blob = _save_safetensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    return base64.b64encode(blob).decode("ascii")


def decode_named_tensors(blob: str) -> dict[str, Any]:
    try:
        return _load_safetensors(base64.b64decode(blob, validate=True))
    except Exception as exc:  # any parser failure means the client sent a malformed blob
        raise InvalidArgumentError("/update_weights_from_tensor: serialized_named_tensors[0] is not base64 of a "
                                   f"safetensors blob ({exc})") from exc


__all__ = [
    "DEFAULT_GROUP_NAME",
    "InitWeightsGroup",
    "WEIGHT_GROUP_FIELDS",
    "WeightsFromDisk",
    "WeightsFromDistributed",
    "WeightsFromTensor",
    "decode_named_tensors",
    "encode_named_tensors",
    "parse_destroy_weights_group",
    "parse_init_weights_group",
    "parse_weight_update_session",
    "parse_weight_version",
    "parse_weights_from_disk",
    "parse_weights_from_distributed",
    "parse_weights_from_tensor",
]
