"""The embedded server's limits and strict types: JSON booleans and numbers without coercion, rid length,
seed range, JSON nesting, the request body limit (413 before the body is read) and corrupt weight files."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator

import aiohttp
import pytest
from _engine_utils import engine, greedy_reference, tiny_model
from _sglang_utils import get, post
from _torch_threads import one_torch_thread
from safetensors.torch import save_file

from april_ext.errors import ConfigError, InvalidArgumentError
from april_ext.model import save_pretrained
from april_ext.protocol import SamplingParams, sglang_wire
from april_ext.server import ServerConfig, ServerThread

PROMPT = [5, 17, 33, 2, 60]
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
LIMIT = 8192


def run(coro):
    return asyncio.run(coro)


# Request rules (no server) -------------------------------------------------------------------------

@pytest.mark.parametrize("body, field", [
    ({"sampling_params": {"ignore_eos": "false"}}, "ignore_eos"),
    ({"sampling_params": {"ignore_eos": 0}}, "ignore_eos"),
    ({"sampling_params": {"no_stop_trim": "yes"}}, "no_stop_trim"),
    ({"sampling_params": {"skip_special_tokens": 1}}, "skip_special_tokens"),
    ({"sampling_params": {"spaces_between_special_tokens": "true"}}, "spaces_between_special_tokens"),
    ({"return_logprob": 1}, "return_logprob"),
    ({"stream": "false"}, "stream"),
    ({"return_text_in_logprobs": "no"}, "return_text_in_logprobs"),
])
def test_boolean_fields_take_only_json_booleans(body: dict, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        sglang_wire.parse_generate({"input_ids": [1], **body})
    assert f"{field} must be true or false" in str(err.value)


@pytest.mark.parametrize("call, field", [
    (lambda: sglang_wire.parse_abort({"rid": "", "abort_all": "true"}), "abort_all"),
    (lambda: sglang_wire.parse_continue({"torch_empty_cache": "yes"}), "torch_empty_cache"),
    (lambda: sglang_wire.parse_weights_from_disk({"model_path": "/c", "flush_cache": "false"}), "flush_cache"),
    (lambda: sglang_wire.parse_weights_from_disk({"model_path": "/c", "is_async": 0}), "is_async"),
    (lambda: sglang_wire.parse_weights_from_disk({"model_path": "/c", "keep_pause": "no"}), "keep_pause"),
    (lambda: sglang_wire.parse_weights_from_disk({"model_path": "/c", "abort_all_requests": 1}),
     "abort_all_requests"),
    (lambda: sglang_wire.parse_weights_from_tensor({"serialized_named_tensors": ["x"], "flush_cache": 1}),
     "flush_cache"),
    (lambda: sglang_wire.parse_weight_version({"new_version": "v", "abort_all_requests": "false"}),
     "abort_all_requests"),
])
def test_boolean_fields_of_the_other_endpoints_take_only_json_booleans(call, field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"{field} must be true or false"):
        call()


@pytest.mark.parametrize("sampling, fragment", [
    ({"temperature": True}, "temperature must be a finite number"),
    ({"temperature": "0.5"}, "temperature must be a finite number"),
    ({"temperature": math.nan}, "temperature must be a finite number"),
    ({"top_p": True}, "top_p must be a finite number"),
    ({"top_p": math.inf}, "top_p must be a finite number"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
    ({"max_new_tokens": 4.0}, "max_new_tokens must be an integer"),
    ({"top_k": "5"}, "top_k must be an integer"),
    ({"sampling_seed": True}, "sampling_seed must be an integer"),
    ({"sampling_seed": "7"}, "sampling_seed must be an integer"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"n": True}, "n=true is not supported"),
    ({"min_new_tokens": False}, "min_new_tokens=false is not supported"),
    ({"min_new_tokens": 0.0}, "min_new_tokens=0.0 is not supported"),
    ({"frequency_penalty": False}, "frequency_penalty=false is not supported"),
    ({"repetition_penalty": True}, "repetition_penalty=true is not supported"),
    ({"min_p": math.nan}, "min_p=NaN is not supported"),
])
def test_numeric_sampling_fields_are_not_coerced(sampling: dict, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        sglang_wire.parse_generate({"input_ids": [1], "sampling_params": sampling})
    assert fragment in str(err.value)


@pytest.mark.parametrize("body, fragment", [
    ({"top_logprobs_num": False}, "top_logprobs_num is not supported"),
    ({"return_hidden_states": 0}, "return_hidden_states is not supported"),
    ({"lora_path": 0}, "lora_path is not supported"),
    ({"logprob_start_len": "0"}, "logprob_start_len must be an integer"),
    ({"bootstrap_port": True}, "bootstrap_port must be an integer"),
])
def test_other_generate_fields_are_not_coerced(body: dict, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        sglang_wire.parse_generate({"input_ids": [1], **body})
    assert fragment in str(err.value)


def test_neutral_values_and_null_booleans_are_still_accepted() -> None:
    req = sglang_wire.parse_generate({
        "input_ids": [1], "stream": None, "return_logprob": False, "top_logprobs_num": 0, "logprob_start_len": -1,
        "sampling_params": {"ignore_eos": None, "no_stop_trim": False, "n": 1, "min_new_tokens": 0,
                            "frequency_penalty": 0.0, "repetition_penalty": 1, "min_p": 0, "temperature": 1,
                            "sampling_seed": 2**64 - 1}})
    assert (req.stream, req.return_logprob, req.params.ignore_eos, req.params.seed) == (False, False, False, 2**64 - 1)
    assert req.params.temperature == 1


@pytest.mark.parametrize("seed", [2**64, 2**70, -1])
def test_seeds_must_fit_in_64_bits(seed: int) -> None:
    with pytest.raises(InvalidArgumentError, match=r"sampling_seed must be an integer in \[0, 2\*\*64 - 1\]"):
        sglang_wire.parse_generate({"input_ids": [1], "sampling_params": {"sampling_seed": seed}})
    with pytest.raises(InvalidArgumentError, match=r"seed must be None or an integer in \[0, 2\*\*64 - 1\]"):
        SamplingParams(seed=seed)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


@pytest.mark.parametrize("rid, fragment", [
    ("r" * 257, "at most 256 characters"),
    (["a", "b"], "a list of rids is SGLang's batch form"),
    (7, "rid must be a string"),
    ("", "rid must be a non-empty string"),
])
def test_generate_rid_is_one_string_of_bounded_length(rid, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        sglang_wire.parse_generate({"input_ids": [1], "rid": rid})
    assert fragment in str(err.value)
    assert sglang_wire.parse_generate({"input_ids": [1], "rid": "r" * 256}).rid == "r" * 256


def test_abort_rid_is_bounded_too() -> None:
    with pytest.raises(InvalidArgumentError, match="at most 256 characters"):
        sglang_wire.parse_abort({"rid": "r" * 257})
    assert sglang_wire.parse_abort({"rid": "r" * 256}).rid == "r" * 256


def test_parse_json_rejects_deep_nesting_and_non_json_numbers() -> None:
    assert sglang_wire.parse_json(b"  ", "/x") is None
    assert sglang_wire.parse_json(b'{"a": [1, {"b": 2}]}', "/x") == {"a": [1, {"b": 2}]}
    nested = b"[" * sglang_wire.MAX_JSON_DEPTH + b"]" * sglang_wire.MAX_JSON_DEPTH
    assert sglang_wire.parse_json(nested, "/x") is not None
    for depth in (sglang_wire.MAX_JSON_DEPTH + 1, 100_000):
        with pytest.raises(InvalidArgumentError, match=f"nested deeper than {sglang_wire.MAX_JSON_DEPTH} levels"):
            sglang_wire.parse_json(b'{"a": ' + b"[" * depth + b"]" * depth + b"}", "/x")
    for constant in (b"NaN", b"Infinity", b"-Infinity"):
        with pytest.raises(InvalidArgumentError, match="not valid JSON"):
            sglang_wire.parse_json(b'{"temperature": ' + constant + b"}", "/x")
    with pytest.raises(InvalidArgumentError, match="not valid JSON"):
        sglang_wire.parse_json(b"\xff\xfe{", "/x")


def test_server_config_validates_the_body_limit() -> None:
    assert ServerConfig().max_request_bytes == 64 << 20
    for bad in (0, -1, True, 1.5, "1"):
        with pytest.raises(ConfigError, match="max_request_bytes"):
            ServerConfig(max_request_bytes=bad)


# Live server ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    """The tiny engine behind a server whose body limit is LIMIT bytes."""
    core = engine(tiny_model(), memory_tag_prefix="server-limits-")
    with one_torch_thread(), ServerThread(core, ServerConfig(port=0, max_request_bytes=LIMIT)) as s:
        yield s


async def _raw(url: str, head: bytes, body_parts: list[bytes], timeout: float = 10.0) -> bytes:
    """Sends a hand-written request (head, then each part) on a fresh connection; returns what the server
    answers before it closes the connection (or the timeout)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head)
        for part in body_parts:
            writer.write(part)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def _head(content: str) -> bytes:
    return (f"POST /generate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{content}\r\n\r\n").encode()


