"""EngineCore end to end on a tiny model: correctness of generation, resume, preemption, abort, weights."""

from __future__ import annotations

import april_ext.triton_kernels as triton_kernels
import pytest
import torch
from _engine_utils import GREEDY, TINY, engine, greedy_reference, greedy_with_carried_kv, prompts, tiny_model

from april_ext.batch import FinishReason
from april_ext.engine import EngineConfig, EngineCore
from april_ext.engine.batch_scheduler import ScheduledChunk
from april_ext.engine.model_runner import ModelRunner
from april_ext.engine.sequence import Sequence
from april_ext.errors import (
    ConfigError,
    InternalError,
    InvalidArgumentError,
    UnknownIdError,
)
from april_ext.model import LlamaForCausalLM, save_pretrained
from april_ext.model.logits import processed_logprobs
from april_ext.protocol import SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def test_greedy_equals_full_sequence_reference(model) -> None:
    # A budget of 8 tokens per step forces chunked prefill mixed with decodes.
    core = engine(model, max_num_batched_tokens=8)
    batch = prompts(5, seed=1)
    outs = core.generate(batch, GREEDY)
    for prompt, out in zip(batch, outs):
        assert out.token_ids == greedy_reference(model, prompt, 16)
        assert out.finish_reason is FinishReason.LENGTH
        assert out.versions == [0] * 16 and out.prompt_ids == prompt
        # The greedy logprob is the raw log-softmax of the chosen token.
        with torch.no_grad():
            logits = model(torch.tensor(prompt + out.token_ids)[None])[0, len(prompt) - 1:-1]
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, rtol=1e-4, atol=1e-4)
    assert core.stats().running == 0 and core.stats().free_blocks == core.config.num_blocks


def test_triton_kernels_path_matches_the_torch_path(model) -> None:
    """The same tiny generation through the Triton kernels (interpreter on CPU) and through PyTorch."""
    batch = prompts(3, seed=2, high=9)
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    torch_out = engine(model, max_num_batched_tokens=8).generate(batch, params)
    triton_out = engine(model, max_num_batched_tokens=8, attention_backend="triton").generate(batch, params)
    assert [o.token_ids for o in triton_out] == [o.token_ids for o in torch_out]
    for a, b in zip(triton_out, torch_out):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


# (decode table, extend table, error) for a step of one decode token at position 5 and a 6-token prompt.
STEP_LAYOUTS = {
    "valid": ([3, 1], [0, 7], None),
    "page past the cache": ([3, 8], [0, 7], "entry 8 is not allowed"),
    "negative page": ([3, 1], [-1, 7], "entry -1 is not allowed"),
    "table too short": ([3], [0, 7], "has 1 pages, seq_len 6 needs 2"),
}


@pytest.mark.parametrize("layout", STEP_LAYOUTS, ids=list(STEP_LAYOUTS))
def test_step_metadata_is_checked_once_before_unchecked_kernel_launches(model, monkeypatch, layout) -> None:
    """The engine validates a step's indices itself, then launches the kernels without their per-call checks."""
    decode_table, extend_table, error = STEP_LAYOUTS[layout]
    launches: list[tuple[str, dict[str, object]]] = []

    def fake(name: str):
        def launch(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            launches.append((name, {k: v for k, v in kwargs.items() if k != "sm_scale"}))
            return torch.zeros_like(q)
        return launch

    for name in ("store_kv", "decode_attention", "extend_attention"):
        monkeypatch.setattr(triton_kernels, name, fake(name))
    runner = ModelRunner(model, num_blocks=8, block_size=4, use_triton=True,
                         allocate=lambda shape, dtype, tag: torch.zeros(shape, dtype=dtype))
    decoding = Sequence("d", list(range(6)), GREEDY, 0, frozenset())
    decoding.num_computed, decoding.block_table = 5, decode_table
    prefill = Sequence("p", list(range(6)), GREEDY, 0, frozenset())
    prefill.block_table = extend_table
    chunks = [ScheduledChunk(prefill, 6), ScheduledChunk(decoding, 1)]
    if error is None:
        assert len(runner.run(chunks)) == 2
        per_layer = [("store_kv", {"check_indices": False}), ("decode_attention", {"check_indices": False}),
                     ("extend_attention", {"check_indices": False, "max_extend_len": 6})]
        assert launches == per_layer * TINY.num_hidden_layers
    else:
        with pytest.raises(InternalError, match=error):
            runner.run(chunks)
        assert launches == []


def test_greedy_resume_equals_uninterrupted_generation(model) -> None:
    prompt = prompts(1, seed=3)[0]
    full = engine(model).generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=20))[0]
    core = engine(model)
    rid = core.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=20))
    while core.stats().generated_tokens < 7:
        core.step()
    partial = core.abort([rid])[0]
    assert partial.finish_reason is FinishReason.ABORT and len(partial.token_ids) == 7
    resumed = core.generate([prompt + partial.token_ids], SamplingParams(temperature=0.0, max_new_tokens=13))[0]
    assert partial.token_ids + resumed.token_ids == full.token_ids
    assert partial.logprobs + resumed.logprobs == pytest.approx(full.logprobs, abs=1e-4)


