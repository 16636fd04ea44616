"""slime's flag names for `april-ext train`: each parses to the same TrainConfig as our name."""

from __future__ import annotations

import pytest
import torch

from april_ext import cli
from april_ext.cli.train import SLIME_ALIASES, config_from_args
from april_ext.errors import ConfigError
from april_ext.training.config import TrainConfig
from april_ext.training.trainers import algorithm_config, trainer_config

DATA = ["--tokenizer", "tok", "--model", "ckpt"]


def _config(*argv: str):
    return config_from_args(cli.build_parser().parse_args(["train", *argv]))


@pytest.mark.parametrize("slime, ours", [
    (["--rollout-max-response-len", "77"], ["--max-response-len", "77"]),
    (["--mask-offpolicy-in-partial-rollout"], ["--mask-offpolicy"]),
    (["--advantage-estimator", "gspo"], ["--algorithm", "gspo"]),
    (["--rollout-temperature", "0.7"], ["--temperature", "0.7"]),
    (["--rollout-top-p", "0.9"], ["--top-p", "0.9"]),
    (["--rollout-top-k", "20"], ["--top-k", "20"]),
    (["--hf-checkpoint", "/ckpt"], ["--model", "/ckpt"]),
    (["--prompt-data", "p.jsonl", "--hf-checkpoint", "ckpt"], ["--data", "p.jsonl", "--model", "ckpt"]),
    (["--input-key", "question"], ["--prompt-key", "question"]),
    (["--num-rollout", "5"], ["--num-steps", "5"]),
    (["--rollout-seed", "9"], ["--seed", "9"]),
    (["--use-tis"], ["--tis-cap", "2.0"]),
    (["--use-tis", "--tis-clip", "1.5"], ["--tis-cap", "1.5"]),
    (["--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "0.5"], ["--tis-cap", "1.5", "--tis-floor", "0.5"]),
    (["--advantage-estimator", "reinforce_plus_plus"], ["--algorithm", "reinforce_plus_plus"]),
    (["--advantage-estimator", "reinforce_plus_plus_baseline"], ["--algorithm", "reinforce_plus_plus_baseline"]),
    (["--apply-chat-template"], []),
])
def test_slime_flag_parses_to_the_same_config_as_ours(slime, ours):
    assert _config(*slime) == _config(*ours)
    assert _config(*slime) != _config() or not ours


def test_every_alias_is_tested_and_shown_in_the_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = capsys.readouterr().out
    for flags in SLIME_ALIASES.values():
        for flag in flags:
            assert flag in text
    for flag in ("--use-tis", "--tis-clip", "--tis-clip-low", "--kl-loss-coef", "--use-kl-loss", "--kl-coef",
                 "--kl-loss-type", "--gamma", "--normalize-advantages", "--use-decoupled-loss",
                 "--behav-imp-weight-cap", "--apply-chat-template",
                 "--eps-clip", "--eps-clip-high", "--global-batch-size", "--save", "--load", "--save-interval",
                 "--label-key", "--custom-rm-path", "--dynamic-sampling-filter-path", "--use-tensorboard",
                 "--use-wandb"):
        assert flag in text


def test_slime_names_that_are_our_names_mean_slimes_setting():
    config = _config("--eps-clip", "0.1", "--eps-clip-high", "0.3", "--global-batch-size", "16",
                     "--rollout-batch-size", "4", "--n-samples-per-prompt", "8", "--save", "s", "--load", "l",
                     "--save-interval", "3", "--label-key", "answer")
    algo = algorithm_config(config)
    assert (algo.eps_low, algo.eps_high) == (0.1, 0.3)
    # slime's global batch counts samples: 4 x 8 samples in steps of 16 is two optimizer steps per rollout.
    assert trainer_config(config).minibatches == 2
    assert (config.checkpoint_dir, config.resume_dir, config.save_interval, config.label_key) == ("s", "l", 3, "answer")
    # slime's --eps-clip-high defaults to --eps-clip; the algorithm's presets apply when neither is given.
    assert algorithm_config(_config("--eps-clip", "0.1")).eps_high == 0.1
    assert algorithm_config(_config("--algorithm", "dapo")).eps_high == 0.28
    assert trainer_config(_config("--rollout-top-k", "5")).top_k == 5
    # slime's --micro-batch-size counts samples per forward/backward; our token budget applies as well.
    micro = trainer_config(_config("--micro-batch-size", "2"))
    assert (micro.micro_batch_size, micro.micro_batch_tokens) == (2, 8192)
    assert trainer_config(_config()).micro_batch_size is None


def test_slime_kl_flags_mean_slimes_settings(tmp_path):
    """--use-kl-loss --kl-loss-coef is the KL loss weight (slime's k1 unless --kl-loss-type), --kl-coef the
    KL reward shaping of the reinforce_plus_plus estimators (0 by default, as in slime)."""
    loss = algorithm_config(_config("--use-kl-loss", "--kl-loss-coef", "0.01"))
    assert (loss.kl_loss_coef, loss.kl_coef, loss.kl_loss_type, loss.needs_reference) == (0.01, 0.0, "k1", True)
    typed = algorithm_config(_config("--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl"))
    assert typed.kl_loss_type == "low_var_kl"
    shaped = algorithm_config(_config("--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.05",
                                      "--gamma", "0.9", "--normalize-advantages"))
    assert (shaped.advantage, shaped.kl_coef, shaped.kl_loss_coef, shaped.gamma, shaped.normalize_advantages) == (
        "reinforce_plus_plus", 0.05, 0.0, 0.9, True)
    assert shaped.kl_shaping and shaped.needs_reference
    # grpo ignores --kl-coef, as slime does: accepted, with a note and without a reference model.
    ignored = algorithm_config(_config("--kl-coef", "0.05"))
    assert not ignored.kl_shaping and not ignored.needs_reference and "no effect" in ignored.unused_kl_coef_note()
    assert (_config().kl_coef, _config().kl_loss_coef, _config().gamma, _config().normalize_advantages) == (
        0.0, 0.0, 1.0, False)
    toml = tmp_path / "c.toml"
    toml.write_text("kl_loss_coef = 0.01\n")
    assert TrainConfig.from_toml(toml) == _config("--use-kl-loss", "--kl-loss-coef", "0.01")


def test_a_toml_file_from_before_the_kl_rename_is_refused(tmp_path):
    """A file whose kl_coef was the KL loss weight would silently lose its KL loss under grpo: refused with
    the rename; with a reinforce_plus_plus estimator (new in the same change) kl_coef can only mean the shaping."""
    old = tmp_path / "old.toml"
    old.write_text('algorithm = "grpo"\nkl_coef = 0.1\n')
    with pytest.raises(ConfigError, match="kl_loss_coef.*rename the key"):
        TrainConfig.from_toml(old)
    shaped = tmp_path / "shaped.toml"
    shaped.write_text('algorithm = "reinforce_plus_plus"\nkl_coef = 0.1\n')
    assert TrainConfig.from_toml(shaped).kl_coef == 0.1
    zero = tmp_path / "zero.toml"
    zero.write_text("kl_coef = 0.0\n")
    assert TrainConfig.from_toml(zero).kl_coef == 0.0
    # The command line's --kl-coef is slime's: accepted with grpo (it has no effect there, as in slime).
    assert _config("--kl-coef", "0.1").kl_coef == 0.1


def test_tokenizer_defaults_to_the_checkpoint_as_in_slime():
    config = _config("--prompt-data", "p.jsonl", "--hf-checkpoint", "ckpt")
    assert config.tokenizer is None and config.tokenizer_dir == "ckpt" and config.task is None


@pytest.mark.parametrize("argv, message", [
    (["--tis-clip", "1.5"], "without --use-tis"),
    (["--use-tis", "--tis-clip-low", "2.5"], "tis_floor"),
    (["--tis-floor", "0.5"], "tis_floor"),
    (["--kl-loss-coef", "0.1"], "without --use-kl-loss"),
    (["--use-kl-loss"], "needs --kl-loss-coef"),
    (["--use-tis", "--tis-cap", "3"], "give one of them"),
    (["--advantage-estimator", "ppo"], "algorithm"),
    (["--use-decoupled-loss", "--use-tis"], "tis_cap"),
    (["--behav-imp-weight-cap", "5"], "behav_imp_weight_cap"),
    (["--gamma", "1.5"], "gamma"),
    (["--kl-loss-type", "k4"], "kl_loss_type"),
    (["--global-batch-size", "12", "--rollout-batch-size", "4", "--n-samples-per-prompt", "8"], "multiple of"),
    (["--global-batch-size", "24", "--rollout-batch-size", "4", "--n-samples-per-prompt", "8"], "divides"),
    (["--eps-clip", "1.5"], "eps_clip"),
    (["--custom-rm-path", "not a path"], "import path"),
    (["--custom-rm-kind", "token"], "custom_rm_kind"),
    (["--custom-rm-path", "m:f", "--custom-rm-text"], "custom_rm_text"),
])
def test_unsupported_or_inconsistent_slime_flags_are_config_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        _config(*argv)


def test_eval_prompt_data_takes_slimes_name_path_form():
    base = ["--prompt-data", "p.jsonl", "--hf-checkpoint", "ckpt", "--eval-interval", "5"]
    named = _config(*base, "--eval-prompt-data", "aime", "/data/aime.jsonl", "--n-samples-per-eval-prompt", "4")
    assert named == _config(*base, "--eval-prompt-data", "/data/aime.jsonl", "--n-samples-per-eval-prompt", "4")
    assert (named.eval_prompt_data, named.eval_interval, named.n_samples_per_eval_prompt) == ("/data/aime.jsonl", 5, 4)
    with pytest.raises(ConfigError, match="one held-out set"):
        _config(*base, "--eval-prompt-data", "a", "x.jsonl", "b", "y.jsonl")
    with pytest.raises(ConfigError, match="eval_interval"):
        _config("--prompt-data", "p.jsonl", "--hf-checkpoint", "ckpt", "--eval-prompt-data", "x.jsonl")
    with pytest.raises(ConfigError, match="eval_prompt_data"):
        _config("--eval-interval", "2", "--eval-prompt-data", "x.jsonl")


def test_a_slime_command_line_trains(tmp_path, monkeypatch, capsys):
    """The README's slime command line, on a tiny checkpoint whose directory also holds the tokenizer."""
    import json

    from _torch_threads import one_torch_thread
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from april_ext.model import LlamaForCausalLM, ModelConfig, save_pretrained

    words = ["[PAD]", "[BOS]", "[EOS]", "what", "is", "1+1", "2+2", "3+3", "?", "2", "4", "6", "\\boxed{4}"]
    ckpt = tmp_path / "ckpt"
    model = LlamaForCausalLM(ModelConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=64, eos_token_id=2))
    model.init_weights(0)
    save_pretrained(model, ckpt)
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[PAD]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]", pad_token="[PAD]").save_pretrained(ckpt)
    records = [{"input": f"what is {a}+{a} ?", "label": str(2 * a)} for a in (1, 2, 3)] * 4
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    (tmp_path / "my_rm.py").write_text(
        "seen = []\n"
        "def reward(prompt, response):\n"
        "    seen.append(response)\n"
        "    return float(prompt.metadata['label'] in response.split())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["train", "--hf-checkpoint", str(ckpt), "--prompt-data", str(tmp_path / "train.jsonl"),
            "--input-key", "input", "--label-key", "label", "--apply-chat-template",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--over-sampling-batch-size", "4",
            "--rollout-max-response-len", "6", "--rollout-temperature", "1.0", "--rollout-top-p", "1.0",
            "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
            "--use-tis", "--tis-clip", "2.0", "--mask-offpolicy-in-partial-rollout", "--global-batch-size", "4",
            "--use-kl-loss", "--kl-loss-coef", "0.001", "--num-rollout", "2", "--rollout-seed", "42",
            "--custom-rm-path", "my_rm:reward", "--custom-rm-text",
            "--eval-prompt-data", "toy", str(tmp_path / "eval.jsonl"),
            "--eval-interval", "2", "--n-samples-per-eval-prompt", "2", "--use-tensorboard",
            "--save", str(tmp_path / "ckpts"), "--save-interval", "1", "--output-dir", str(tmp_path / "run"),
            "--max-num-seqs", "64", "--num-blocks", "128", "--no-progress", "--no-plots"]
    with one_torch_thread():
        assert cli.main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "eval/pass@2" in rows[1]
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["step_000001", "step_000002"]
    assert (tmp_path / "run" / "tensorboard").is_dir()
    import my_rm  # the reward saw decoded text: words of the tokenizer's vocabulary

    assert my_rm.seen and all(isinstance(t, str) and set(t.split()) <= set(words) for t in my_rm.seen)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["tis_cap"], config["kl_loss_coef"], config["kl_coef"], config["mask_offpolicy"], config["seed"]) == (
        2.0, 0.001, 0.0, True, 42)


