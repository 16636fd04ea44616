"""Training runs with `step_boundary="carry"`: the CLI flag, colocated runs (the KV cache released with a
host copy while the trainer trains), checkpoints that save carried samples as partials (re-prefilled once
by a resumed run), and SGLang servers on loopback (pause in place, update, continue)."""

from __future__ import annotations

import asyncio
import json

import pytest
from _sglang_utils import counting_checkpoint, live_server
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext import ConfigError, cli, memory
from april_ext.model import load_pretrained
from april_ext.training import TrainConfig, TrainingRun, train

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(counting_median=3.0, counting_sigma=1.0, counting_max_count=12, counting_symbols=2, hidden_size=16,
            num_layers=1, rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=5,
            max_num_seqs=8, num_blocks=256, lr=0.003, progress=False, plots=False, step_boundary="carry")
# 8 engine slots for 20 samples: the tiny model ends its responses within a few engine steps of each other,
# so samples are still running (or queued in the engine) when N groups are accepted only when slots are few.


def tiny(tmp_path, name: str = "run", **changes) -> TrainConfig:
    return TrainConfig(**{**TINY, "output_dir": str(tmp_path / name), "num_steps": 4, **changes})


def _rows(path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _check_carried(rows: list[dict]) -> None:
    assert sum(r["rollout/carried_samples"] for r in rows) > 0
    for r in rows:
        assert r["rollout/aborted_samples"] == 0 and r["rollout/resumed_requests"] == 0
        assert r["rollout/re_prefill_tokens"] == 0
        assert (r["rollout/carried_samples"] > 0) == (r["rollout/carried_kv_tokens"] > 0)


def test_cli_train_with_step_boundary_carry(tmp_path, capsys):
    out = tmp_path / "cli"
    flags = ["--counting-median", "3", "--counting-sigma", "1", "--counting-max-count", "12", "--counting-symbols",
             "2", "--hidden-size", "16", "--num-layers", "1", "--rollout-batch-size", "2",
             "--n-samples-per-prompt", "4", "--over-sampling-batch-size", "5", "--max-num-seqs", "8", "--num-steps", "4",
             "--no-progress", "--no-plots", "--output-dir", str(out)]
    assert cli.main(["train", *flags, "--step-boundary", "carry"]) == 0
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    _check_carried(rows)
    assert cli.main(["train", *flags, "--output-dir", str(tmp_path / "abort")]) == 0  # abort stays the default
    aborted = _rows(tmp_path / "abort" / "metrics.jsonl")
    assert all(r["rollout/carried_samples"] == 0 for r in aborted)
    assert sum(r["rollout/re_prefill_tokens"] for r in aborted) > 0
    assert "re-prefilled tok/step" in capsys.readouterr().out


@pytest.mark.parametrize("colocate", [False, True])
def test_carried_samples_keep_their_kv_through_training_and_the_update(tmp_path, colocate):
    async def body():
        async with TrainingRun(tiny(tmp_path, colocate=colocate)) as run:
            while not run.done:
                await run.step()
            core = run.engine.core  # type: ignore[attr-defined]
            stats = core.stats()
            backup = core.config.kv_cache_cpu_backup
            result = await run.finish()
        return result, stats, backup

    result, stats, backup = asyncio.run(body())
    _check_carried(result.history)
    assert stats.preemptions == 0  # no carried sample was recomputed (colocated: its KV came back from host)
    assert backup == colocate
    if colocate:
        kv = memory.stats()[result.memory_tag_prefix + "kv_cache"]
        assert kv.pauses == 4 and not kv.paused


def test_evaluation_between_steps_runs_while_samples_are_carried(tmp_path):
    result = train(tiny(tmp_path, eval_interval=1, eval_counting_prompts=4, num_steps=3))
    _check_carried(result.history)
    assert all(0 <= r["eval/reward_mean"] <= 1 for r in result.history)


def test_a_checkpoint_saves_carried_samples_as_partials_and_a_resumed_run_re_prefills_them_once(tmp_path):
    async def first():
        async with TrainingRun(tiny(tmp_path, num_steps=3)) as run:
            while not run.done:
                await run.step()
            carried = run.rollout.carried
            await run.finish()
        return carried

    carried = asyncio.run(first())
    assert carried > 0
    resumed = train(tiny(tmp_path, num_steps=6, resume=True))
    assert resumed.resumed_from == 3
    rows = resumed.history[3:]
    # Step 4 dispatches the saved partials as resumes (their KV was not saved): one re-prefill each (carried
    # samples still queued in the engine had no token yet: they start afresh).
    assert 0 < rows[0]["rollout/resumed_requests"] <= carried and rows[0]["rollout/re_prefill_tokens"] > 0
    assert rows[0]["rollout/carried_samples"] == 0
    for r in rows[1:]:
        assert r["rollout/resumed_requests"] == 0 and r["rollout/re_prefill_tokens"] == 0


def test_carry_over_sglang_servers_pauses_in_place_updates_and_continues(tmp_path):
    ckpt = counting_checkpoint(tmp_path / "ckpt")
    with live_server(load_pretrained(ckpt), block_size=16, max_num_seqs=TINY["max_num_seqs"]) as server:
        result = train(tiny(tmp_path, engine="sglang", sglang_urls=(server.url,), model=ckpt))
    _check_carried(result.history)
    assert [r["engine/server_weight_versions"] for r in result.history] == [["1"], ["2"], ["3"], ["4"]]


def test_colocated_carry_needs_the_embedded_engine(tmp_path):
    with pytest.raises(ConfigError, match="step_boundary='carry' with colocate needs the embedded engine"):
        train(tiny(tmp_path, engine="sglang", sglang_urls=("http://127.0.0.1:1",), colocate=True,
                   model=str(tmp_path)))
