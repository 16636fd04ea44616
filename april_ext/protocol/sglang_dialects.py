"""SGLang's releases as an RL client meets them: the pinned release (SGLANG_RELEASE), the table of what each
line of releases serves (DIALECTS, dialect_for) and the shapes of their load reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PAUSE_MODES = ("abort", "retract", "in_place")

# The SGLang release whose request classes the wire format (sglang_wire) follows: the one place it is
# pinned. .ci/run installs its wheel and tests/test_sglang_contract.py checks the wire format and the
# adapter against that wheel's source.
SGLANG_RELEASE = "0.5.23"


@dataclass(frozen=True)
class SGLangDialect:
    """What one line of SGLang releases serves, as far as an RL client needs it (read from each release's
    http_server.py and io_struct.py). The adapter picks the row of the newest release not newer than a
    server's version; the embedded server can mimic each row (ServerConfig.sglang_compat) so that the
    adapter's adaptation is tested over real HTTP.

    server_info / model_info: the GET paths, preferred first. get_weight_version: GET /get_weight_version
    exists (deprecated, then removed). weight_versions: weights carry a version label (in /generate's
    meta_info, /model_info or /get_weight_version, and the weight_version field of the updates).
    pause_modes: the modes /pause_generation takes (an older server reads no body and always aborts).
    disk_fields / tensor_fields: the fields of update_weights_from_disk / _from_tensor. load_path: the GET
    path of the server's load report (KV tokens in use and queued; load_tokens reads each release's answer).
    base_req: every request class also takes BaseReq's fields (BASE_REQ_FIELDS)."""

    name: str
    version: str
    server_info: tuple[str, ...]
    model_info: tuple[str, ...]
    get_weight_version: bool
    weight_versions: bool
    pause_modes: tuple[str, ...]
    disk_fields: tuple[str, ...]
    tensor_fields: tuple[str, ...]
    load_path: str
    base_req: bool = False

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return version_tuple(self.version)

    @property
    def pause_has_modes(self) -> bool:
        """Whether /pause_generation reads a body with a mode (older releases read none and abort)."""
        return self.pause_modes != ("abort",)


_DISK_04 = ("model_path", "load_format", "abort_all_requests")
_TENSOR_04 = ("serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests")
_DISK_053 = (*_DISK_04, "weight_version", "is_async", "torch_empty_cache", "keep_pause")
_TENSOR_053 = (*_TENSOR_04, "weight_version")
_DISK_059 = (*_DISK_053, "recapture_cuda_graph", "token_step", "flush_cache", "manifest")
_INFO_059 = (("/server_info", "/get_server_info"), ("/model_info", "/get_model_info"))
# 0.5.9 and 0.5.15.post1 (slime's pin) read from their wheels: /pause_generation takes a body with a mode (a
# body-less call is a 422), /get_weight_version answers 404 (the label is in /model_info), the load report is
# /get_load; the tensor update gained disable_draft_model and torch_empty_cache in between.
DIALECTS: dict[str, SGLangDialect] = {d.name: d for d in (
    SGLangDialect("0.4", "0.4.10.post2", ("/get_server_info",), ("/get_model_info",), False, False, ("abort",),
                  _DISK_04, _TENSOR_04, "/get_load"),
    SGLangDialect("0.5.3", "0.5.3", ("/get_server_info",), ("/get_model_info",), True, True, ("abort",),
                  _DISK_053, _TENSOR_053, "/get_load"),
    SGLangDialect("0.5.9", "0.5.9", *_INFO_059, False, True, PAUSE_MODES, _DISK_059, _TENSOR_053, "/get_load",
                  base_req=True),
    SGLangDialect("0.5.15", "0.5.15.post1", *_INFO_059, False, True, PAUSE_MODES, _DISK_059,
                  (*_TENSOR_053, "disable_draft_model", "torch_empty_cache"), "/get_load", base_req=True),
    SGLangDialect("current", SGLANG_RELEASE, *_INFO_059, False, True, PAUSE_MODES, _DISK_059,
                  (*_TENSOR_053, "selector", "torch_empty_cache"), "/v1/loads", base_req=True),
)}
CURRENT = DIALECTS["current"]
# Fields every request class of the current release inherits (BaseReq): an id for its logs and the IPC
# address of the HTTP worker. Neither changes what the call does.
BASE_REQ_FIELDS = ("rid", "http_worker_ipc")


def version_tuple(version: str) -> tuple[int, ...]:
    """"0.4.10.post2" -> (0, 4, 10): the numeric release, suffixes dropped."""
    numbers = []
    for part in str(version).split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) < len(part):
            break
    return tuple(numbers)


def dialect_for(version: str | None) -> SGLangDialect:
    """The row of the newest documented release not newer than `version` (the oldest row below them all;
    no version at all: the current release, which is what a server without one is taken to be)."""
    if version is None or not version_tuple(version):
        return CURRENT
    wanted = version_tuple(version)
    rows = sorted(DIALECTS.values(), key=lambda d: d.version_tuple)
    chosen = rows[0]
    for row in rows:
        if row.version_tuple <= wanted:
            chosen = row
    return chosen


def load_tokens(answer: Any) -> int | None:
    """The KV tokens a server reports in use or waiting for prefill, summed over its data-parallel ranks, from
    any release's load report: /v1/loads (0.5.23: {"loads": [{"num_total_tokens", "num_used_tokens", ...}]}),
    /get_load (0.5.x: [{"num_tokens", ...}], 0.4: {"load": N}). None for an answer of none of these shapes."""
    if isinstance(answer, dict) and isinstance(answer.get("loads"), list):
        ranks, keys = answer["loads"], ("num_total_tokens", "num_used_tokens")
    elif isinstance(answer, list):
        ranks, keys = answer, ("num_tokens",)
    elif isinstance(answer, dict) and "load" in answer:
        ranks, keys = [answer], ("load",)
    else:
        return None
    total = 0
    for rank in ranks:
        value = next((rank[k] for k in keys if isinstance(rank, dict) and k in rank), None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return None
        total += value
    return total


def load_json(dialect: SGLangDialect, *, used_tokens: int, waiting_tokens: int, running: int, waiting: int,
              capacity_tokens: int, max_running: int) -> Any:
    """The load report of one engine (one data-parallel rank) in the shape of the dialect's release."""
    total = used_tokens + waiting_tokens
    if dialect.version_tuple < (0, 5):
        return {"load": total}
    if dialect.load_path == "/get_load":
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": total}]
    return {"version": dialect.version, "loads": [{
        "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting, "num_used_tokens": used_tokens,
        "num_total_tokens": total, "max_total_num_tokens": capacity_tokens, "max_running_requests": max_running,
        "token_usage": used_tokens / capacity_tokens if capacity_tokens else 0.0}]}


__all__ = [
    "BASE_REQ_FIELDS",
    "CURRENT",
    "DIALECTS",
    "PAUSE_MODES",
    "SGLANG_RELEASE",
    "SGLangDialect",
    "dialect_for",
    "load_json",
    "load_tokens",
    "version_tuple",
]
