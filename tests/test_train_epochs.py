"""A prompt file's passes (epochs): it cycles until num_steps as slime's data source does (in a new seeded
permutation per pass with rollout_shuffle), and a run that num_epochs ends before num_steps says so and exits
non-zero, also when it resumes on data its checkpoint had used up."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from april_ext import cli
from april_ext.cli.train import config_from_args
from april_ext.data import DatasetConfig, PromptDataset
from april_ext.data_source import Prompt
from april_ext.errors import ConfigError
from april_ext.model import LlamaForCausalLM, ModelConfig, save_pretrained
from april_ext.training import TrainConfig

from _torch_threads import one_thread  # noqa: F401 (fixture)

WORDS = ["[PAD]", "[BOS]", "[EOS]", "what", "is", "1+1", "2+2", "3+3", "?", "2", "4", "6"]


def _checkpoint(tmp_path) -> str:
    """A tiny model whose directory holds its tokenizer too, as an HF checkpoint does."""
    ckpt = tmp_path / "ckpt"
    model = LlamaForCausalLM(ModelConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=64, eos_token_id=2))
    model.init_weights(0)
    save_pretrained(model, ckpt)
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="[PAD]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]", pad_token="[PAD]").save_pretrained(ckpt)
    return str(ckpt)


def _argv(tmp_path, *extra: str) -> list[str]:
    """12 prompts, 2 groups per step without over-sampling: one pass is 6 steps."""
    data = tmp_path / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"prompt": f"what is {a}+{a} ?", "label": str(2 * a)}) + "\n"
                                for a in (1, 2, 3) * 4))
    return ["train", "--hf-checkpoint", _checkpoint(tmp_path), "--prompt-data", str(data),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--over-sampling-batch-size", "2",
            "--rollout-max-response-len", "3", "--output-dir", str(tmp_path / "run"), "--max-num-seqs", "16",
            "--num-blocks", "64", "--no-progress", "--no-plots", *extra]


def _steps(tmp_path) -> list[int]:
    return [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.usefixtures("one_thread")
def test_more_rollouts_than_the_file_holds_cycle_the_data(tmp_path, capsys):
    assert cli.main(_argv(tmp_path, "--num-rollout", "8", "--rollout-shuffle")) == 0
    assert _steps(tmp_path) == list(range(1, 9))
    assert "stopped early" not in capsys.readouterr().err


@pytest.mark.usefixtures("one_thread")
def test_epochs_that_end_the_run_before_num_steps_say_so_and_exit_non_zero(tmp_path, capsys):
    assert cli.main(_argv(tmp_path, "--num-rollout", "20", "--num-epochs", "1", "--save-interval", "2")) == 1
    assert _steps(tmp_path) == list(range(1, 7))
    err = capsys.readouterr().err
    assert "stopped early: the prompt data ran out before num_steps=20: num_epochs=1" in err and "after step 6" in err
    # Resumed on the data its checkpoint used up: nothing is trained, and it says so (not "steps -" and 0).
    assert cli.main(_argv(tmp_path, "--num-rollout", "20", "--num-epochs", "1", "--resume")) == 1
    err = capsys.readouterr().err
    assert "the checkpoint of step 6 had used them up; this run trained no step" in err
    assert _steps(tmp_path) == list(range(1, 7))
    # With more passes the same resume continues.
    assert cli.main(_argv(tmp_path, "--num-rollout", "8", "--num-epochs", "2", "--resume")) == 0
    assert _steps(tmp_path) == list(range(1, 9))


@pytest.mark.usefixtures("one_thread")
def test_slimes_num_epoch_without_num_rollout_trains_to_the_end_of_the_passes(tmp_path, capsys):
    args = cli.build_parser().parse_args(_argv(tmp_path, "--num-epoch", "1"))
    config = config_from_args(args)
    assert (config.num_epochs, config.num_steps) == (1, None)
    assert config_from_args(cli.build_parser().parse_args(_argv(tmp_path, "--num-epoch", "2", "--num-rollout", "3"))
                            ).num_steps == 3
    assert cli.main(_argv(tmp_path, "--num-epoch", "1")) == 0
    assert _steps(tmp_path) == list(range(1, 7))
    # The resumed run has nothing left: it says so and the run is complete (exit 0).
    assert cli.main(_argv(tmp_path, "--num-epoch", "1", "--resume")) == 0
    assert "nothing to train: the checkpoint of step 6 already reached the end of its num_epochs=1" in \
        capsys.readouterr().err


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(id=i, token_ids=(i + 1,)) for i in range(n)]


def test_an_endless_file_repeats_in_file_order_or_in_a_seeded_permutation_per_pass():
    plain = PromptDataset(_prompts(5), DatasetConfig(epochs=None, shuffle=False))
    assert len(plain) > 10**15
    assert [plain[i].id for i in range(12)] == [0, 1, 2, 3, 4] * 2 + [0, 1]
    shuffled = PromptDataset(_prompts(5), DatasetConfig(epochs=None, shuffle=True, seed=3))
    passes = [[shuffled[p * 5 + i].id for i in range(5)] for p in range(4)]
    assert all(sorted(p) == list(range(5)) for p in passes) and len({tuple(p) for p in passes}) > 1
    again = PromptDataset(_prompts(5), DatasetConfig(epochs=None, shuffle=True, seed=3))
    assert [again[i].id for i in range(20)] == [i for p in passes for i in p]
    other = PromptDataset(_prompts(5), DatasetConfig(epochs=None, shuffle=True, seed=4))
    assert [other[i].id for i in range(20)] != [i for p in passes for i in p]


@pytest.mark.parametrize("changes, message", [
    ({"num_epochs": 2}, "num_epochs=2 is not allowed: None unless data is given"),
    ({"rollout_shuffle": True}, "rollout_shuffle=True is not allowed: False unless data is given"),
    ({"num_steps": None}, "num_steps=None is not allowed: an int >= 1, or None with num_epochs set"),
    ({"num_steps": 0}, "num_steps=0 is not allowed: None or an int >= 1"),
])
def test_bounds_of_a_run_are_checked(changes, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**changes)
