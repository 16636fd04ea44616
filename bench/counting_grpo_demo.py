"""Longer learnability demo: GRPO / DAPO on the long-tailed counting task with the torch trainer.

    .venv/bin/python bench/counting_grpo_demo.py --steps 600 --out /tmp/counting_demo

Samples with plain torch (no engine, no scheduler), trains one step per batch, and writes
metrics.jsonl (one line per step), reward.png (mean reward, its content and length credits and the
exact-solve rate per step) and the final model (a Hugging Face checkpoint directory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from april_ext.algorithms import AlgorithmConfig
from april_ext.model import LlamaForCausalLM, save_pretrained
from april_ext.plots import save_figure
from april_ext.tasks import CountingTask, CountingTaskConfig
from april_ext.trainer import TorchTrainer, TrainerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _reference_rollout import pack_batch, sample_responses  # noqa: E402 - the tests' reference rollout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prompts", type=int, default=16, help="groups per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per group")
    parser.add_argument("--max-count", type=int, default=24, help="cap of the required answer length")
    parser.add_argument("--symbols", type=int, default=8, help="distinct symbols X")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--algorithm", choices=("grpo", "dapo", "drgrpo", "gspo"), default="dapo")
    parser.add_argument("--minibatches", type=int, default=1, help="optimizer steps per batch")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tied", action="store_true", help="tie the input and output embeddings")
    parser.add_argument("--out", default="counting_demo")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    task = CountingTask(CountingTaskConfig(n_symbols=args.symbols, max_count=args.max_count, seed=0))
    model = LlamaForCausalLM(task.model_config(tie_word_embeddings=args.tied))
    model.init_weights(0)
    algorithm = getattr(AlgorithmConfig, args.algorithm)()
    trainer = TorchTrainer(model, TrainerConfig(algorithm=algorithm, lr=args.lr, device="cpu",
                                                minibatches=args.minibatches))
    gen = torch.Generator().manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    start = time.perf_counter()
    with open(os.path.join(args.out, "metrics.jsonl"), "w", encoding="utf-8") as log:
        for step in range(args.steps):
            prompts = task.prompts(step * args.prompts, args.prompts)
            groups = sample_responses(model, [p.token_ids for p in prompts], n_samples=args.samples,
                                      max_new_tokens=task.max_response_len(), eos_ids=[task.eos_id],
                                      generator=gen)
            scores = [[task.reward(p, r.tokens) for r in g] for p, g in zip(prompts, groups)]
            metrics = trainer.train_step(pack_batch(prompts, groups, scores, trainer.version))
            parts = np.array([task.reward_parts(p, r.tokens) for p, g in zip(prompts, groups) for r in g])
            metrics["content"], metrics["length"] = (float(v) for v in parts.mean(axis=0))
            metrics["solved"] = float(np.mean([s == 1.0 for g in scores for s in g]))
            metrics["step"] = step
            metrics["elapsed_s"] = time.perf_counter() - start
            rows.append(metrics)
            log.write(json.dumps(metrics) + "\n")
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step:4d}  reward {metrics['reward_mean']:.3f}  content {metrics['content']:.3f}  "
                      f"length {metrics['length']:.3f}  solved {metrics['solved']:.3f}  "
                      f"len {metrics['response_len_mean']:.1f}  {metrics['elapsed_s']:.0f}s", flush=True)
    _plot(rows, os.path.join(args.out, "reward.png"))
    save_pretrained(model, os.path.join(args.out, "model"))


def _plot(rows: list[dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("reward_mean", "content", "length", "solved"):
        values = np.array([r[key] for r in rows])
        window = min(10, len(values))
        smooth = np.convolve(values, np.ones(window) / window, mode="valid")
        ax.plot(steps, values, alpha=0.25)
        ax.plot(steps[window - 1:], smooth, label=f"{key} ({window}-step mean)")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("counting task, torch trainer, random init")
    fig.tight_layout()
    save_figure(fig, path, dpi=100)


if __name__ == "__main__":
    main()