def test_a_declared_oversized_body_is_refused_with_413_before_it_is_sent(server) -> None:
    # The body never comes: the answer must not wait for it.
    answer = run(_raw(server.url, _head(f"Content-Length: {LIMIT + 1}"), []))
    status, _, body = answer.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 413"), answer[:200]
    payload = json.loads(body.split(b"\r\n\r\n", 1)[1])
    message = payload["error"]["message"]
    assert f"{LIMIT + 1} bytes" in message and f"limit of {LIMIT} bytes" in message and "--max-request-bytes" in message


def test_a_chunked_body_is_refused_once_it_passes_the_limit(server) -> None:
    chunk = b" " * 1000
    parts = [b"%x\r\n" % len(chunk) + chunk + b"\r\n"] * 9  # no final 0-chunk: the body never ends
    answer = run(_raw(server.url, _head("Transfer-Encoding: chunked"), parts))
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"more than %d bytes" % LIMIT in answer


def test_bodies_up_to_the_limit_are_served_and_one_byte_more_is_not(server, model_copy) -> None:
    body = json.dumps({"input_ids": PROMPT, "sampling_params": GREEDY}).encode()

    async def send(size: int):
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{server.url}/generate", data=body.ljust(size),
                                    headers={"Content-Type": "application/json"}) as resp:
                return resp.status, await resp.json()

    (ok_status, ok), (big_status, big) = run(send(LIMIT)), run(send(LIMIT + 1))
    assert ok_status == 200 and ok["output_ids"] == greedy_reference(model_copy, PROMPT, 4)
    assert big_status == 413 and "max_request_bytes" in big["error"]["message"]


