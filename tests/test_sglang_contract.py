"""The SGLang contract, checked against SGLang's own request classes.

The `sglang` wheel of the pinned release (april_ext.protocol.sglang_wire.SGLANG_RELEASE; .ci/run installs it
with `pip install --no-deps`) is not imported: its request module pulls GPU-only packages. The classes'
fields, annotations and defaults are read from its source with `ast`. Checked:
- every payload the adapter sends (recorded from a real session against the embedded server) names only
  fields of the matching class, with values of the annotated types, and every required field;
- the embedded server knows every field of those classes: each at SGLang's default is accepted (one
  /generate carrying all of them at once runs), each feature it lacks answers 400 naming the field at any
  other value, and it names no field that SGLang lacks (but the router's `model`);
- the dialect of the current release matches the classes (update fields, pause modes).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from _engine_utils import tiny_model
from _sglang_utils import live_server, post
from _torch_threads import one_torch_thread

from april_ext.errors import InvalidArgumentError
from april_ext.model import save_pretrained
from april_ext.protocol import SamplingParams, sglang_wire
from april_ext.sglang import SGLangEngine, SGLangEngineConfig, SGLangServerArgs, launch_sglang_server
from april_ext.sglang.client import HTTPClient


def _sglang_root() -> str | None:
    spec = importlib.util.find_spec("sglang")  # finds the package without running its __init__
    return None if spec is None or not spec.submodule_search_locations else next(iter(spec.submodule_search_locations))


ROOT = _sglang_root()
INSTALLED = importlib.metadata.version("sglang") if ROOT is not None else None
pytestmark = pytest.mark.skipif(
    INSTALLED != sglang_wire.SGLANG_RELEASE,
    reason=f"needs the sglang=={sglang_wire.SGLANG_RELEASE} wheel (found: {INSTALLED}); install it with `pip install "
           f"--no-deps sglang=={sglang_wire.SGLANG_RELEASE}` (.ci/run does)")

# Endpoint -> SGLang request class (io_struct.py), for the bodies the adapter sends and the server reads.
CLASSES = {
    "/generate": "GenerateReqInput", "/abort_request": "AbortReq",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/pause_generation": "PauseGenerationReqInput", "/continue_generation": "ContinueGenerationReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput", "/end_weight_update": "EndWeightUpdateReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
}
# The collective update needs the group's other end in another process: recorded in a test of its own.
BROADCAST = ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group")
REQUIRED = object()


@dataclass(frozen=True)
class Field:
    name: str
    annotation: ast.expr
    default: Any  # REQUIRED when the class gives none


def _module(relative: str) -> ast.Module:
    assert ROOT is not None
    with open(os.path.join(ROOT, relative), encoding="utf-8") as handle:
        return ast.parse(handle.read())


def _constants(tree: ast.Module) -> dict[str, Any]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = _literal(node.value, out)
            except ValueError:
                continue
    return out


def _literal(node: ast.expr, constants: dict[str, Any]) -> Any:
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.LShift):
        return _literal(node.left, constants) << _literal(node.right, constants)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "field":
        for kw in node.keywords:
            if kw.arg == "default":
                return _literal(kw.value, constants)
            if kw.arg == "default_factory" and isinstance(kw.value, ast.Name):
                return {"list": [], "dict": {}}[kw.value.id]
        return REQUIRED
    return ast.literal_eval(node)


def _fields(tree: ast.Module, name: str) -> dict[str, Field]:
    """The class's annotated fields, its bases' (in this module) first."""
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    constants = _constants(tree)
    node = classes[name]
    out: dict[str, Field] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out.update(_fields(tree, base.id))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            default = REQUIRED if stmt.value is None else _literal(stmt.value, constants)
            out[stmt.target.id] = Field(stmt.target.id, stmt.annotation, default)
    return out


@pytest.fixture(scope="module")
def io_struct() -> ast.Module:
    return _module("srt/managers/io_struct.py")


@pytest.fixture(scope="module")
def sampling_fields() -> dict[str, Field]:
    return _fields(_module("srt/sampling/sampling_params.py"), "SamplingParams")


# A JSON value against a Python annotation (the subset SGLang's request classes use) ------------------

def _matches(value: Any, annotation: ast.expr) -> bool:
    node = annotation
    if isinstance(node, ast.Constant) and node.value is None:
        return value is None
    if isinstance(node, ast.Name):
        simple = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
                  "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                  "str": lambda v: isinstance(v, str), "bool": lambda v: isinstance(v, bool),
                  "bytes": lambda v: isinstance(v, str),  # Base64Bytes: a base64 string on the wire
                  "dict": lambda v: isinstance(v, dict), "list": lambda v: isinstance(v, list),
                  "Any": lambda v: True}
        if node.id not in simple:
            raise AssertionError(f"the check does not know SGLang's type {node.id}: extend _matches")
        return simple[node.id](value)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        outer = node.value.id
        args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        if outer == "Optional":
            return value is None or _matches(value, args[0])
        if outer == "Union":
            return any(_matches(value, a) for a in args)
        if outer == "Annotated":
            return _matches(value, args[0])
        if outer == "Literal":
            return any(isinstance(a, ast.Constant) and a.value == value for a in args)
        if outer in ("List", "Set", "list", "set"):
            return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
        if outer in ("Dict", "dict"):
            return isinstance(value, dict) and all(_matches(k, args[0]) and _matches(v, args[1])
                                                   for k, v in value.items())
    raise AssertionError(f"the check does not know the annotation {ast.unparse(node)}: extend _matches")


def _check_payload(endpoint: str, payload: Any, io_struct: ast.Module, sampling: dict[str, Field]) -> None:
    fields = _fields(io_struct, CLASSES[endpoint])
    assert isinstance(payload, dict), (endpoint, payload)
    unknown = set(payload) - set(fields)
    assert not unknown, f"{endpoint}: the adapter sends {sorted(unknown)}, which {CLASSES[endpoint]} lacks"
    missing = [f.name for f in fields.values() if f.default is REQUIRED and f.name not in payload]
    assert not missing, f"{endpoint}: the adapter leaves out the required {missing}"
    for key, value in payload.items():
        if key == "sampling_params":
            for skey, svalue in value.items():
                assert skey in sampling, f"SamplingParams has no {skey}"
                assert _matches(svalue, sampling[skey].annotation), \
                    f"sampling_params.{skey}={svalue!r} is not a {ast.unparse(sampling[skey].annotation)}"
        else:
            assert _matches(value, fields[key].annotation), \
                f"{endpoint}: {key}={value!r} is not a {ast.unparse(fields[key].annotation)}"


# What the adapter sends -----------------------------------------------------------------------------

def _record(monkeypatch) -> list[tuple[str, Any]]:
    sent: list[tuple[str, Any]] = []
    call, events = HTTPClient.call, HTTPClient.events

    async def recording_call(self, method, url, payload=None, *, idempotent):
        if method == "POST":
            sent.append((url, payload))
        return await call(self, method, url, payload, idempotent=idempotent)

    def recording_events(self, url, payload):
        sent.append((url, payload))
        return events(self, url, payload)

    monkeypatch.setattr(HTTPClient, "call", recording_call)
    monkeypatch.setattr(HTTPClient, "events", recording_events)
    return sent


def test_every_payload_the_adapter_sends_fits_sglangs_classes(io_struct, sampling_fields, tmp_path,
                                                              monkeypatch) -> None:
    sent = _record(monkeypatch)
    save_pretrained(tiny_model(seed=2), tmp_path / "ckpt")
    params = SamplingParams(max_new_tokens=40, temperature=0.7, top_p=0.9, top_k=0, seed=3, stop_token_ids=(7,))

    async def session(url: str) -> None:
        for stream in (True, False):
            async with SGLangEngine(SGLangEngineConfig(worker_urls=(url,), stream=stream)) as engine:
                async for _ in engine.generate([5, 17, 33], params, request_id="done"):
                    pass
                for ids in (["a"], None):  # by id, then all
                    task = asyncio.create_task(_drain(engine, "a"))
                    while not sum(engine.stats().in_flight.values()):
                        await asyncio.sleep(0.01)
                    await engine.abort(ids)
                    await task
        async with SGLangEngine(SGLangEngineConfig(worker_urls=(url,))) as engine:
            await engine.update_weights(str(tmp_path / "ckpt"), version=1)
            await engine.update_weights(dict(tiny_model(seed=3).state_dict()), version=2)
            for mode in sglang_wire.PAUSE_MODES:
                await engine.pause_generation(mode)
                await engine.continue_generation()
            await engine.release_memory()
            await engine.resume_and_update(str(tmp_path / "ckpt"), version=3)
            await engine.release_memory(["kv_cache"])
            await engine.resume_memory(["kv_cache"])
            await engine.flush_cache()

    async def _drain(engine: SGLangEngine, rid: str) -> None:
        async for _ in engine.generate([5, 17], SamplingParams(max_new_tokens=200, ignore_eos=True), rid):
            pass

    with one_torch_thread(), live_server(tiny_model()) as server:
        asyncio.run(session(server.url))
    endpoints = set()
    for url, payload in sent:
        endpoint = "/" + url.rsplit("/", 1)[1]
        endpoints.add(endpoint)
        if endpoint == "/flush_cache":
            assert payload is None  # SGLang's /flush_cache takes no body
            continue
        _check_payload(endpoint, payload, io_struct, sampling_fields)
    assert endpoints == set(CLASSES) - {"/update_weight_version", *BROADCAST} | {"/flush_cache"}


def test_the_broadcast_payloads_fit_sglangs_classes(io_struct, sampling_fields, tmp_path, monkeypatch) -> None:
    """weight_sync='broadcast' against a server process: the group is joined, two buckets are sent inside a
    session, and close() leaves the group."""
    sent = _record(monkeypatch)
    save_pretrained(tiny_model(), tmp_path / "ckpt")
    args = SGLangServerArgs(model_path=str(tmp_path / "ckpt"), extra_args=("--num-blocks", "16", "--block-size", "4",
                                                                          "--weight-group-timeout", "20"))

    async def session(url: str) -> None:
        config = SGLangEngineConfig(worker_urls=(url,), weight_sync="broadcast", weight_bucket_mb=0.004,
                                    weight_sync_timeout_s=20.0)
        async with SGLangEngine(config) as engine:
            await engine.update_weights(dict(tiny_model(seed=3).state_dict()), version=1)

    with one_torch_thread(), launch_sglang_server(args, module="april_ext.server", env={"OMP_NUM_THREADS": "1"},
                                                  timeout_s=120, log_path=str(tmp_path / "server.log")) as server:
        asyncio.run(session(server.url))
    endpoints = ["/" + url.rsplit("/", 1)[1] for url, _ in sent]
    assert endpoints[:2] == ["/init_weights_update_group", "/begin_weight_update"]
    assert endpoints[-2:] == ["/end_weight_update", "/destroy_weights_update_group"]
    assert endpoints.count("/update_weights_from_distributed") >= 2
    for endpoint, (_, payload) in zip(endpoints, sent):
        _check_payload(endpoint, payload, io_struct, sampling_fields)


def test_a_weight_update_during_an_in_place_pause_does_not_ask_for_a_flush(monkeypatch) -> None:
    """SGLang flushes its cache only when idle and fails an update whose flush fails: requests held in place
    keep their KV, so the update between pause_generation("in_place") and continue sends flush_cache=False."""
    sent = _record(monkeypatch)

    async def session(url: str) -> None:
        async with SGLangEngine(SGLangEngineConfig(worker_urls=(url,))) as engine:
            for mode in ("in_place", "retract", "abort"):
                await engine.pause_generation(mode)
                await engine.update_weights(dict(tiny_model(seed=3).state_dict()), version=1)
                await engine.continue_generation()
            await engine.update_weights(dict(tiny_model(seed=3).state_dict()), version=2)

    with one_torch_thread(), live_server(tiny_model()) as server:
        asyncio.run(session(server.url))
    flushes = [payload["flush_cache"] for url, payload in sent if url.endswith("/update_weights_from_tensor")]
    assert flushes == [False, True, True, True]


# What the server accepts ----------------------------------------------------------------------------

def _sample(annotation: ast.expr) -> Any:
    """A value of the annotation that is not None, False, 0 or empty (a non-neutral value)."""
    node = annotation
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        if node.value.id in ("Optional", "Annotated"):
            return _sample(args[0])
        if node.value.id == "Union":
            return _sample(next(a for a in args if not (isinstance(a, ast.Constant) and a.value is None)))
        if node.value.id == "Literal":
            return args[-1].value
        if node.value.id in ("List", "Set", "list", "set"):
            return [_sample(args[0])]
        if node.value.id in ("Dict", "dict"):
            return {"k": _sample(args[1])}
    if isinstance(node, ast.Name):
        return {"int": 7, "float": 0.5, "str": "x", "bool": True, "bytes": "eA==", "dict": {"k": 1},
                "list": [1]}.get(node.id, {"k": "x"})
    return {"k": "x"}


def _neutral_body(fields: dict[str, Field], required: dict[str, Any]) -> dict[str, Any]:
    return {name: required.get(name, f.default) for name, f in fields.items()
            if f.default is not REQUIRED or name in required}


def test_the_server_knows_every_field_of_generate_and_sampling_params(io_struct, sampling_fields) -> None:
    generate = _fields(io_struct, "GenerateReqInput")
    assert set(sglang_wire.GENERATE_FIELDS) - set(sglang_wire.ROUTER_FIELDS) == set(generate)
    assert set(sglang_wire.SAMPLING_FIELDS) == set(sampling_fields)
    # Each field at SGLang's default is accepted...
    for name, f in generate.items():
        if f.default is not REQUIRED and name != "input_ids":
            sglang_wire.parse_generate({"input_ids": [1], name: f.default})
    for name, f in sampling_fields.items():
        sglang_wire.parse_generate({"input_ids": [1], "sampling_params": {name: f.default}})
    # ...and any other value of a feature the engine lacks is refused, naming it.
    for name in sglang_wire.GENERATE_NEUTRAL:
        with pytest.raises(InvalidArgumentError, match=name):
            sglang_wire.parse_generate({"input_ids": [1], name: _sample(generate[name].annotation)})
    for name in sglang_wire.SAMPLING_NEUTRAL:
        with pytest.raises(InvalidArgumentError, match=name):
            sglang_wire.parse_generate({"input_ids": [1],
                                        "sampling_params": {name: _sample(sampling_fields[name].annotation)}})


def test_one_generate_with_every_sglang_field_at_its_default_runs(io_struct, sampling_fields) -> None:
    body = _neutral_body(_fields(io_struct, "GenerateReqInput"), {"input_ids": [5, 17, 33]})
    body["sampling_params"] = _neutral_body(sampling_fields, {"max_new_tokens": 4})
    body["return_logprob"] = True

    async def send(url: str):
        async with aiohttp.ClientSession() as session:
            return await post(session, f"{url}/generate", body)

    with one_torch_thread(), live_server(tiny_model()) as server:
        status, answer = asyncio.run(send(server.url))
    assert status == 200, answer
    assert len(answer["output_ids"]) == 4 and len(answer["meta_info"]["output_token_logprobs"]) == 4


@pytest.mark.parametrize("endpoint", sorted(set(CLASSES) - {"/generate"}))
def test_the_server_reads_every_field_of_the_control_requests(endpoint, io_struct) -> None:
    fields = _fields(io_struct, CLASSES[endpoint])
    parse = {
        "/abort_request": sglang_wire.parse_abort,
        "/update_weights_from_disk": sglang_wire.parse_weights_from_disk,
        "/update_weights_from_tensor": sglang_wire.parse_weights_from_tensor,
        "/release_memory_occupation": lambda b: sglang_wire.parse_memory_tags(b, endpoint),
        "/resume_memory_occupation": lambda b: sglang_wire.parse_memory_tags(b, endpoint),
        "/pause_generation": sglang_wire.parse_pause, "/continue_generation": sglang_wire.parse_continue,
        "/update_weight_version": sglang_wire.parse_weight_version,
        "/begin_weight_update": lambda b: sglang_wire.parse_weight_update_session(b, endpoint),
        "/end_weight_update": lambda b: sglang_wire.parse_weight_update_session(b, endpoint),
        "/init_weights_update_group": sglang_wire.parse_init_weights_group,
        "/update_weights_from_distributed": sglang_wire.parse_weights_from_distributed,
        "/destroy_weights_update_group": sglang_wire.parse_destroy_weights_group,
    }[endpoint]
    required = {"model_path": "/ckpt", "serialized_named_tensors": ["eA=="], "new_version": "v1",
                "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
                "names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]]}
    parse(_neutral_body(fields, required))  # every field at once, at SGLang's defaults
    for name, f in fields.items():
        if f.default is not REQUIRED:
            parse({**{k: v for k, v in required.items() if k in fields}, name: f.default})


def test_the_current_dialect_is_the_pinned_release(io_struct) -> None:
    current = sglang_wire.CURRENT
    base = set(_fields(io_struct, "BaseReq"))
    assert base == set(sglang_wire.BASE_REQ_FIELDS)
    assert set(current.disk_fields) == set(_fields(io_struct, "UpdateWeightFromDiskReqInput")) - base
    assert set(current.tensor_fields) == set(_fields(io_struct, "UpdateWeightsFromTensorReqInput")) - base
    mode = _fields(io_struct, "PauseGenerationReqInput")["mode"].annotation
    assert isinstance(mode, ast.Subscript) and [e.value for e in mode.slice.elts] == list(current.pause_modes)
    assert current.version == INSTALLED
    for endpoint, names in sglang_wire.WEIGHT_GROUP_FIELDS.items():
        assert set(names) == set(_fields(io_struct, CLASSES[endpoint])) - base, endpoint


def test_the_collective_update_is_served_in_the_current_dialect_only(io_struct) -> None:
    """Older dialects answer 404 (the adapter refuses to broadcast to them); the current one answers SGLang's
    {success, message} (here: an update before init_weights_update_group)."""
    async def send(url: str):
        async with aiohttp.ClientSession() as session:
            return [await post(session, f"{url}{e}", b) for e, b in (
                ("/begin_weight_update", {}),
                ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}),
                ("/end_weight_update", {}))]

    for compat in ("0.4", "0.5.3"):
        with one_torch_thread(), live_server(tiny_model(), sglang_compat=compat) as server:
            assert [status for status, _ in asyncio.run(send(server.url))] == [404] * 3
    with one_torch_thread(), live_server(tiny_model()) as server:
        (begin, _), (status, answer), (end, _) = asyncio.run(send(server.url))
    assert (begin, end) == (200, 200)
    assert status == 400 and answer["success"] is False and "init_weights_update_group" in answer["message"]