def test_tis_clip_low_floors_the_importance_weights():
    import torch

    from april_ext.algorithms import truncated_is_weights

    config = _config("--use-tis", "--tis-clip", "2.0", "--tis-clip-low", "0.5")
    algo = algorithm_config(config)
    assert (algo.tis_cap, algo.tis_floor) == (2.0, 0.5)
    train = torch.log(torch.tensor([0.1, 0.4, 0.9]))
    behavior = torch.log(torch.tensor([0.8, 0.4, 0.3]))
    weights = truncated_is_weights(train, behavior, algo.tis_cap, algo.tis_floor)
    assert weights.tolist() == pytest.approx([0.5, 1.0, 2.0])  # 0.125 floored, 1, 3 capped


# The flags of slime's scripts/run-qwen3-4B.sh (its model flags aside), the README's slime line and APRIL's
# partial-rollout scripts: 69, each accepted with slime's meaning, passed to what the run launches, or refused
# by name (docs/loop.md, "slime's flags"). Each entry: the flag with a value a script gives it.
ACCEPTED = [
    ["--hf-checkpoint", "ckpt"], ["--load", "l"], ["--save", "s"], ["--save-interval", "20"],
    ["--prompt-data", "p.jsonl"], ["--input-key", "prompt"], ["--label-key", "label"], ["--apply-chat-template"],
    ["--num-rollout", "3000"], ["--rollout-batch-size", "4"], ["--n-samples-per-prompt", "8"],
    ["--rollout-max-response-len", "8192"], ["--rollout-temperature", "0.8"], ["--global-batch-size", "32"],
    ["--eval-interval", "20"], ["--eval-prompt-data", "aime", "aime.jsonl"], ["--n-samples-per-eval-prompt", "16"],
    ["--tensor-model-parallel-size", "2"], ["--sequence-parallel"], ["--pipeline-model-parallel-size", "1"],
    ["--context-parallel-size", "1"], ["--expert-model-parallel-size", "1"], ["--advantage-estimator", "grpo"],
    ["--use-kl-loss"], ["--kl-loss-coef", "0.00"], ["--kl-loss-type", "low_var_kl"], ["--eps-clip", "0.2"],
    ["--eps-clip-high", "0.28"], ["--lr", "1e-6"], ["--use-wandb"], ["--wandb-project", "slime-dev"],
    ["--rollout-num-gpus-per-engine", "2"], ["--actor-num-nodes", "1"], ["--actor-num-gpus-per-node", "8"],
    ["--colocate"], ["--partial-rollout"], ["--over-sampling-batch-size", "8"],
    ["--mask-offpolicy-in-partial-rollout"],
    # Missing before issue 35.
    ["--ref-load", "ref"], ["--skip-eval-before-train"], ["--calculate-per-token-loss"], ["--optimizer", "adam"],
    ["--lr-decay-style", "cosine"], ["--lr-warmup-iters", "10"], ["--weight-decay", "0.1"], ["--adam-beta1", "0.9"],
    ["--adam-beta2", "0.98"], ["--num-epoch", "2"], ["--balance-data"], ["--rollout-shuffle"],
    ["--entropy-coef", "0.00"], ["--rm-type", "deepscaler"], ["--eval-max-response-len", "16384"],
    ["--eval-top-p", "0.7"], ["--eval-top-k", "20"], ["--use-dynamic-batch-size"], ["--max-tokens-per-gpu", "9216"],
    ["--wandb-group", "qwen3-4B-test"],
    # Megatron's, naming what the trainers do.
    ["--attention-dropout", "0.0"], ["--hidden-dropout", "0.0"], ["--accumulate-allreduce-grads-in-fp32"],
    ["--attention-softmax-in-fp32"], ["--expert-tensor-parallel-size", "1"],
]
PASSED = [["--sglang-mem-fraction-static", "0.7"], ["--sglang-cuda-graph-max-bs", "32"]]
REFUSED = [["--recompute-granularity", "full"], ["--recompute-method", "uniform"], ["--recompute-num-layers", "1"],
           ["--attention-backend", "flash"]]
