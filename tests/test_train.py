"""End-to-end training runs (seconds each): APRIL and baseline, resume, colocated memory hand-off, a run
killed with SIGKILL and resumed, a prompt file running out, and clear errors for bad configs and data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from april_ext import ConfigError, InvalidArgumentError, Scheduler, SchedulerConfig, memory
from april_ext.tasks import CountingTask, CountingTaskConfig
from april_ext.training import CheckpointManager, TrainConfig, train

from _torch_threads import one_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(counting_median=3.0, counting_sigma=0.8, counting_max_count=12, counting_symbols=2, hidden_size=16,
            num_layers=1, rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=4,
            max_num_seqs=64, num_blocks=256, lr=0.003, progress=False, plots=False)


def tiny(tmp_path, name: str = "run", **changes) -> TrainConfig:
    return TrainConfig(**{**TINY, "output_dir": str(tmp_path / name), "num_steps": 3, **changes})


def _rows(path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


@pytest.mark.parametrize("partial", [True, False])
def test_end_to_end_run_writes_metrics_plots_and_checkpoint(tmp_path, partial):
    result = train(tiny(tmp_path, partial_rollout=partial, plots=partial))
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] == [r["step"] for r in result.history]
    assert [r["policy_version"] for r in rows] == [0, 1, 2]
    assert all(r["variant"] == ("april" if partial else "baseline") for r in rows)
    for r in rows:
        assert r["rollout/batch_groups"] == 2 and len(r["rollout/response_lens"]) == 8
        assert r["train/version"] == r["policy_version"] + 1
    if not partial:
        assert all(r["rollout/aborted_samples"] == 0 and r["rollout/carried_token_ratio"] == 0 for r in rows)
    else:
        assert (tmp_path / "run" / "training.png").stat().st_size > 0
        assert (tmp_path / "run" / "response_lengths.png").stat().st_size > 0
    assert result.checkpoint is not None and result.checkpoint.endswith("step_000003")
    assert result.summary["steps"] == 3 and result.summary["rollout_tokens_per_s"] > 0


def test_resume_continues_from_the_newest_checkpoint(tmp_path):
    first = train(tiny(tmp_path, num_steps=3, save_interval=1, keep_checkpoints=2))
    saved = CheckpointManager(tmp_path / "run" / "checkpoints").list()
    assert [c.step for c in saved] == [2, 3]  # keep the newest 2
    resumed = train(tiny(tmp_path, num_steps=5, save_interval=1, resume=True))
    assert resumed.resumed_from == 3
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[:3] == first.history
    assert [r["policy_version"] for r in rows] == [0, 1, 2, 3, 4]
    # Resuming a finished run trains nothing more.
    again = train(tiny(tmp_path, num_steps=5, resume=True))
    assert again.resumed_from == 5 and len(again.history) == 5


def test_colocated_run_pauses_trainer_and_engine_memory_in_turn(tmp_path):
    result = train(tiny(tmp_path, colocate=True, num_steps=2))
    assert len(result.history) == 2
    tags = memory.stats()
    prefix = result.memory_tag_prefix
    trainer, kv, weights = (tags[prefix + t] for t in ("trainer", "kv_cache", "weights"))
    # The trainer's memory is paused for each rollout, the engine's for each training step; both are
    # resident again at the end.
    assert trainer.pauses == 2 and trainer.resumes == 2 and not trainer.paused
    assert kv.pauses == 2 and kv.resumes >= 2 and not kv.paused
    assert weights.pauses == 2 and not weights.paused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_colocated_run_on_the_gpu(tmp_path):
    result = train(tiny(tmp_path, device="cuda", colocate=True, num_steps=3, save_interval=1))
    assert [r["step"] for r in result.history] == [1, 2, 3]
    tags = memory.stats()
    trainer = tags[result.memory_tag_prefix + "trainer"]
    kv = tags[result.memory_tag_prefix + "kv_cache"]
    assert trainer.pauses == 3 and not trainer.paused and trainer.resident_bytes > 0
    assert kv.pauses == 3 and not kv.paused
    resumed = train(tiny(tmp_path, device="cuda", colocate=True, num_steps=4, resume=True))
    assert resumed.resumed_from == 3 and len(resumed.history) == 4


def test_killed_run_resumes_from_its_checkpoint_with_buffered_partials(tmp_path):
    out = tmp_path / "killed"
    ckpt = out / "checkpoints"
    cmd = [sys.executable, "-m", "april_ext.cli", "train", "--output-dir", str(out), "--num-steps", "200",
           "--save-interval", "1", "--keep-checkpoints", "3", "--no-progress", "--no-plots", "--num-threads", "1"]
    for key, value in TINY.items():
        if isinstance(value, bool):
            continue
        cmd += ["--" + key.replace("_", "-"), str(value)]
    # With a 9-token vocabulary a random-init model emits EOS at random (mean length ~9, cap 40): groups
    # finish at very different times and many samples are still running at each step's end.
    shape = {"counting_symbols": 1, "counting_max_count": 4, "max_response_len": 40, "over_sampling_batch_size": 6}
    for key, value in shape.items():
        cmd += ["--" + key.replace("_", "-"), str(value)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ})
    manager = CheckpointManager(ckpt)
    deadline = time.monotonic() + 120
    try:
        while manager.latest() is None:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    latest = manager.latest()
    assert latest is not None and latest.step < 200
    task = CountingTask(CountingTaskConfig(n_symbols=1, max_count=4, median_count=3.0, sigma=0.8, seed=0))
    sched = Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=6,
                                      max_response_len=40), task)
    sched.load(os.path.join(latest.path, "scheduler.state"))
    buffered = sched.stats()["buffered_samples"]
    assert buffered > 0
    steps = latest.step + 2
    result = train(tiny(tmp_path, "killed", num_steps=steps, resume=True, save_interval=1, **shape))
    assert result.resumed_from == latest.step
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # The first step after the restart resumes the checkpoint's partial samples before new prompts.
    assert rows[latest.step]["rollout/resumed_requests"] >= 1


def test_prompt_file_running_out_ends_training(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from april_ext.model import LlamaForCausalLM, ModelConfig, save_pretrained

    words = ["[PAD]", "[BOS]", "[EOS]", "what", "is", "1+1", "2+2", "3+3", "?", "2", "4", "6", "answer:"]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[PAD]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]", pad_token="[PAD]").save_pretrained(
        tmp_path / "tok")
    model = LlamaForCausalLM(ModelConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=64, eos_token_id=2))
    model.init_weights(0)
    save_pretrained(model, tmp_path / "model")
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"question": f"what is {a}+{a} ?", "answer": str(2 * a)}) + "\n"
                            for a in (1, 2, 3)))
    result = train(tiny(tmp_path, task=None, data=str(data), tokenizer=str(tmp_path / "tok"),
                        model=str(tmp_path / "model"), prompt_key="question", label_key="answer",
                        max_response_len=6, num_steps=10, num_epochs=1))
    assert result.data_exhausted and "ran out before num_steps=10" in result.stopped_early
    assert [r["rollout/batch_groups"] for r in result.history] == [2, 1]


def test_bad_configs_name_the_setting(tmp_path):
    with pytest.raises(ConfigError, match=r"SchedulerConfig.rollout_batch_size=0 is not allowed: an int >= 1"):
        TrainConfig(rollout_batch_size=0)
    with pytest.raises(ConfigError, match=r"TrainConfig.lr='fast' is not allowed: a float"):
        TrainConfig(lr="fast")
    with pytest.raises(ConfigError, match=r"TrainConfig.algorithm='ppo2' is not allowed: one of"):
        TrainConfig(algorithm="ppo2")
    with pytest.raises(ConfigError, match="exactly one of task and data"):
        TrainConfig(data="x.jsonl", tokenizer="t", model="m")
    with pytest.raises(ConfigError, match="TrainConfig.model=None"):
        TrainConfig(task=None, data="x.jsonl", tokenizer="t")
    with pytest.raises(ConfigError, match=r"over_sampling_batch_size=4 is not allowed.*>= rollout_batch_size \(8\)"):
        TrainConfig(over_sampling_batch_size=4)
    bad = tmp_path / "bad.toml"
    bad.write_text('rollout_batch_size = 4\nrollout_batchsize = 8\n')
    with pytest.raises(ConfigError, match=r"bad.toml: unknown setting 'rollout_batchsize'"):
        TrainConfig.from_toml(bad)
    bad.write_text('rollout_batch_size = \n')
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML"):
        TrainConfig.from_toml(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        TrainConfig.from_toml(tmp_path / "missing.toml")


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"[PAD]": 0, "hi": 1}, unk_token="[PAD]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]").save_pretrained(tmp_path / "tok")
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "hi", "label": "1"}\n{"prompt": "hi", "label": \n')
    with pytest.raises(InvalidArgumentError, match=r"bad\.jsonl:2: invalid JSON"):
        train(tiny(tmp_path, task=None, data=str(data), tokenizer=str(tmp_path / "tok"), model=str(tmp_path)))


def test_checkpoint_directory_ignores_and_cleans_partial_writes(tmp_path):
    """A kill during a save leaves a temporary directory, which is not a checkpoint; a step directory without
    run.json (saves rename only complete ones, so it was damaged later) is a damaged checkpoint: --resume
    passes over it to the newest intact one, and the next save removes the temporary leftovers."""
    first = train(tiny(tmp_path, num_steps=1))
    ckpt = tmp_path / "run" / "checkpoints"
    (ckpt / ".step_000002.tmp-abc").mkdir()
    (ckpt / "step_000003").mkdir()
    manager = CheckpointManager(ckpt)
    assert [c.step for c in manager.list()] == [1, 3]
    resumed = train(tiny(tmp_path, num_steps=2, resume=True))
    assert resumed.resumed_from == 1 and resumed.checkpoint.endswith("step_000002")
    assert first.checkpoint.endswith("step_000001")
    assert not (ckpt / ".step_000002.tmp-abc").exists()
    assert [c.step for c in manager.list()] == [1, 2, 3]


def test_resumed_baseline_run_equals_an_uninterrupted_one(tmp_path):
    """The baseline is deterministic, so a run stopped and resumed must reproduce the uninterrupted run:
    weights, optimizer, RNG, data position and per-sample seeds all come back from the checkpoint."""
    straight = train(tiny(tmp_path, "a", partial_rollout=False, num_steps=4))
    train(tiny(tmp_path, "b", partial_rollout=False, num_steps=2))
    resumed = train(tiny(tmp_path, "b", partial_rollout=False, num_steps=4, resume=True))
    # Exactly, step by step: the batch packs its groups in group id order, not in the order they completed.
    keys = ("rollout/reward_mean", "rollout/generated_tokens", "rollout/response_lens", "rollout/engine_steps",
            "train/loss", "train/grad_norm")
    assert [[r[k] for k in keys] for r in resumed.history] == [[r[k] for k in keys] for r in straight.history]


MAIN_JOB = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "counting_tiny.toml")


@pytest.mark.slow
@pytest.mark.parametrize("step_boundary", ["abort", "carry"])
def test_an_april_run_of_the_main_job_repeats_exactly_for_its_seed(tmp_path, step_boundary):
    """The APRIL half of the main job (configs/counting_tiny.toml, 14 steps), twice on seed 0: the engine steps in
    lockstep with the loop (deterministic_rollout, the default), so where the aborts cut, which groups are
    trained in what order, and so every loss, reward and response length repeat bit for bit, step by step."""
    def run(name: str):
        # 14 steps: the first ~8 cut nothing (a random policy runs every response to the cap, so groups end together).
        return train(TrainConfig.from_toml(MAIN_JOB, num_steps=14, seed=0, step_boundary=step_boundary,
                                           output_dir=str(tmp_path / name), progress=False, plots=False))

    first, second = run("first"), run("second")
    keys = ("train/loss", "train/pg_loss", "train/grad_norm", "rollout/reward_mean", "rollout/response_lens",
            "rollout/generated_tokens", "rollout/engine_steps", "rollout/aborted_samples",
            "rollout/carried_samples", "rollout/re_prefill_tokens", "rollout/off_policy_token_ratio")
    assert [[r[k] for k in keys] for r in first.history] == [[r[k] for k in keys] for r in second.history]
    assert len(first.history) == 14 and first.config.deterministic_rollout
    # The runs did cut samples at the step's end (aborted and resumed, or carried), on several steps.
    cut = "rollout/carried_samples" if step_boundary == "carry" else "rollout/aborted_samples"
    assert sum(r[cut] > 0 for r in first.history) >= 3


def test_reinforce_plus_plus_with_kl_shaping_and_the_decoupled_loss_runs_under_april(tmp_path):
    """slime's REINFORCE++ with the KL reward shaping and AReaL's decoupled loss through the whole run:
    resumed partials carry tokens of older versions, whose behavior weights pi_prox / pi_behavior differ from 1."""
    config = tiny(tmp_path, algorithm="reinforce_plus_plus", kl_coef=0.05, kl_loss_coef=0.01, kl_loss_type="k3",
                  gamma=0.99, normalize_advantages=True, use_decoupled_loss=True, behav_imp_weight_cap=5.0,
                  num_steps=4, lr=0.02)
    train(config)
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["train/kl_shaping"] >= 0 and 0 < r["train/behav_imp_weight"] < 5
        assert all(torch.isfinite(torch.tensor(r[k])) for k in ("train/loss", "train/grad_norm", "train/kl"))
    # The first step trains the initial policy on its own samples: no KL to the reference yet, weights 1.
    assert rows[0]["train/kl_shaping"] == pytest.approx(0.0, abs=1e-6)
    assert rows[0]["train/behav_imp_weight"] == pytest.approx(1.0, abs=1e-4)
    carried = [r for r in rows if r["rollout/carried_token_ratio"] > 0]
    assert carried and any(abs(r["train/behav_imp_weight"] - 1) > 1e-3 for r in carried), rows
    assert rows[-1]["train/kl_shaping"] > 0
