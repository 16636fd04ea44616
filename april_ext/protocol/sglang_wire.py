"""The SGLang HTTP contract, as plain functions: request bodies in, validated values out, and the
JSON shapes the server answers with (finish reasons, meta_info, logprob triples).

Nothing here touches the network or the engine, so every rule is unit-testable. This module is the contract's
one name (the server, the adapter, the weight sync and .ci/run import it); each part lives in a module of its own:
sglang_dialects (the pinned release and what each release line serves), sglang_json (a body's JSON and its typed
fields), sglang_generate (/generate), sglang_control (abort, pause, memory) and sglang_weights (weight updates).
"""

from __future__ import annotations

from april_ext.protocol.sglang_control import (
    AbortRequest,
    parse_abort,
    parse_continue,
    parse_memory_tags,
    parse_pause,
)
from april_ext.protocol.sglang_dialects import (
    BASE_REQ_FIELDS,
    CURRENT,
    DIALECTS,
    PAUSE_MODES,
    SGLANG_RELEASE,
    SGLangDialect,
    dialect_for,
    load_json,
    load_tokens,
    version_tuple,
)
from april_ext.protocol.sglang_generate import (
    ABORT_MESSAGE,
    ABORT_QUEUED_MESSAGE,
    GENERATE_FIELDS,
    GENERATE_NEUTRAL,
    ROUTER_FIELDS,
    SAMPLING_FIELDS,
    SAMPLING_NEUTRAL,
    GenerateRequest,
    finish_reason_json,
    parse_generate,
    parse_sampling_params,
)
from april_ext.protocol.sglang_json import (
    MAX_JSON_DEPTH,
    MAX_RID_LENGTH,
    error_json,
    parse_json,
)
from april_ext.protocol.sglang_weights import (
    DEFAULT_GROUP_NAME,
    WEIGHT_GROUP_FIELDS,
    InitWeightsGroup,
    WeightsFromDisk,
    WeightsFromDistributed,
    WeightsFromTensor,
    decode_named_tensors,
    encode_named_tensors,
    parse_destroy_weights_group,
    parse_init_weights_group,
    parse_weight_update_session,
    parse_weight_version,
    parse_weights_from_disk,
    parse_weights_from_distributed,
    parse_weights_from_tensor,
)

__all__ = [
    "ABORT_MESSAGE",
    "ABORT_QUEUED_MESSAGE",
    "AbortRequest",
    "BASE_REQ_FIELDS",
    "CURRENT",
    "DEFAULT_GROUP_NAME",
    "DIALECTS",
    "GENERATE_FIELDS",
    "GENERATE_NEUTRAL",
    "GenerateRequest",
    "InitWeightsGroup",
    "MAX_JSON_DEPTH",
    "MAX_RID_LENGTH",
    "PAUSE_MODES",
    "ROUTER_FIELDS",
    "SAMPLING_FIELDS",
    "SAMPLING_NEUTRAL",
    "SGLANG_RELEASE",
    "SGLangDialect",
    "WEIGHT_GROUP_FIELDS",
    "WeightsFromDisk",
    "WeightsFromDistributed",
    "WeightsFromTensor",
    "decode_named_tensors",
    "dialect_for",
    "encode_named_tensors",
    "error_json",
    "finish_reason_json",
    "load_json",
    "load_tokens",
    "parse_abort",
    "parse_continue",
    "parse_destroy_weights_group",
    "parse_generate",
    "parse_init_weights_group",
    "parse_json",
    "parse_memory_tags",
    "parse_pause",
    "parse_sampling_params",
    "parse_weight_update_session",
    "parse_weight_version",
    "parse_weights_from_disk",
    "parse_weights_from_distributed",
    "parse_weights_from_tensor",
    "version_tuple",
]