# What the accepted line needs besides (the Megatron trainer for the fp32 softmax, launched servers for the
# pass-through).
CONTEXT = ["--trainer", "megatron", "--engine", "sglang", "--sglang-launch"]


def test_the_flags_of_slime_and_april_scripts_are_accepted_passed_through_or_refused_by_name(tmp_path):
    from april_ext.model import LlamaForCausalLM, ModelConfig, save_pretrained

    flags = [f[0] for f in ACCEPTED + PASSED + REFUSED]
    assert len(flags) == len(set(flags)) == 69
    assert len(ACCEPTED) + len(PASSED) >= 60
    # A dense model (read for --expert-tensor-parallel-size 1 under --tensor-model-parallel-size 2).
    save_pretrained(LlamaForCausalLM(ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                                 max_position_embeddings=32)), tmp_path / "ckpt")
    argv = [str(tmp_path / "ckpt") if a == "ckpt" else a for flag in ACCEPTED + PASSED for a in flag]
    config = _config(*CONTEXT, *argv)
    assert (config.model == str(tmp_path / "ckpt")) and (config.model, config.ref_load, config.num_epochs, config.num_steps, config.rollout_shuffle,
            config.weight_decay, config.adam_beta2, config.lr_decay_style, config.lr_warmup_iters,
            config.loss_aggregation, config.rm_type, config.eval_top_p, config.eval_top_k,
            config.eval_max_response_len, config.micro_batch_tokens, config.wandb_group) == (
        str(tmp_path / "ckpt"), "ref", 2, 3000, True, 0.1, 0.98, "cosine", 10, "token", "deepscaler", 0.7, 20, 16384, 9216,
        "qwen3-4B-test")
    assert config.sglang_args == "--mem-fraction-static 0.7 --cuda-graph-max-bs 32"
    for flag in REFUSED:
        with pytest.raises(ConfigError, match=f"{flag[0]} is not supported: "):
            _config(*flag)