@pytest.fixture(scope="module")
def model_copy():
    return tiny_model()


def test_deeply_nested_json_answers_400(server) -> None:
    async def body():
        async with aiohttp.ClientSession() as session:
            out = []
            for depth in (3000, 40):
                nested = "[" * depth + "]" * depth
                data = '{"input_ids": [1], "sampling_params": {"logit_bias": ' + nested + "}}"
                async with session.post(f"{server.url}/generate", data=data,
                                        headers={"Content-Type": "application/json"}) as resp:
                    out.append((resp.status, await resp.json()))
            out.append(await get(session, f"{server.url}/health_generate"))
            return out

    (deep_status, deep), (nested_status, nested), (health, _) = run(body())
    assert deep_status == nested_status == 400
    assert "nested deeper than" in deep["error"]["message"]
    assert "nested deeper than" in nested["error"]["message"]
    assert health == 200


def test_strict_types_rid_and_seed_limits_answer_400_naming_the_field(server) -> None:
    bad = [({"sampling_params": {**GREEDY, "ignore_eos": "false"}}, "ignore_eos must be true or false"),
           ({"sampling_params": {**GREEDY, "temperature": True}}, "temperature must be a finite number"),
           ({"sampling_params": {**GREEDY, "sampling_seed": 2**64}}, "sampling_seed must be an integer in"),
           ({"rid": "r" * 257, "sampling_params": GREEDY}, "at most 256 characters"),
           ({"stream": "false", "sampling_params": GREEDY}, "stream must be true or false")]

    async def body():
        async with aiohttp.ClientSession() as session:
            out = [await post(session, f"{server.url}/generate", {"input_ids": PROMPT, **b}) for b, _ in bad]
            out.append(await post(session, f"{server.url}/abort_request", {"rid": "r" * 257}))
            out.append(await post(session, f"{server.url}/generate", {"rid": "r" * 256, "input_ids": PROMPT,
                                                                     "sampling_params": GREEDY}))
            return out

    answers = run(body())
    for (status, payload), (_, fragment) in zip(answers, bad):
        assert status == 400 and fragment in payload["error"]["message"], payload
    assert answers[-2][0] == 400 and "at most 256 characters" in answers[-2][1]["error"]["message"]
    assert answers[-1][0] == 200 and answers[-1][1]["meta_info"]["id"] == "r" * 256


