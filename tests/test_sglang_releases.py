"""SGLang releases between 0.5.3 and the pinned one: 0.5.9 and slime's pin 0.5.15.post1, checked against their
wheels' own source as tests/test_sglang_contract.py checks the pinned release (read with `ast` from the `.whl`
files in $APRIL_SGLANG_WHEELS, which .ci/run fills with `pip download --no-deps`; nothing is installed or
imported). Checked: the dialect row the probe picks for each release matches its request classes and routes,
and every payload the adapter sends a server of that release (the embedded server mimicking the row) fits
that release's classes."""

from __future__ import annotations

import ast
import asyncio
import glob
import os
import zipfile

import pytest
from _engine_utils import tiny_model
from _sglang_utils import live_server
from _torch_threads import one_torch_thread
from test_sglang_contract import REQUIRED, Field, _check_payload, _fields, _record

from april_ext.model import save_pretrained
from april_ext.protocol import SamplingParams, sglang_wire
from april_ext.sglang import SGLangEngine, SGLangEngineConfig

WHEELS = os.environ.get("APRIL_SGLANG_WHEELS", "")
# Dialect row -> the release whose wheel it was read from.
IN_BETWEEN = {"0.5.9": "0.5.9", "0.5.15": "0.5.15.post1"}


def _source(release: str, relative: str) -> ast.Module:
    wheels = glob.glob(os.path.join(WHEELS, f"sglang-{release}-*.whl")) if WHEELS else []
    if not wheels:
        pytest.skip(f"needs the sglang=={release} wheel in $APRIL_SGLANG_WHEELS (found: {WHEELS or 'unset'}): "
                    f"`pip download --no-deps sglang=={release} -d DIR` (.ci/run does)")
    with zipfile.ZipFile(wheels[0]) as wheel:
        return ast.parse(wheel.read(f"sglang/{relative}").decode())


def _sampling_fields(sampling_params: ast.Module) -> dict[str, Field]:
    """SamplingParams' fields: the annotated ones (later releases), else its __init__ parameters (0.5.9's)."""
    fields = _fields(sampling_params, "SamplingParams")
    if fields:
        return fields
    cls = next(n for n in sampling_params.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args.args[1:]
    defaults = [REQUIRED] * (len(args) - len(init.args.defaults)) + [ast.literal_eval(d) for d in init.args.defaults]
    return {a.arg: Field(a.arg, a.annotation, d) for a, d in zip(args, defaults) if a.annotation is not None}


def _routes(http_server: ast.Module) -> dict[str, ast.AsyncFunctionDef | ast.FunctionDef]:
    """Path -> handler of every @app.get / @app.post / @app.api_route."""
    out = {}
    for node in http_server.body:
        if isinstance(node, (ast.AsyncFunctionDef, ast.FunctionDef)):
            for deco in node.decorator_list:
                if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                        and isinstance(deco.func.value, ast.Name) and deco.func.value.id == "app"
                        and deco.args and isinstance(deco.args[0], ast.Constant)):
                    out[deco.args[0].value] = node
    return out


@pytest.mark.parametrize("row", IN_BETWEEN)
def test_the_dialect_of_an_in_between_release_is_its_wheels(row: str) -> None:
    release = IN_BETWEEN[row]
    io_struct = _source(release, "srt/managers/io_struct.py")
    routes = _routes(_source(release, "srt/entrypoints/http_server.py"))
    dialect = sglang_wire.dialect_for(release)
    assert dialect is sglang_wire.DIALECTS[row] and dialect.version == release
    base = set(_fields(io_struct, "BaseReq"))
    assert dialect.base_req and base == set(sglang_wire.BASE_REQ_FIELDS)
    assert set(dialect.disk_fields) == set(_fields(io_struct, "UpdateWeightFromDiskReqInput")) - base
    assert set(dialect.tensor_fields) == set(_fields(io_struct, "UpdateWeightsFromTensorReqInput")) - base
    mode = _fields(io_struct, "PauseGenerationReqInput")["mode"].annotation
    assert isinstance(mode, ast.Subscript) and [e.value for e in mode.slice.elts] == list(dialect.pause_modes)
    # The pause handler reads its request class from the body: a body-less call fails validation (422), so the
    # adapter must send one.
    pause = routes["/pause_generation"]
    assert any("PauseGenerationReqInput" in ast.unparse(a.annotation) for a in pause.args.args if a.annotation)
    assert dialect.pause_has_modes
    assert set(dialect.server_info) | set(dialect.model_info) <= set(routes)
    # /get_weight_version only answers 404 (the label is in /model_info): not served, for the probe.
    assert "status_code=404" in ast.unparse(routes["/get_weight_version"]) and not dialect.get_weight_version
    assert "weight_version" in ast.unparse(routes["/model_info"]) and dialect.weight_versions
    assert dialect.load_path in routes and "/v1/loads" not in routes


@pytest.mark.parametrize("row", IN_BETWEEN)
def test_every_payload_the_adapter_sends_a_release_fits_its_classes(row: str, tmp_path, monkeypatch) -> None:
    release = IN_BETWEEN[row]
    io_struct = _source(release, "srt/managers/io_struct.py")
    sampling = _sampling_fields(_source(release, "srt/sampling/sampling_params.py"))
    sent = _record(monkeypatch)
    save_pretrained(tiny_model(seed=2), tmp_path / "ckpt")
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=0, seed=3, stop_token_ids=(7,))

    async def session(url: str) -> None:
        async with SGLangEngine(SGLangEngineConfig(worker_urls=(url,))) as engine:
            async for _ in engine.generate([5, 17, 33], params, request_id="done"):
                pass
            task = asyncio.create_task(_drain(engine))
            while not sum(engine.stats().in_flight.values()):
                await asyncio.sleep(0.01)
            await engine.abort(None)
            await task
            await engine.update_weights(str(tmp_path / "ckpt"), version=1)
            for mode in sglang_wire.PAUSE_MODES:
                await engine.pause_generation(mode)
                await engine.continue_generation()

    async def _drain(engine: SGLangEngine) -> None:
        async for _ in engine.generate([5, 17], SamplingParams(max_new_tokens=200, ignore_eos=True), "a"):
            pass

    with one_torch_thread(), live_server(tiny_model(), sglang_compat=row) as server:
        asyncio.run(session(server.url))
    endpoints = set()
    for url, payload in sent:
        endpoint = "/" + url.rsplit("/", 1)[1]
        endpoints.add(endpoint)
        _check_payload(endpoint, payload, io_struct, sampling)
    assert endpoints == {"/generate", "/abort_request", "/update_weights_from_disk", "/pause_generation",
                         "/continue_generation"}