@pytest.mark.parametrize("argv, message", [
    (["--attention-dropout", "0.1"], "--attention-dropout 0.1 is not allowed: 0.0"),
    (["--attention-softmax-in-fp32"], "--attention-softmax-in-fp32 needs --trainer megatron"),
    (["--sglang-mem-fraction-static", "0.7"], "--sglang-mem-fraction-static: these configure the SGLang servers"),
    (["--optimizer", "sgd"], "optimizer='sgd' is not allowed: one of ('adam',)"),
    (["--lr-decay-style", "WSD"], "lr_decay_style='WSD' is not allowed: one of ('constant', 'linear', 'cosine')"),
    (["--calculate-per-token-loss", "--loss-aggregation", "sequence"], "contradict"),
    (["--num-epoch", "2", "--num-epochs", "3"], "give one of them"),
    (["--rm-type", "math"], "rm_type='math' is not allowed: None unless data is given"),
    (["--min-lr", "1", "--lr", "0.1"], "min_lr"),
    (["--adam-beta2", "1.0"], "adam_beta2"),
    (["--lr-decay-iters", "3", "--lr-warmup-iters", "5"], "lr_decay_iters"),
    (["--eval-top-p", "0"], "eval_top_p"),
])
def test_slime_flags_with_values_they_cannot_have_here_are_refused(argv, message, capsys):
    with pytest.raises((ConfigError, SystemExit)) as err:
        _config(*argv)
    text = str(err.value) if err.type is ConfigError else capsys.readouterr().err
    assert message in text