# Corrupt weight files ------------------------------------------------------------------------------

def _corrupt_checkpoints(tmp_path) -> dict[str, tuple[str, str, str]]:
    """name -> (checkpoint directory, the path the message must name, what it must say is wrong)."""
    good = tiny_model(seed=1)
    save_pretrained(good, tmp_path / "good")
    blob = (tmp_path / "good" / "model.safetensors").read_bytes()
    cases = {}
    for name, content, wrong in (("truncated", blob[:len(blob) // 2], "safetensors"),
                                 ("garbage", b"\x07not a safetensors file" * 50, "safetensors"),
                                 ("empty", b"", "safetensors")):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(content)
        cases[name] = (str(directory), str(directory / "model.safetensors"), wrong)
    wide = tiny_model(config=good.config.replace(vocab_size=103))
    save_pretrained(wide, tmp_path / "shapes")
    cases["shapes"] = (str(tmp_path / "shapes"), str(tmp_path / "shapes"), "has shape (103, 64)")
    renamed = {name.replace("mlp", "ffn"): p.detach() for name, p in good.named_parameters()}
    (tmp_path / "names").mkdir()
    save_file(renamed, str(tmp_path / "names" / "model.safetensors"))
    cases["names"] = (str(tmp_path / "names"), str(tmp_path / "names"), "is not a parameter of this model")
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "model.safetensors.index.json").write_text("{not json")
    cases["index"] = (str(tmp_path / "index"), str(tmp_path / "index" / "model.safetensors.index.json"),
                      "not a safetensors index")
    return cases


def test_corrupt_weight_files_answer_400_and_keep_the_old_weights(tmp_path, model_copy) -> None:
    cases = _corrupt_checkpoints(tmp_path)
    want = greedy_reference(model_copy, PROMPT, 4)

    async def body(url):
        async with aiohttp.ClientSession() as session:
            out = {name: await post(session, f"{url}/update_weights_from_disk",
                                    {"model_path": path, "weight_version": "broken"})
                   for name, (path, _, _) in cases.items()}
            out["version"] = await get(session, f"{url}/model_info")
            out["generate"] = await post(session, f"{url}/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
            return out

    core = engine(tiny_model(), memory_tag_prefix="server-limits-weights-")
    with one_torch_thread(), ServerThread(core, ServerConfig(port=0)) as s:
        out = run(body(s.url))
        engine_version = core.weight_version
    for name, (_, named, wrong) in cases.items():
        status, payload = out[name]
        assert status == 400, (name, payload)
        assert payload["success"] is False
        assert named in payload["message"] and wrong in payload["message"], (name, payload["message"])
    assert out["version"][0] == 200 and out["version"][1]["weight_version"] == "default" and engine_version == 0
    assert out["generate"][0] == 200
    assert out["generate"][1]["output_ids"] == want and out["generate"][1]["meta_info"]["weight_version"] == "default"