def test_seeded_sampling_resume_reproduces_draws_and_logprobs(model) -> None:
    prompt = prompts(1, seed=4)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_new_tokens=18)
    full = engine(model).generate([prompt], params)[0]
    again = engine(model).generate([prompt], params)[0]
    assert again.token_ids == full.token_ids
    other = engine(model).generate([prompt], SamplingParams(**{**params.__dict__, "seed": 99}))[0]
    assert other.token_ids != full.token_ids
    k = 6
    resumed = engine(model).generate([prompt + full.token_ids[:k]],
                                     SamplingParams(**{**params.__dict__, "max_new_tokens": 18 - k}))[0]
    assert resumed.token_ids == full.token_ids[k:]
    assert resumed.logprobs == pytest.approx(full.logprobs[k:], abs=1e-4)
    # Re-reading the response (as the trainer does) reproduces the behavior logprobs of every token.
    with torch.no_grad():
        logits = model(torch.tensor(prompt + full.token_ids)[None])[0, len(prompt) - 1:-1]
    reread = processed_logprobs(logits, [params] * len(full.token_ids))
    reread = reread.gather(-1, torch.tensor(full.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(reread, torch.tensor(full.logprobs), rtol=1e-4, atol=1e-4)


def test_output_is_independent_of_batch_traffic(model) -> None:
    target = prompts(1, seed=5, low=20, high=20)[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    sampled = SamplingParams(temperature=1.0, seed=5, max_new_tokens=24)
    alone = [engine(model).generate([target], [p])[0].token_ids for p in (greedy, sampled)]
    # A busy engine: small step budget, others joining, finishing and being aborted around the targets.
    core = engine(model, max_num_batched_tokens=12, max_num_seqs=6)
    others = prompts(12, seed=6)
    for p in others[:3]:
        core.add_request(p, SamplingParams(temperature=1.0, max_new_tokens=5))
    targets = [core.add_request(target, greedy), core.add_request(target, sampled)]
    victims = [core.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=30)) for p in others[3:6]]
    collected: dict[str, list[int]] = {rid: [] for rid in targets}
    step = 0
    while core.has_unfinished():
        for chunk in core.step():
            if chunk.request_id in collected:
                collected[chunk.request_id] += chunk.token_ids
        step += 1
        if step == 4:
            assert [o.finish_reason for o in core.abort(victims[:2])] == [FinishReason.ABORT] * 2
        if step % 3 == 0 and step < 30:
            core.add_request(others[6 + step % 6], SamplingParams(temperature=0.7, max_new_tokens=3 + step % 4))
    assert [collected[rid] for rid in targets] == alone


def test_preemption_under_a_tiny_kv_budget_completes_every_request(model) -> None:
    batch = prompts(6, seed=7, low=5, high=14)
    params = SamplingParams(temperature=0.0, max_new_tokens=14)
    # 12 blocks of 4 tokens: two full-length requests at most, so the engine must preempt and recompute.
    core = engine(model, num_blocks=12, max_num_batched_tokens=32, prefix_caching=False)
    outs = core.generate(batch, params)
    assert core.stats().preemptions > 0
    assert any(o.num_preemptions > 0 for o in outs)
    for prompt, out in zip(batch, outs):
        assert out.token_ids == greedy_reference(model, prompt, 14)
    assert core.stats().free_blocks == 12


def test_prefix_cache_reuses_shared_prompts_without_changing_results(model) -> None:
    prompt = prompts(1, seed=8, low=25, high=25)[0]
    core = engine(model)
    first = core.generate([prompt], GREEDY)[0]
    hits_before = core.stats().prefix_cache_hit_tokens
    second = core.generate([prompt, prompt], GREEDY)
    assert core.stats().prefix_cache_hit_tokens - hits_before >= 2 * 24
    assert [o.token_ids for o in second] == [first.token_ids] * 2


def test_stop_tokens_eos_and_ignore_eos(model) -> None:
    prompt = prompts(1, seed=9)[0]
    free = engine(model).generate([prompt], GREEDY)[0].token_ids
    stop = free[5]
    first = free.index(stop)
    out = engine(model).generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=16,
                                                          stop_token_ids=(stop,)))[0]
    assert out.token_ids == free[:first + 1]
    assert out.finish_reason is FinishReason.STOP and out.matched_stop == stop
    eos_model = tiny_model(seed=0, config=TINY.replace(eos_token_id=[stop]))
    eos_out = engine(eos_model).generate([prompt], GREEDY)[0]
    assert eos_out.token_ids == free[:first + 1] and eos_out.matched_stop == stop
    ignored = engine(eos_model).generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=16,
                                                                  ignore_eos=True))[0]
    assert ignored.token_ids == free and ignored.finish_reason is FinishReason.LENGTH