def test_optimiser_flags_reach_both_trainers_settings():
    from april_ext.trainer.megatron.distributed_trainer import optimizer_config
    from april_ext.trainer.megatron.parallel import MegatronParallelConfig

    settings = trainer_config(_config("--weight-decay", "0.1", "--adam-beta1", "0.8", "--adam-beta2", "0.98",
                                      "--adam-eps", "1e-6", "--clip-grad", "0", "--lr-decay-style", "linear",
                                      "--lr-warmup-iters", "2", "--min-lr", "1e-4", "--num-rollout", "5",
                                      "--entropy-coef", "0.01", "--calculate-per-token-loss",
                                      "--advantage-estimator", "gspo"))
    assert (settings.weight_decay, settings.betas, settings.adam_eps, settings.grad_clip) == (0.1, (0.8, 0.98), 1e-6,
                                                                                             None)
    # The decay ends at the run's last optimizer step (Megatron's train_iters): 5 rollouts of one step.
    assert (settings.lr_decay_style, settings.lr_warmup_iters, settings.lr_decay_iters, settings.min_lr) == (
        "linear", 2, 5, 1e-4)
    assert (settings.algorithm.entropy_coef, settings.algorithm.aggregation) == (0.01, "token")
    assert algorithm_config(_config("--advantage-estimator", "gspo")).aggregation == "sequence"
    megatron = optimizer_config(settings, MegatronParallelConfig(), bf16=False)
    assert (megatron.weight_decay, megatron.adam_beta1, megatron.adam_beta2, megatron.adam_eps) == (0.1, 0.8, 0.98,
                                                                                                    1e-6)


