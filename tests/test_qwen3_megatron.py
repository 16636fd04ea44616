"""Qwen3 and Qwen3-MoE on the Megatron path, single process: a checkpoint written by transformers goes
HF -> Megatron GPTModel (qk_layernorm, megatron-core MoE layers) -> HF bit-exact, and the GPTModel's
logits and per-token log-probs equal transformers' own forward."""

from __future__ import annotations

import copy
from itertools import pairwise

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'april_ext[megatron]')")
transformers = pytest.importorskip("transformers")

from _megatron_runtime import megatron_runtime  # noqa: E402, F401 - the module's runtime (autouse)
from _trainer_utils import TASK, make_batch  # noqa: E402
from _update_bound import OptimizerRecord, assert_same_gradients, assert_weights_within_adam_bound  # noqa: E402

from april_ext.algorithms import AlgorithmConfig  # noqa: E402
from april_ext.model import LlamaForCausalLM, ModelConfig, iter_safetensors  # noqa: E402
from april_ext.trainer import TorchTrainer, TrainerConfig  # noqa: E402
from april_ext.trainer.megatron import MegatronTrainer, MegatronTrainerConfig  # noqa: E402
from april_ext.trainer.megatron.model import MegatronCausalLM, transformer_config  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {"rtol": 1e-5, "atol": 1e-5} if DEVICE.type == "cpu" else {"rtol": 1e-4, "atol": 1e-4}

BASE = {"vocab_size": 71, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1000.0}
MOE = {"model_type": "qwen3_moe", "num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
MODELS = {
    "qwen3": ModelConfig(**BASE, model_type="qwen3"),
    "qwen3_tied": ModelConfig(**BASE, model_type="qwen3", tie_word_embeddings=True),
    "qwen3_moe_norm_topk": ModelConfig(**BASE, **MOE, norm_topk_prob=True),
    # Raw top-k probabilities, and layer 1 dense by mlp_only_layers.
    "qwen3_moe_raw_topk_mixed": ModelConfig(**BASE, **MOE, norm_topk_prob=False, mlp_only_layers=(1,)),
}


def transformers_checkpoint(config: ModelConfig, directory: str) -> torch.nn.Module:
    """A transformers model of `config` with random values everywhere (norms and the router too, which
    transformers initialises to ones and zeros), saved to `directory` in the published layout."""
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for _, param in model.named_parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    return model


def test_router_fields_follow_norm_topk_prob() -> None:
    normalised = transformer_config(MODELS["qwen3_moe_norm_topk"])
    raw = transformer_config(MODELS["qwen3_moe_raw_topk_mixed"])
    assert (normalised.moe_router_pre_softmax, raw.moe_router_pre_softmax) == (False, True)
    assert raw.moe_layer_freq == [1, 0, 1] and normalised.moe_layer_freq == [1, 1, 1]
    assert (raw.num_moe_experts, raw.moe_router_topk, raw.moe_ffn_hidden_size, raw.ffn_hidden_size) == (5, 2, 24, 64)
    assert raw.qk_layernorm and transformer_config(MODELS["qwen3"]).num_moe_experts is None


@pytest.mark.parametrize("name", MODELS)
def test_round_trip_and_logits_equal_transformers(name: str, tmp_path) -> None:
    config = MODELS[name]
    theirs = transformers_checkpoint(config, str(tmp_path))
    published = dict(iter_safetensors(tmp_path))
    megatron = MegatronCausalLM(config)
    megatron.load_weights(published.items())
    exported = megatron.hf_weights()
    assert set(exported) == set(published)
    for key, tensor in published.items():
        assert torch.equal(exported[key], tensor), key

    megatron = megatron.to(DEVICE)
    lengths = [19, 1, 12]
    ids = torch.randint(0, config.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0, 19, 20, 32])
    with torch.no_grad():
        got = megatron(ids.to(DEVICE), cu_seqlens=cu.to(DEVICE)).cpu()
        expected = torch.cat([theirs(input_ids=ids[a:b][None]).logits[0] for a, b in pairwise(cu.tolist())])
    torch.testing.assert_close(got, expected, **TOL)
    # Per-token log-probs of each sequence's next tokens (what the trainer's ratios use).
    inside = torch.ones(len(ids) - 1, dtype=torch.bool)
    inside[cu[1:-1] - 1] = False
    targets = ids[1:][inside]

    def logprobs(logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits[:-1][inside], dim=-1).gather(1, targets[:, None]).squeeze(1)

    torch.testing.assert_close(logprobs(got), logprobs(expected), **TOL)


def test_moe_train_steps_match_the_torch_trainer() -> None:
    """Gradients through the routed experts and the router: two RL steps of the Megatron trainer equal the
    torch trainer's on the embedded Qwen3-MoE model, from the same weights and batches."""
    config = TASK.model_config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, head_dim=8,
                               model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=(1,))
    model = LlamaForCausalLM(config)
    model.init_weights(3)
    settings = TrainerConfig(lr=1e-2, micro_batch_tokens=40, grad_clip=0.5, mixed_precision="fp32",
                             algorithm=AlgorithmConfig(kl_loss_coef=0.05, kl_loss_type="k3", max_staleness=None))
    reference = TorchTrainer(copy.deepcopy(model), settings)
    megatron = MegatronTrainer(MegatronTrainerConfig(model=config, trainer=settings), model.named_parameters())
    expected_record, got_record = OptimizerRecord(reference), OptimizerRecord(megatron)
    for step in range(2):
        batch = make_batch(model, step, seed=step)
        expected, got = reference.train_step(batch), megatron.train_step(batch)
        for key in ("loss", "grad_norm", "entropy", "n_loss_tokens"):
            assert got[key] == pytest.approx(expected[key], rel=TOL["rtol"], abs=TOL["atol"] / 10), (step, key)
    # The router's and experts' gradients, then the weights within Adam's bound (tests/_update_bound.py).
    assert_same_gradients(got_record, expected_record)
    ours = dict(reference.export_weights(to_cpu=True).tensors)
    exported = dict(megatron.export_weights(to_cpu=True))
    assert_weights_within_adam_bound(exported, ours, got_record, expected_record)