def test_abort_queued_running_and_all(model) -> None:
    core = engine(model, max_num_seqs=2)
    ids = [core.add_request(p, GREEDY) for p in prompts(4, seed=10)]
    for _ in range(3):
        core.step()
    stats = core.stats()
    assert (stats.running, stats.waiting) == (2, 2)
    queued = core.abort([ids[3]])[0]
    assert queued.token_ids == [] and queued.finish_reason is FinishReason.ABORT
    running = core.abort(ids[0])[0]
    assert 0 < len(running.token_ids) == len(running.logprobs) == len(running.versions) < 16
    with pytest.raises(UnknownIdError, match="nope"):
        core.abort(["nope", ids[1]])
    rest = core.abort()
    assert sorted(o.request_id for o in rest) == sorted([ids[1], ids[2]])
    assert not core.has_unfinished() and core.stats().free_blocks == core.config.num_blocks
    with pytest.raises(UnknownIdError):
        core.abort([ids[1]])
    # Still serving.
    assert core.generate([[1, 2, 3]], GREEDY)[0].token_ids == greedy_reference(model, [1, 2, 3], 16)


def test_update_weights_mid_stream_switches_versions(model, tmp_path) -> None:
    new_model = tiny_model(seed=1)
    core = engine(tiny_model(seed=0))
    prompt = prompts(1, seed=11)[0]
    rid = core.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=12))
    chunks = []
    while core.stats().generated_tokens < 5:
        chunks += core.step()
    loaded = core.update_weights(dict(new_model.named_parameters()), version=1)
    assert "model.layers.0.mlp.up_proj.weight" in loaded
    while core.has_unfinished():
        chunks += core.step()
    tokens = [t for c in chunks for t in c.token_ids]
    versions = [c.weight_version for c in chunks for _ in c.token_ids]
    assert versions == [0] * 5 + [1] * 7
    # After the update the request continues under the new weights over the KV the old ones computed
    # (prompt + 4 tokens; the 5th was sampled but not yet run).
    assert core.stats().preemptions == 0
    expected, _ = greedy_with_carried_kv(tiny_model(seed=0), new_model, prompt + tokens[:5], len(prompt) + 4, 7)
    assert tokens[5:] == expected
    assert chunks[-1].finish_reason is FinishReason.LENGTH and chunks[-1].request_id == rid
    # From a checkpoint directory.
    save_pretrained(tiny_model(seed=2), tmp_path)
    core.update_weights(str(tmp_path), version=2)
    assert core.generate([prompt], GREEDY)[0].versions == [2] * 16


def test_bad_weights_are_rejected_and_change_nothing(model) -> None:
    core = engine(tiny_model(seed=0))
    before = core.generate([[5, 6, 7]], GREEDY)[0].token_ids
    with pytest.raises(InvalidArgumentError, match="not a parameter"):
        core.update_weights({"model.layers.0.attn.weight": torch.zeros(3)}, version=1)
    with pytest.raises(InvalidArgumentError, match="shape"):
        core.update_weights({"model.norm.weight": torch.zeros(65)}, version=1)
    with pytest.raises(InvalidArgumentError, match="version"):
        core.update_weights({}, version="2")  # type: ignore[arg-type]
    assert core.weight_version == 0
    assert core.generate([[5, 6, 7]], GREEDY)[0].token_ids == before


@pytest.mark.parametrize("ids, params, match", [
    ([], GREEDY, "got an empty sequence"),
    ([1, 101], GREEDY, "outside the vocabulary"),
    ([1, -1], GREEDY, r"integers >= 0\), got \[-1\]"),
    ([1, 2.5], GREEDY, r"integers >= 0\), got \[2.5\]"),
    ("abc", GREEDY, "sequence of token ids"),
    ([1] * 10, SamplingParams(max_new_tokens=250), "exceeds the context limit"),
])
def test_bad_requests_raise_and_the_engine_keeps_serving(model, ids, params, match) -> None:
    core = engine(model)
    with pytest.raises(InvalidArgumentError, match=match):
        core.add_request(ids, params)
    assert not core.has_unfinished()
    assert core.generate([[4, 5]], GREEDY)[0].token_ids == greedy_reference(model, [4, 5], 16)


def test_duplicate_request_ids_and_bad_configs(model) -> None:
    core = engine(model)
    core.add_request([1], GREEDY, request_id="x")
    with pytest.raises(InvalidArgumentError, match="already in use"):
        core.add_request([2], GREEDY, request_id="x")
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ConfigError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ConfigError, match="max_model_len"):
        EngineCore(model, EngineConfig(max_model_len=10_000))


def test_bfloat16_engine_follows_the_bfloat16_model(model) -> None:
    bf16 = LlamaForCausalLM(TINY, dtype=torch.bfloat16)
    bf16.load_weights(model.named_parameters())
    out = engine(bf16).generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    assert out.token_ids == greedy_reference(bf16, [1, 2, 3, 4], 6)