def test_the_learning_rate_follows_megatrons_schedule():
    from april_ext.trainer import TorchTrainer, TrainerConfig
    from april_ext.trainer.config import lr_at

    from _trainer_utils import make_batch, make_model

    cosine = TrainerConfig(lr=1.0, lr_warmup_iters=2, lr_decay_style="cosine", lr_decay_iters=6, min_lr=0.1)
    assert [lr_at(cosine, i) for i in range(8)] == pytest.approx(
        [0.0, 0.5, 1.0, 0.1 + 0.9 * 0.5 * (1 + 0.7071067811865476), 0.55, 0.1 + 0.9 * 0.5 * (1 - 0.7071067811865476),
         0.1, 0.1])
    linear = TrainerConfig(lr=1.0, lr_decay_style="linear", lr_decay_iters=4)
    assert [lr_at(linear, i) for i in range(6)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    assert lr_at(TrainerConfig(lr=0.3, lr_decay_iters=4), 3) == 0.3  # constant
    trainer = TorchTrainer(make_model(), TrainerConfig(lr=0.01, lr_decay_style="linear", lr_decay_iters=4,
                                                       minibatches=2, mixed_precision="fp32", device="cpu"))
    lrs = []
    for step in range(2):
        lrs.append(trainer.train_step(make_batch(trainer.model, step, seed=step))["lr"])
        assert [g["lr"] for g in trainer.optimizer.param_groups] == [lrs[-1]]
    # Two optimizer steps per train step: the second of each is the one reported.
    assert lrs == pytest.approx([0.0075, 0.0025]) and trainer.iterations == 4


def test_entropy_bonus_subtracts_the_weighted_entropy_and_moves_the_gradient():
    import copy

    from april_ext.algorithms import AlgorithmConfig
    from april_ext.trainer import TorchTrainer, TrainerConfig

    from _trainer_utils import make_batch, make_model

    model = make_model()
    batch = make_batch(model, 0)
    plain, bonus = (TorchTrainer(copy.deepcopy(model), TrainerConfig(
        lr=0.01, mixed_precision="fp32", device="cpu", algorithm=AlgorithmConfig(entropy_coef=coef)))
        for coef in (0.0, 0.5))
    a, b = plain.train_step(batch), bonus.train_step(batch)
    assert b["entropy"] == pytest.approx(a["entropy"]) and a["entropy"] > 0
    assert b["loss"] == pytest.approx(a["pg_loss"] - 0.5 * a["entropy"], abs=1e-6)
    assert b["grad_norm"] != pytest.approx(a["grad_norm"])


def test_ref_load_is_the_kl_reference_of_the_torch_trainer(tmp_path):
    from april_ext.algorithms import AlgorithmConfig
    from april_ext.model import save_pretrained
    from april_ext.trainer import TorchTrainer, TrainerConfig

    from _trainer_utils import make_batch, make_model

    save_pretrained(make_model(seed=7), tmp_path / "ref")
    kl = AlgorithmConfig(kl_loss_coef=0.1, kl_loss_type="k3")
    settings = dict(lr=0.01, mixed_precision="fp32", device="cpu", algorithm=kl)
    own = TorchTrainer(make_model(), TrainerConfig(**settings))
    other = TorchTrainer(make_model(), TrainerConfig(**settings, reference=str(tmp_path / "ref")))
    assert other.ref_model is not None
    for name, param in other.ref_model.named_parameters():
        assert torch.equal(param, dict(make_model(seed=7).named_parameters())[name])
    batch = make_batch(own.model, 0)
    # Before any update the policy is its own reference (KL 0), not the other checkpoint.
    assert own.train_step(batch)["kl"] == pytest.approx(0.0, abs=1e-7)
    assert other.train_step(batch)["kl"] > 1e-3


def test_rm_type_scores_as_slimes_built_in_rewards():
    from april_ext.data_source import Prompt
    from april_ext.tasks import MathReward

    class Text:
        def decode(self, ids, skip_special_tokens):
            return ["<think>2+2 is 4</think> The answer is \\boxed{4}", "<think>\\boxed{4}", "\\boxed{5}"][ids[0]]

    prompt = Prompt(id=0, token_ids=(1,), metadata={"label": "4"})
    scores = {rm: [MathReward(Text(), rm)(prompt, [i]) for i in range(3)] for rm in ("math", "deepscaler", "dapo")}
    # deepscaler grades the text after </think> only: an unfinished thought scores 0.
    assert scores == {"math": [1.0, 1.0, 0.0], "deepscaler": [1.0, 0.0, 0.0], "dapo": [1.0, 1.0, -1.0]}
    with pytest.raises(ConfigError, match="rm_type"):
        MathReward(Text(), "f1")


def test_eval_sampling_flags_override_the_rollouts_for_evaluation_only(tmp_path):
    import asyncio

    from april_ext.training import TrainingRun

    async def sampling(*argv):
        config = _config("--output-dir", str(tmp_path), "--hidden-size", "16", "--num-layers", "1",
                         "--eval-interval", "1", "--no-progress", "--no-plots", "--rollout-top-p", "0.9", *argv)
        async with TrainingRun(config) as run:
            return run.sampling, run.eval_sampling

    rollout, evaluation = asyncio.run(sampling("--eval-top-p", "0.7", "--eval-top-k", "5",
                                               "--eval-max-response-len", "3", "--eval-temperature", "0"))
    assert (rollout.top_p, rollout.top_k, rollout.temperature) == (0.9, -1, 1.0)
    assert (evaluation.top_p, evaluation.top_k, evaluation.max_new_tokens, evaluation.temperature) == (0.7, 5, 3, 0.0)
    rollout, evaluation = asyncio.run(sampling())
    assert evaluation == rollout
