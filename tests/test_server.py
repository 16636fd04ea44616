"""The SGLang HTTP API of the embedded engine: the request rules, then a live server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest
import torch
from _engine_utils import greedy_reference, greedy_with_carried_kv, tiny_model
from _sglang_utils import engine_state, get, in_flight, live_server, post, stream_events, wait_for
from _torch_threads import one_torch_thread

from april_ext.batch import FinishReason
from april_ext.cli import build_parser
from april_ext.cli.serve import add_parser, build_core
from april_ext.errors import InvalidArgumentError
from april_ext.model import save_pretrained
from april_ext.protocol import sglang_wire
from april_ext.server import ServerThread, decode_named_tensors, encode_named_tensors
from april_ext.sglang import SGLangServerArgs, launch_sglang_server

PROMPT = [5, 17, 33, 2, 60]
LONG = {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True}


# Request rules (no server) -------------------------------------------------------------------------

def test_parse_generate_maps_sglang_sampling_names() -> None:
    req = sglang_wire.parse_generate({
        "rid": "r1", "input_ids": [1, 2], "return_logprob": True, "stream": True,
        "sampling_params": {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
                            "stop_token_ids": [3, 4], "ignore_eos": True, "sampling_seed": 11,
                            "no_stop_trim": True, "skip_special_tokens": False, "min_p": 0.0, "n": 1}})
    assert (req.rid, req.input_ids, req.return_logprob, req.stream) == ("r1", [1, 2], True, True)
    p = req.params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.stop_token_ids, p.ignore_eos, p.seed) == \
        (7, 0.5, 0.9, 20, (3, 4), True, 11)
    defaults = sglang_wire.parse_generate({"input_ids": [1]})
    assert (defaults.rid, defaults.params.max_new_tokens, defaults.return_logprob, defaults.stream) == \
        (None, 128, False, False)


@pytest.mark.parametrize("body, fragment", [
    ({"text": "hello", "input_ids": [1]}, "either text or input_ids"),
    ({"text": ["a", "b"]}, "batched requests"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k must be -1 (disable) or at least 1"),
    ({"input_ids": [1], "return_hidden_states": True}, "return_hidden_states is not supported"),
    ({"input_ids": [1], "priority": "high"}, "priority must be an integer"),
    ({}, "input_ids is required"),
    ({"input_ids": [[1, 2], [3]]}, "batched requests"),
    ({"input_ids": "1 2"}, "must be a list"),
    ({"input_ids": [1], "unknown": 1}, "unknown fields ['unknown']"),
    ({"input_ids": [1], "rid": ""}, "rid must be a non-empty string"),
    ({"input_ids": [1], "stream": "yes"}, "stream must be true or false"),
    ({"input_ids": [1], "sampling_params": {"min_p": 0.3}}, "min_p=0.3 is not supported"),
    ({"input_ids": [1], "sampling_params": {"max_tokens": 3}}, "unknown fields ['max_tokens']"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens must be an integer >= 1"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": 3}}, "stop_token_ids must be a list"),
    ({"input_ids": [1], "top_logprobs_num": 5}, "top_logprobs_num is not supported"),
])
def test_parse_generate_rejects_with_a_message(body: dict, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        sglang_wire.parse_generate(body)
    assert fragment in str(err.value)


def test_finish_reasons_have_sglang_shapes() -> None:
    assert sglang_wire.finish_reason_json(None, None, 8, 3) is None
    assert sglang_wire.finish_reason_json(FinishReason.STOP, 2, 8, 3) == {"type": "stop", "matched": 2}
    assert sglang_wire.finish_reason_json(FinishReason.LENGTH, None, 8, 8) == {"type": "length", "length": 8}
    running = sglang_wire.finish_reason_json(FinishReason.ABORT, None, 8, 3)
    assert running == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert sglang_wire.finish_reason_json(FinishReason.ABORT, None, 8, 0)["message"] == "Abort in waiting queue"


def test_memory_tags_pause_modes_and_weight_bodies() -> None:
    assert sglang_wire.parse_memory_tags(None, "x") is None
    assert sglang_wire.parse_memory_tags({"tags": ["kv_cache", "cuda_graph", "kv_cache"]}, "x") == ["kv_cache"]
    with pytest.raises(InvalidArgumentError, match="unknown memory tags"):
        sglang_wire.parse_memory_tags({"tags": ["activations"]}, "x")
    assert sglang_wire.parse_pause(None) == "abort"
    assert [sglang_wire.parse_pause({"mode": m}) for m in ("retract", "in_place")] == ["retract", "in_place"]
    with pytest.raises(InvalidArgumentError, match="mode must be one of"):
        sglang_wire.parse_pause({"mode": "later"})
    # A release without modes reads no body: its pause always aborts.
    assert sglang_wire.parse_pause({"mode": "retract"}, sglang_wire.DIALECTS["0.5.3"]) == "abort"
    disk = sglang_wire.parse_weights_from_disk({"model_path": "/ckpt", "weight_version": 4, "flush_cache": True})
    assert (disk.model_path, disk.weight_version, disk.abort_all_requests) == ("/ckpt", "4", False)
    with pytest.raises(InvalidArgumentError, match="load_format"):
        sglang_wire.parse_weights_from_tensor({"serialized_named_tensors": ["x"], "load_format": "flattened_bucket"})
    assert sglang_wire.parse_weight_version({"new_version": "v2"}) == ("v2", True)


def test_named_tensors_round_trip_and_bad_blobs() -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    back = decode_named_tensors(encode_named_tensors(tensors))
    assert set(back) == {"a", "b"}
    assert torch.equal(back["a"], tensors["a"]) and back["b"].dtype == torch.bfloat16
    with pytest.raises(InvalidArgumentError, match="not base64 of a safetensors blob"):
        decode_named_tensors("bm90IGEgYmxvYg==")


def test_serve_cli_builds_a_random_engine_from_a_config(tmp_path) -> None:
    import argparse

    tiny_model().config.save_pretrained(tmp_path)
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--random-init-config", str(tmp_path / "config.json"), "--port", "0",
                              "--num-blocks", "32", "--block-size", "8", "--seed", "3"])
    core = build_core(args)
    assert core.config.num_blocks == 32 and core.config.block_size == 8
    assert core.model_config.vocab_size == tiny_model().config.vocab_size
    assert args.func.__name__ == "run"
    assert build_parser().parse_args(["serve", "--model-path", "/ckpt", "--enable-memory-saver"]).func is args.func
    compat = build_parser().parse_args(["serve", "--model-path", "/ckpt", "--sglang-compat", "0.5.3",
                                        "--tokenizer-path", "/tok"])
    assert (compat.sglang_compat, compat.tokenizer_path, args.sglang_compat) == ("0.5.3", "/tok", "current")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model-path", "/ckpt", "--sglang-compat", "0.3"])
    args.tp = 2
    with pytest.raises(Exception, match="--tp must be 1"):
        build_core(args)


# Live server ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    """The reference copy of the served weights (the server owns its own instance)."""
    return tiny_model()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with one_torch_thread(), live_server(tiny_model()) as s:
        yield s


def run(coro):
    return asyncio.run(coro)


def test_generate_greedy_with_logprobs_and_meta_info(server, model) -> None:
    async def body():
        async with aiohttp.ClientSession() as session:
            return await post(session, f"{server.url}/generate", {
                "rid": "g-1", "input_ids": PROMPT, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}})

    status, out = run(body())
    assert status == 200
    assert out["output_ids"] == greedy_reference(model, PROMPT, 12)
    meta = out["meta_info"]
    assert meta["id"] == "g-1"
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (5, 12, 0)
    assert meta["weight_version"] == "default"
    rows = meta["output_token_logprobs"]
    assert [r[1] for r in rows] == out["output_ids"] and all(r[2] is None for r in rows)
    # Greedy logprobs are log_softmax of the full-sequence logits at each position.
    with torch.no_grad():
        logits = model(torch.tensor(PROMPT + out["output_ids"])[None])[0].float()
    expected = torch.log_softmax(logits[len(PROMPT) - 1:-1], -1).gather(1, torch.tensor(out["output_ids"])[:, None])
    assert torch.allclose(torch.tensor([r[0] for r in rows]), expected[:, 0], atol=1e-4)
    assert "text" not in out


def test_stream_sends_cumulative_events_then_done(server) -> None:
    body = {"input_ids": PROMPT, "return_logprob": True, "stream": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}

    async def both():
        async with aiohttp.ClientSession() as session:
            events = await stream_events(session, f"{server.url}/generate", body)
            _, whole = await post(session, f"{server.url}/generate", {**body, "stream": False})
            return events, whole

    events, whole = run(both())
    assert events[-1] == "[DONE]"
    data = events[:-1]
    assert len(data) == 6
    for i, event in enumerate(data):
        assert event["output_ids"] == whole["output_ids"][:i + 1]
        assert len(event["meta_info"]["output_token_logprobs"]) == i + 1
        assert event["meta_info"]["completion_tokens"] == i + 1
        if i < 5:
            assert event["meta_info"]["finish_reason"] is None
    assert data[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert data[-1]["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]


def test_stream_interval_sends_every_kth_token_and_splits_events_at_weight_updates(model, tmp_path) -> None:
    new_model = tiny_model(seed=1)
    save_pretrained(new_model, tmp_path / "ckpt")
    body = {"input_ids": PROMPT, "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}}

    async def both(url):
        async with aiohttp.ClientSession() as session:
            plain = await stream_events(session, f"{url}/generate", body)
            task = asyncio.create_task(stream_events(session, f"{url}/generate", {
                **body, "sampling_params": {**body["sampling_params"], "max_new_tokens": 60}}))
            await wait_for(lambda: _generated_at_least(session, url, 10 + 6))
            await post(session, f"{url}/update_weights_from_disk",
                       {"model_path": str(tmp_path / "ckpt"), "weight_version": "1"})
            return plain, await task

    with one_torch_thread(), live_server(tiny_model(), stream_interval=4) as s:
        plain, updated = run(both(s.url))
    assert [len(e["output_ids"]) for e in plain[:-1]] == [4, 8, 10] and plain[-1] == "[DONE]"
    assert plain[-2]["meta_info"]["output_token_logprobs"][-1][1] == plain[-2]["output_ids"][-1]
    events = updated[:-1]
    versions = [e["meta_info"]["weight_version"] for e in events]
    sizes = [len(e["output_ids"]) for e in events]
    assert all(0 < b - a <= 4 for a, b in zip([0] + sizes, sizes))
    switch = versions.index("1")
    assert switch > 0 and set(versions[:switch]) == {"default"} and set(versions[switch:]) == {"1"}
    # The events labelled "default" hold exactly the old weights' tokens, the rest the new weights' (decoding
    # over the KV cache the old ones computed: the update keeps it).
    tokens, start = events[-1]["output_ids"], sizes[switch - 1]
    assert len(tokens) == 60
    assert tokens[:start] == greedy_reference(model, PROMPT, start)
    expected, _ = greedy_with_carried_kv(model, new_model, PROMPT + tokens[:start], len(PROMPT) + start - 1, 60 - start)
    assert tokens[start:] == expected


async def _generated_at_least(session, url: str, n: int) -> bool:
    _, info = await get(session, f"{url}/server_info")
    return info["internal_states"][0]["generated_tokens"] >= n


def test_stop_token_ends_with_matched(server, model) -> None:
    greedy = greedy_reference(model, PROMPT, 8)
    stop = greedy[3]
    first = greedy.index(stop)

    async def body():
        async with aiohttp.ClientSession() as session:
            return await post(session, f"{server.url}/generate", {
                "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0,
                                                         "stop_token_ids": [stop]}})

    status, out = run(body())
    assert status == 200
    assert out["output_ids"] == greedy[:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_abort_running_request_returns_partial_output_and_matches_rid_prefixes(server) -> None:
    async def body():
        async with aiohttp.ClientSession() as session:
            url = f"{server.url}/generate"
            a = asyncio.create_task(post(session, url, {"rid": "job-1", "input_ids": PROMPT, "return_logprob": True,
                                                        "sampling_params": LONG}))
            b = asyncio.create_task(post(session, url, {"rid": "job-10", "input_ids": PROMPT,
                                                        "sampling_params": LONG}))
            c = asyncio.create_task(post(session, url, {"rid": "other", "input_ids": PROMPT,
                                                        "sampling_params": {**LONG, "max_new_tokens": 40}}))
            await wait_for(lambda: _in_flight_at_least(session, server.url, 3))
            await asyncio.sleep(0.05)
            # Not in flight: SGLang ignores it (no prefix match on unknown rids).
            assert (await post(session, f"{server.url}/abort_request", {"rid": "job"}))[0] == 200
            status, text = await post(session, f"{server.url}/abort_request", {"rid": "job-1"})
            assert (status, text) == (200, "")
            return await a, await b, await c

    (sa, a), (sb, b), (sc, c) = run(body())
    assert sa == sb == sc == 200
    for out in (a, b):
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort"
        assert 0 < out["meta_info"]["completion_tokens"] == len(out["output_ids"]) < 200
        if out["output_ids"]:
            assert reason["message"] == "Aborted"
    assert len(a["meta_info"]["output_token_logprobs"]) == len(a["output_ids"])
    assert c["meta_info"]["finish_reason"] == {"type": "length", "length": 40}


def test_abort_queued_request_and_abort_all() -> None:
    async def body(url):
        async with aiohttp.ClientSession() as session:
            gen = f"{url}/generate"
            running = asyncio.create_task(post(session, gen, {"rid": "run", "input_ids": PROMPT,
                                                              "sampling_params": LONG}))
            await wait_for(lambda: _first_token(session, url))
            queued = asyncio.create_task(post(session, gen, {"rid": "wait", "input_ids": PROMPT,
                                                             "sampling_params": LONG}))
            await wait_for(lambda: _in_flight_at_least(session, url, 2))
            await post(session, f"{url}/abort_request", {"rid": "wait"})
            q_status, q = await queued
            assert not running.done()
            await post(session, f"{url}/abort_request", {"rid": "", "abort_all": True})
            r_status, r = await running
            return (q_status, q), (r_status, r)

    with one_torch_thread(), live_server(max_num_seqs=1) as s:
        (qs, q), (rs, r) = run(body(s.url))
    assert qs == rs == 200
    assert q["meta_info"]["finish_reason"]["message"] == "Abort in waiting queue"
    assert q["meta_info"]["completion_tokens"] == 0 and q["output_ids"] == []
    assert r["meta_info"]["finish_reason"]["message"] == "Aborted"
    assert 0 < len(r["output_ids"]) < 200


async def _in_flight_at_least(session, url: str, n: int) -> bool:
    return await in_flight(session, url) >= n


async def _first_token(session, url: str) -> bool:
    _, info = await get(session, f"{url}/server_info")
    return info["internal_states"][0]["generated_tokens"] > 0


def test_bad_input_answers_400_and_the_server_keeps_serving(server) -> None:
    async def body():
        async with aiohttp.ClientSession() as session:
            gen = f"{server.url}/generate"
            results = [
                await post(session, gen, {"input_ids": [1, 10_000]}),
                await post(session, gen, {"input_ids": [1], "sampling_params": {"temperature": -1}}),
                await post(session, gen, {"input_ids": [1] * 300, "sampling_params": {"max_new_tokens": 8}}),
                await post(session, gen, {"input_ids": [1], "stream": True, "sampling_params": {"top_p": 0}}),
                await post(session, f"{server.url}/abort_request", {"rid": 5}),
            ]
            async with session.post(gen, data=b"{not json", headers={"Content-Type": "application/json"}) as resp:
                results.append((resp.status, await resp.json()))
            ok = await post(session, gen, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
            health = (await get(session, f"{server.url}/health_generate"))[0]
            return results, ok, health

    results, ok, health = run(body())
    for status, payload in results:
        assert status == 400
        assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]
    assert "outside the vocabulary" in results[0][1]["error"]["message"]
    assert "exceeds the context limit" in results[2][1]["error"]["message"]
    assert "not valid JSON" in results[5][1]["error"]["message"]
    assert ok[0] == 200 and ok[1]["meta_info"]["completion_tokens"] == 2
    assert health == 200


def test_health_and_server_info(server) -> None:
    async def body():
        async with aiohttp.ClientSession() as session:
            return [await get(session, f"{server.url}{path}") for path in
                    ("/health", "/health_generate", "/server_info", "/get_server_info", "/model_info",
                     "/get_model_info", "/get_weight_version", "/no_such_endpoint")]

    (h, _), (hg, _), (si, info), (gsi, alias), (mi, model_info), (gmi, _), (wv, _), (missing, _) = run(body())
    # As the current SGLang release: /get_weight_version is gone, the version is in /model_info.
    assert (h, hg, si, gsi, mi, gmi, wv, missing) == (200, 200, 200, 200, 200, 200, 404, 404)
    assert info["skip_tokenizer_init"] is True and info["page_size"] == 4 and info["tp_size"] == 1
    assert info["max_total_num_tokens"] == 1024 and info["weight_version"] == "default"
    assert info["port"] == int(server.url.rsplit(":", 1)[1])
    assert info["version"] == sglang_wire.SGLANG_RELEASE and info["engine"] == "april_ext"
    assert alias["weight_version"] == info["weight_version"] and "internal_states" in alias
    assert model_info["is_generation"] is True and model_info["weight_version"] == "default"


def test_weight_updates_from_disk_and_tensor_change_outputs_and_versions(tmp_path) -> None:
    first, second = tiny_model(seed=0), tiny_model(seed=1)
    save_pretrained(second, tmp_path / "v7")
    want_first, want_second = greedy_reference(first, PROMPT, 6), greedy_reference(second, PROMPT, 6)
    assert want_first != want_second
    gen_body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0,
                                                         "ignore_eos": True}}

    async def body(url):
        async with aiohttp.ClientSession() as session:
            out = {}
            out["disk"] = await post(session, f"{url}/update_weights_from_disk",
                                     {"model_path": str(tmp_path / "v7"), "weight_version": "7"})
            out["after_disk"] = await post(session, f"{url}/generate", gen_body)
            # `first` is the served model itself (its parameters now hold `second`): encode a fresh copy.
            blob = encode_named_tensors(dict(tiny_model(seed=0).named_parameters()))
            out["tensor"] = await post(session, f"{url}/update_weights_from_tensor",
                                       {"serialized_named_tensors": [blob], "weight_version": "8"})
            out["after_tensor"] = await post(session, f"{url}/generate", gen_body)
            out["bad_path"] = await post(session, f"{url}/update_weights_from_disk",
                                         {"model_path": str(tmp_path / "missing"), "weight_version": "9"})
            out["bad_blob"] = await post(session, f"{url}/update_weights_from_tensor",
                                         {"serialized_named_tensors": ["AAAA"]})
            out["relabel"] = await post(session, f"{url}/update_weight_version", {"new_version": "8b"})
            out["after_relabel"] = await post(session, f"{url}/generate", gen_body)
            out["flush"] = await post(session, f"{url}/flush_cache")
            return out

    with one_torch_thread(), live_server(first) as s:
        out = run(body(s.url))
    assert out["disk"][0] == 200 and out["disk"][1]["success"] is True
    assert out["disk"][1]["num_paused_requests"] == 0
    assert out["after_disk"][1]["output_ids"] == want_second
    assert out["after_disk"][1]["meta_info"]["weight_version"] == "7"
    assert out["tensor"] == (200, {"success": True, "message": out["tensor"][1]["message"]})
    assert out["after_tensor"][1]["output_ids"] == want_first
    assert out["after_tensor"][1]["meta_info"]["weight_version"] == "8"
    assert out["bad_path"][0] == 400 and out["bad_path"][1]["success"] is False
    assert out["bad_blob"][0] == 400
    assert out["relabel"] == (200, {"success": True, "message": "Weight version updated to 8b", "new_version": "8b"})
    assert out["after_relabel"][1]["meta_info"]["weight_version"] == "8b"
    assert out["after_relabel"][1]["output_ids"] == want_first
    assert out["flush"][0] == 200


def test_release_needs_idle_server_and_two_stage_resume_restores_generation(tmp_path) -> None:
    model = tiny_model(seed=0)
    save_pretrained(model, tmp_path / "ckpt")
    want = greedy_reference(model, PROMPT, 5)
    gen_body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}}

    async def body(url):
        async with aiohttp.ClientSession() as session:
            out = {}
            running = asyncio.create_task(post(session, f"{url}/generate", {"input_ids": PROMPT,
                                                                            "sampling_params": LONG}))
            await wait_for(lambda: _in_flight_at_least(session, url, 1))
            out["busy_release"] = await post(session, f"{url}/release_memory_occupation", {"tags": None})
            out["busy_flush"] = await post(session, f"{url}/flush_cache")
            await post(session, f"{url}/abort_request", {"rid": "", "abort_all": True})
            await running
            out["release"] = await post(session, f"{url}/release_memory_occupation", {})
            out["health_released"] = (await get(session, f"{url}/health"))[0]
            out["health_generate_released"] = (await get(session, f"{url}/health_generate"))[0]
            _, info = await get(session, f"{url}/server_info")
            out["paused_tags"] = info["internal_states"][0]["paused_tags"]
            out["resume_weights"] = await post(session, f"{url}/resume_memory_occupation", {"tags": ["weights"]})
            out["update"] = await post(session, f"{url}/update_weights_from_disk",
                                       {"model_path": str(tmp_path / "ckpt"), "weight_version": "2"})
            out["resume_rest"] = await post(session, f"{url}/resume_memory_occupation",
                                            {"tags": ["kv_cache", "cuda_graph"]})
            out["generate"] = await post(session, f"{url}/generate", gen_body)
            return out

    with one_torch_thread(), live_server(model, weights_cpu_backup=False) as s:
        out = run(body(s.url))
    assert out["busy_release"][0] == 400 and "idle" in out["busy_release"][1]["error"]["message"]
    assert out["busy_flush"][0] == 400
    assert out["release"] == (200, None)
    assert out["health_released"] == 200 and out["health_generate_released"] == 503
    assert sorted(out["paused_tags"]) == ["kv_cache", "weights"]
    assert out["resume_weights"][0] == out["update"][0] == out["resume_rest"][0] == 200
    assert out["generate"][1]["output_ids"] == want
    assert out["generate"][1]["meta_info"]["weight_version"] == "2"


def test_release_without_memory_saver_is_refused() -> None:
    async def body(url):
        async with aiohttp.ClientSession() as session:
            return await post(session, f"{url}/release_memory_occupation", {"tags": ["kv_cache"]})

    with live_server(memory_saver=False) as s:
        status, payload = run(body(s.url))
    assert status == 400 and "--enable-memory-saver" in payload["error"]["message"]


def test_pause_aborts_running_and_holds_new_requests_until_continue(server) -> None:
    async def body():
        async with aiohttp.ClientSession() as session:
            url = server.url
            running = asyncio.create_task(post(session, f"{url}/generate", {"input_ids": PROMPT,
                                                                            "sampling_params": LONG}))
            await wait_for(lambda: _in_flight_at_least(session, url, 1))
            paused = await post(session, f"{url}/pause_generation", {"mode": "abort"})
            aborted = await running
            held = asyncio.create_task(post(session, f"{url}/generate", {
                "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}))
            await asyncio.sleep(0.3)
            held_while_paused = not held.done()
            resumed = await post(session, f"{url}/continue_generation")
            return paused, aborted, held_while_paused, resumed, await held

    paused, aborted, held_while_paused, resumed, held = run(body())
    assert paused == (200, {"message": "Generation paused successfully.", "status": "ok"})
    assert aborted[1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert held_while_paused
    assert resumed == (200, {"message": "Generation continued successfully.", "status": "ok"})
    assert held[0] == 200 and held[1]["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_in_place_or_retract_holds_requests_and_continue_finishes_them_unchanged(server, mode) -> None:
    """in_place keeps the running request and its KV cache; retract sends it back to the queue with its KV
    cache freed. Either way nothing is generated until continue, and the output is the uninterrupted one."""
    body_of = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 60, "temperature": 0.0,
                                                        "ignore_eos": True}}

    async def body():
        async with aiohttp.ClientSession() as session:
            url = server.url
            _, whole = await post(session, f"{url}/generate", body_of)
            running = asyncio.create_task(post(session, f"{url}/generate", body_of))
            await wait_for(lambda: _in_flight_at_least(session, url, 1))
            paused = await post(session, f"{url}/pause_generation", {"mode": mode})
            held_at = await engine_state(session, url)
            await asyncio.sleep(0.3)
            later = await engine_state(session, url)
            resumed = await post(session, f"{url}/continue_generation", {})
            return whole, paused, held_at, later, resumed, await running

    whole, paused, held_at, later, resumed, (status, out) = run(body())
    assert paused[0] == 200 and resumed[0] == 200
    assert later["generated_tokens"] == held_at["generated_tokens"]  # nothing ran while paused
    assert held_at["requests_in_flight"] == 1
    if mode == "in_place":
        assert (held_at["running"], held_at["waiting"]) == (1, 0) and held_at["free_blocks"] < held_at["total_blocks"]
    else:
        assert (held_at["running"], held_at["waiting"]) == (0, 1)
        assert held_at["free_blocks"] == held_at["total_blocks"]
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"] == whole["output_ids"]


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_weight_update_while_paused_keeps_the_kv_in_place_and_recomputes_on_retract(mode) -> None:
    """SGLang's semantics: after in_place + update + continue the held request decodes over the KV the old
    weights computed (nothing recomputed); after retract it is recomputed under the new weights."""
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    body_of = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40, "temperature": 0.0,
                                                        "ignore_eos": True}}

    async def body(url):
        async with aiohttp.ClientSession() as session:
            running = asyncio.create_task(post(session, f"{url}/generate", body_of))
            await wait_for(lambda: _in_flight_at_least(session, url, 1))
            await wait_for(lambda: _generated_at_least(session, url, 3))
            await post(session, f"{url}/pause_generation", {"mode": mode})
            held_at = await engine_state(session, url)
            blob = encode_named_tensors(dict(new.named_parameters()))
            updated = await post(session, f"{url}/update_weights_from_tensor",
                                 {"serialized_named_tensors": [blob], "weight_version": "1"})
            await post(session, f"{url}/continue_generation", {})
            result = await running
            return held_at, updated, result, await engine_state(session, url)

    with one_torch_thread(), live_server(tiny_model(seed=0)) as s:
        held_at, updated, (status, out), end = run(body(s.url))
    assert updated[0] == 200 and status == 200
    n = held_at["generated_tokens"]
    tokens = out["output_ids"]
    assert 3 <= n < 40 and tokens[:n] == greedy_reference(old, PROMPT, n)
    if mode == "in_place":
        expected, _ = greedy_with_carried_kv(old, new, PROMPT + tokens[:n], len(PROMPT) + n - 1, 40 - n)
        assert (end["prefill_tokens"], end["preemptions"]) == (held_at["prefill_tokens"], 0)
    else:
        expected = greedy_reference(new, PROMPT + tokens[:n], 40 - n)
        assert end["prefill_tokens"] == held_at["prefill_tokens"] + len(PROMPT) + n
    assert tokens[n:] == expected


def test_pause_modes_other_than_abort_need_an_engine_that_can_hold() -> None:
    from april_ext.sim import ClusterConfig, CostModel, SimulatedEngine, TraceLengths

    cost = CostModel(decode_fixed_s=1.0, decode_per_seq_s=0.0, decode_per_kv_token_s=0.0, prefill_per_token_s=0.0,
                     kv_capacity_tokens=10_000, max_num_seqs=8)

    async def body(url):
        async with aiohttp.ClientSession() as session:
            return (await post(session, f"{url}/pause_generation", {"mode": "in_place"}),
                    await post(session, f"{url}/pause_generation", {"mode": "abort"}),
                    await post(session, f"{url}/continue_generation", {}))

    class CannotHold:
        """The simulated engine without its pause / continue (which it has since the carry boundary)."""

        def __init__(self, engine: SimulatedEngine) -> None:
            self._engine = engine

        def __getattr__(self, name: str):
            if name in ("pause_generation", "continue_generation"):
                raise AttributeError(name)
            return getattr(self._engine, name)

    engine = SimulatedEngine(ClusterConfig(cost=cost, num_engines=1), TraceLengths([[3]]))
    with ServerThread(CannotHold(engine)) as s:
        refused, aborted, resumed = run(body(s.url))
    assert refused[0] == 400 and "cannot: use mode 'abort'" in refused[1]["error"]["message"]
    assert aborted[0] == 200 and resumed[0] == 200


def test_client_disconnect_aborts_its_request(server) -> None:
    async def body():
        url = server.url
        async with aiohttp.ClientSession() as session:
            _, info = await get(session, f"{url}/server_info")
            before = info["internal_states"][0]["generated_tokens"]
            async with session.post(f"{url}/generate", json={"rid": "gone", "input_ids": PROMPT, "stream": True,
                                                             "sampling_params": LONG}) as resp:
                await resp.content.readuntil(b"\n\n")
        async with aiohttp.ClientSession() as session:
            await wait_for(lambda: _engine_idle(session, url), timeout=10)
            _, info = await get(session, f"{url}/server_info")
            return info["internal_states"][0]["generated_tokens"] - before

    # Stopped by the disconnect well before its 200 tokens.
    assert 1 <= run(body()) < 200


async def _engine_idle(session, url: str) -> bool:
    _, info = await get(session, f"{url}/server_info")
    state = info["internal_states"][0]
    return state["running"] == state["waiting"] == state["requests_in_flight"] == 0


# Launched as a process -----------------------------------------------------------------------------

def test_launcher_runs_the_server_outside_the_callers_directory(tmp_path, monkeypatch, model) -> None:
    """A source checkout in the caller's directory must not shadow the installed april_ext (`python -m`
    imports from the working directory first): here a package there fails on import."""
    checkout = tmp_path / "checkout"
    (checkout / "april_ext").mkdir(parents=True)
    (checkout / "april_ext" / "__init__.py").write_text("raise ImportError('the checkout shadowed april_ext')\n")
    save_pretrained(model, checkout / "ckpt")
    monkeypatch.chdir(checkout)
    # Relative paths: resolved here, not in the server's directory.
    args = SGLangServerArgs(model_path="ckpt", extra_args=("--num-blocks", "64", "--block-size", "4",
                                                           "--max-request-bytes", "4096"))

    async def use(url):
        async with aiohttp.ClientSession() as session:
            out = await post(session, f"{url}/generate", {"input_ids": PROMPT, "sampling_params": {
                "max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}})
            too_big = await post(session, f"{url}/generate", {"input_ids": [1] * 2000})
            return out, too_big

    with launch_sglang_server(args, module="april_ext.server", env={"OMP_NUM_THREADS": "1"},
                              timeout_s=120) as server:
        (status, out), (big_status, big) = run(use(server.url))
    assert status == 200 and out["output_ids"] == greedy_reference(model, PROMPT, 4)
    assert big_status == 413 and "limit of 4096 bytes" in big["error"]["message"]
    assert server.process.returncode == 0
    assert not server.log_path.startswith(str(checkout))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A word-level tokenizer over the tiny model's vocabulary (ids 0-3 special, then words w4 ... w100)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[BOS]", "[EOS]", *(f"w{i}" for i in range(4, 101))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]",
                                   unk_token="[UNK]")
    path = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(path)
    return str(path)


def test_text_prompts_with_a_tokenizer_and_per_request_stream_interval(model, server, tokenizer_dir) -> None:
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}

    async def body(url):
        async with aiohttp.ClientSession() as session:
            by_text = await post(session, f"{url}/generate", {"text": "w5 w17 w33", "sampling_params": greedy})
            both = await post(session, f"{url}/generate", {"text": "w5", "input_ids": [5], "sampling_params": greedy})
            events = await stream_events(session, f"{url}/generate", {
                "text": "w5 w17 w33", "stream": True, "sampling_params": {**greedy, "stream_interval": 4}})
            return by_text, both, events

    async def token_only(url):
        async with aiohttp.ClientSession() as session:
            return await post(session, f"{url}/generate", {"text": "w5", "sampling_params": greedy})

    with one_torch_thread(), live_server(tiny_model(), tokenizer_path=tokenizer_dir) as s:
        (status, out), both, events = run(body(s.url))
    want = greedy_reference(model, [2, 5, 17, 33], 6)  # [BOS] w5 w17 w33
    assert status == 200 and out["output_ids"] == want and out["meta_info"]["prompt_tokens"] == 4
    words = [f"w{t}" for t in want if t > 3]  # the detokenized output skips special tokens, as SGLang's default
    assert out["text"].split() == words
    assert both[0] == 400 and "either text or input_ids" in both[1]["error"]["message"]
    # stream_interval 4 of 6 tokens: an event at 4, then the last at 6.
    assert [len(e["output_ids"]) for e in events[:-1]] == [4, 6] and events[-1] == "[DONE]"
    assert events[-2]["text"] == out["text"]
    refused = run(token_only(server.url))
    assert refused[0] == 400 and "needs a tokenizer" in refused[1]["error"]["message"]
