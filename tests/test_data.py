"""Prompt files (JSONL / Parquet) with a tokenizer built locally, and the PromptDataset stream."""

from __future__ import annotations

import json

import pytest

from april_ext import ConfigError, InvalidArgumentError
from april_ext.data import DatasetConfig, PromptDataset, load_tokenizer, read_records
from april_ext.data_source import DataSource, Prompt

WORDS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]", "<user>", "<assistant>", "what", "is", "1+1", "2+2", "?",
         "solve", "x", "ok"]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]",
                                   pad_token="[PAD]", unk_token="[UNK]")
    fast.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(path)
    return path


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_load_tokenizer_from_local_dir(tokenizer_dir, tmp_path):
    tok = load_tokenizer(tokenizer_dir)
    assert tok("what is 1+1 ?")["input_ids"] == [2, 6, 7, 8, 10]
    with pytest.raises(InvalidArgumentError, match="not a directory"):
        load_tokenizer(tmp_path / "missing")


def test_jsonl_text_prompts(tokenizer_dir, tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "what is 1+1 ?", "label": "2"},
                                               {"prompt": "what is 2+2 ?", "label": 4}])
    ds = PromptDataset.from_file(path, load_tokenizer(tokenizer_dir), DatasetConfig(shuffle=False))
    assert isinstance(ds, DataSource) and len(ds) == 2
    first = ds[0]
    assert first.token_ids == (2, 6, 7, 8, 10) and first.metadata["label"] == "2" and first.id == "p.jsonl:1"
    assert ds[1].metadata["label"] == 4
    with pytest.raises(IndexError):
        ds[2]
    two_epochs = PromptDataset.from_file(path, load_tokenizer(tokenizer_dir), DatasetConfig(shuffle=False, epochs=2))
    assert len(two_epochs) == 4 and two_epochs[2] == first


def test_chat_prompts_and_nested_keys(tokenizer_dir, tmp_path):
    # The DAPO-Math-17k / verl export layout: a chat prompt and the answer under reward_model.
    records = [{"prompt": [{"role": "user", "content": "solve x"}],
                "reward_model": {"ground_truth": "7"}, "extra_info": {"index": 31}}]
    path = _write_jsonl(tmp_path / "math.jsonl", records)
    cfg = DatasetConfig(label_key="reward_model.ground_truth", id_key="extra_info.index")
    ds = PromptDataset.from_file(path, load_tokenizer(tokenizer_dir), cfg)
    prompt = ds[0]
    assert prompt.token_ids == (4, 11, 12, 5)
    assert prompt.metadata["label"] == "7" and prompt.id == "31"


def test_bad_jsonl_line_names_file_and_line(tokenizer_dir, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "what is 1+1 ?", "label": "2"}\n\n{"prompt": "what", "label": \n')
    with pytest.raises(InvalidArgumentError, match=r"bad\.jsonl:3: invalid JSON"):
        PromptDataset.from_file(path, load_tokenizer(tokenizer_dir))


def test_missing_key_names_key_and_available(tokenizer_dir, tmp_path):
    path = _write_jsonl(tmp_path / "k.jsonl", [{"question": "what", "answer": "1"}])
    with pytest.raises(InvalidArgumentError, match=r"k\.jsonl:1: record has no key 'prompt'.*answer"):
        PromptDataset.from_file(path, load_tokenizer(tokenizer_dir))
    ds = PromptDataset.from_file(path, load_tokenizer(tokenizer_dir),
                                 DatasetConfig(prompt_key="question", label_key="answer"))
    assert ds[0].metadata["label"] == "1"


def test_parquet_prompts(tokenizer_dir, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"problem": ["what is 1+1 ?", "what is 2+2 ?", "x x x x x x"],
                      "solution": ["2", "4", "6"]})
    path = tmp_path / "p.parquet"
    pq.write_table(table, path)
    cfg = DatasetConfig(prompt_key="problem", label_key="solution", max_prompt_len=5, shuffle=False)
    ds = PromptDataset.from_file(path, load_tokenizer(tokenizer_dir), cfg)
    assert [p.metadata["label"] for p in ds] == ["2", "4"] and ds.skipped == 1
    assert [line for line, _ in read_records(path)] == [1, 2, 3]


def test_not_parquet_file_is_a_clear_error(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet")
    with pytest.raises(InvalidArgumentError, match="broken.parquet"):
        list(read_records(path))


def test_shuffled_epochs_are_permutations_and_reproducible():
    prompts = [Prompt(id=str(i), token_ids=(i,), metadata={"label": i}) for i in range(10)]
    ds = PromptDataset(prompts, DatasetConfig(seed=5, epochs=2))
    epoch0 = [ds[p].id for p in range(10)]
    epoch1 = [ds[p].id for p in range(10, 20)]
    assert sorted(epoch0) == sorted(epoch1) == [str(i) for i in range(10)]
    assert epoch0 != epoch1
    again = PromptDataset(prompts, DatasetConfig(seed=5, epochs=2))
    assert [again[p].id for p in (13, 2, 11)] == [epoch1[3], epoch0[2], epoch1[1]]


def test_config_validation_and_unknown_format(tmp_path):
    with pytest.raises(ConfigError, match="DatasetConfig.max_prompt_len"):
        DatasetConfig(max_prompt_len=0)
    with pytest.raises(ConfigError, match="DatasetConfig.epochs"):
        DatasetConfig(epochs=0)
    with pytest.raises(ConfigError, match="DatasetConfig.prompt_key"):
        DatasetConfig(prompt_key="")
    with pytest.raises(InvalidArgumentError, match="cannot tell the format"):
        list(read_records(tmp_path / "data.csv"))
