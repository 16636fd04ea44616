"""EngineCore: the synchronous embedded rollout engine (requests in, token chunks out, one step at a time).

Not thread-safe: AsyncEngine serialises every call on its event loop; tests and scripts can drive it
directly (add_request + step, or the batch `generate`).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as SequenceOf

import torch

from april_ext.batch import FinishReason
from april_ext.engine.batch_scheduler import BatchScheduler
from april_ext.engine.block_manager import BlockManager
from april_ext.engine.config import EngineConfig
from april_ext.engine.memory import MemoryPlacement
from april_ext.engine.model_runner import ModelRunner
from april_ext.engine.sampler import uniform
from april_ext.engine.sequence import Sequence, SequenceStatus
from april_ext.errors import ConfigError, InvalidArgumentError, InvalidStateError
from april_ext.model import LlamaForCausalLM, ModelConfig, iter_safetensors
from april_ext.protocol.engine_base import check_weight_version, generate_args
from april_ext.protocol.memory_tags import memory_tags
from april_ext.protocol.outputs import EngineStats, GenerationChunk, GenerationOutput
from april_ext.protocol.request_ids import RequestIds, abort_ids
from april_ext.protocol.sampling_params import SamplingParams

WeightsSource = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | str | os.PathLike[str]


class EngineCore:
    """Continuous-batching generation with a paged KV cache for one LlamaForCausalLM.

    The model's parameters are moved into the allocator region "weights" and the KV cache is allocated
    in "kv_cache", so both can be released and resumed (release_memory / resume_memory).
    """

    def __init__(self, model: LlamaForCausalLM, config: EngineConfig | None = None, *,
                 weight_version: int = 0) -> None:
        config = config or EngineConfig()
        self.config = config
        device = torch.device(config.device)
        use_triton = config.attention_backend == "triton" or (config.attention_backend == "auto"
                                                              and device.type == "cuda")
        model_config: ModelConfig = model.config
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            raise ConfigError(f"EngineConfig.max_model_len {self.max_model_len} exceeds the model's "
                              f"max_position_embeddings {model_config.max_position_embeddings}")
        self.memory = MemoryPlacement(device, tag_prefix=config.memory_tag_prefix,
                                      weights_cpu_backup=config.weights_cpu_backup,
                                      kv_cache_cpu_backup=config.kv_cache_cpu_backup)
        if model.lm_head.weight.device != device:
            model = model.to(device)
        self.model = self.memory.place_module(model.eval(), "weights")
        self.model_config = model_config
        self.blocks = BlockManager(config.num_blocks, config.block_size, prefix_caching=config.prefix_caching)
        self.scheduler = BatchScheduler(self.blocks, max_num_seqs=config.max_num_seqs,
                                        max_num_batched_tokens=config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, num_blocks=config.num_blocks, block_size=config.block_size,
                                  use_triton=use_triton, allocate=self.memory.allocate)
        self.weight_version = weight_version
        self._requests: dict[str, Sequence] = {}
        self._next_id = 0
        self._ids = RequestIds("req")
        self._steps = 0
        self._prefill_tokens = 0
        self._decode_tokens = 0
        self._generated = 0
        self._rate_window: deque[tuple[float, int]] = deque(maxlen=64)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], config: EngineConfig | None = None, *,
                        dtype: torch.dtype | None = None, weight_version: int = 0) -> EngineCore:
        from april_ext.model import load_pretrained

        config = config or EngineConfig()
        return cls(load_pretrained(path, device=config.device, dtype=dtype), config, weight_version=weight_version)

    # Requests ---------------------------------------------------------------------------------------

    def add_request(self, input_ids: SequenceOf[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, publish_prefix: bool = True) -> str:
        """Queues a request; returns its id. Raises InvalidArgumentError on bad input. With publish_prefix=False
        the request reuses cached prefix blocks but publishes none of its own (the run's evaluation). It still
        takes free blocks, which can evict cached prefixes a later request would have reused: the requests after
        it compute exactly what they would have without it when the cache held nothing they need."""
        checked, params = generate_args(input_ids, params)
        ids = checked if isinstance(checked, list) else checked.tolist()
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise InvalidArgumentError(f"input_ids contains {bad[:5]} outside the vocabulary [0, {vocab})")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidArgumentError(f"stop_token_ids contains {bad[:5]} outside the vocabulary [0, {vocab}): "
                                       "no token the model generates could match them")
        total = len(ids) + params.max_new_tokens
        capacity = min(self.max_model_len, self.config.num_blocks * self.config.block_size)
        if total > capacity:
            raise InvalidArgumentError(
                f"prompt length {len(ids)} + max_new_tokens {params.max_new_tokens} = {total} exceeds the "
                f"context limit {capacity} (min of max_model_len {self.max_model_len} and KV capacity "
                f"{self.config.num_blocks * self.config.block_size} tokens)")
        request_id = self._ids.claim(request_id, self._requests)
        seed = params.seed if params.seed is not None else int(uniform(self.config.seed, self._next_id) * 2**53)
        self._next_id += 1
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.model_config.eos_token_ids)
        seq = Sequence(request_id, ids, params, seed, frozenset(stop))
        seq.publish_prefix = publish_prefix
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` is queued or running."""
        return request_id in self._requests

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def paused(self) -> bool:
        return bool(self.memory.paused_tags)

    def step(self) -> list[GenerationChunk]:
        """Runs one model step; returns one chunk per request that produced a token."""
        if self.paused:
            raise InvalidStateError(f"memory tags {sorted(self.memory.paused_tags)} are released; "
                                    "resume_memory before stepping")
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        results = self.runner.run(chunks)
        for c in chunks:
            if c.num_tokens == 1 and c.seq.num_computed > 0:
                self._decode_tokens += 1
            else:
                self._prefill_tokens += c.num_tokens
            c.seq.num_computed += c.num_tokens
            self.blocks.register_computed(c.seq)
        out = []
        for seq, token, logprob in results:
            seq.append(token, logprob, self.weight_version)
            if seq.status is SequenceStatus.FINISHED:
                self.scheduler.remove(seq)
                del self._requests[seq.request_id]
            out.append(self._chunk(seq))
        self._steps += 1
        self._generated += len(results)
        self._rate_window.append((time.perf_counter(), len(results)))
        return out

    def _chunk(self, seq: Sequence) -> GenerationChunk:
        start = seq.prompt_len + seq.num_reported
        seq.num_reported = seq.num_output
        return GenerationChunk(seq.request_id, seq.token_ids[start:], seq.logprobs[start - seq.prompt_len:],
                               self.weight_version, seq.finish_reason, seq.matched_stop)

    def abort(self, request_ids: str | Iterable[str] | None = None) -> list[GenerationOutput]:
        """Ends the given requests (all when None) at once; returns their partial outputs with finish
        reason ABORT. Unknown ids raise UnknownIdError before anything is aborted."""
        outputs = []
        for request_id in abort_ids(request_ids, self._requests):
            seq = self._requests.pop(request_id)
            self.scheduler.remove(seq)
            seq.finish(FinishReason.ABORT)
            outputs.append(self.output(seq))
        return outputs

    @staticmethod
    def output(seq: Sequence) -> GenerationOutput:
        return GenerationOutput(seq.request_id, seq.token_ids[:seq.prompt_len], seq.output_ids, list(seq.logprobs),
                                list(seq.versions), seq.finish_reason, seq.matched_stop, seq.num_preemptions)

    def generate(self, prompts: SequenceOf[SequenceOf[int]],
                 params: SamplingParams | SequenceOf[SamplingParams] | None = None) -> list[GenerationOutput]:
        """Runs the given prompts to completion (with whatever else is queued); outputs in prompt order."""
        params_list = list(params) if isinstance(params, SequenceOf) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidArgumentError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        seqs = {}
        for prompt, p in zip(prompts, params_list):
            rid = self.add_request(prompt, p)
            seqs[rid] = self._requests[rid]
        while any(s.status is not SequenceStatus.FINISHED for s in seqs.values()):
            self.step()
        return [self.output(s) for s in seqs.values()]

    # Weights and memory -----------------------------------------------------------------------------

    def update_weights(self, weights: WeightsSource, version: int) -> list[str]:
        """Loads new weights in place (named tensors: any subset; a checkpoint directory: all of them)
        and sets the weight version. Running requests keep their KV cache (computed by the older weights)
        and continue: their later tokens carry the new version (PipelineRL's in-flight update, SGLang's
        `in_place` pause). The prefix cache starts a new epoch, so no new request reuses older K/V; to
        recompute the running requests instead, `flush_cache` first. Bad names or shapes, and non-finite values, raise
        InvalidArgumentError and change nothing, except in a stream: named tensors that are not a Mapping
        (a trainer's ExportedWeights) are copied as they are read, one held at a time, and an error leaves
        those before it copied (the version stays)."""
        check_weight_version(version)
        if self.memory.is_paused("weights"):
            raise InvalidStateError("update_weights needs the 'weights' memory resumed first")
        if isinstance(weights, (str, os.PathLike)):
            loaded = self.model.load_weights(iter_safetensors(weights), require_all=True)
        else:
            streamed = not isinstance(weights, Mapping)
            loaded = self.model.load_weights(weights if streamed else weights.items(), require_all=False,
                                             atomic=not streamed)
        self.blocks.reset_prefix_cache()
        self.weight_version = version
        return loaded

    def flush_cache(self) -> None:
        """Drops every cached K/V: running requests return to the queue and are recomputed (under the
        weights loaded when they are readmitted)."""
        self.scheduler.preempt_all()
        self.blocks.reset_prefix_cache()

    def release_memory(self, tags: str | Iterable[str] | None = None) -> None:
        """Releases the physical memory of the tags (protocol.memory_tags: "weights", "kv_cache",
        "cuda_graph"; None = all). The KV cache keeps a host copy when EngineConfig.kv_cache_cpu_backup
        (resume restores it bit-exactly and running requests continue without recompute); otherwise it
        is flushed first (running requests will be recomputed). Weights keep a host copy when
        EngineConfig.weights_cpu_backup. "cuda_graph" holds nothing here (the engine captures no CUDA
        graphs): releasing it changes nothing. Steps wait until resume_memory."""
        names = memory_tags(tags)
        if "kv_cache" in names and not self.config.kv_cache_cpu_backup:
            self.flush_cache()
        self.memory.release(names)

    def resume_memory(self, tags: str | Iterable[str] | None = None) -> None:
        self.memory.resume(memory_tags(tags))

    # Introspection ----------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        window = self._rate_window
        rate = 0.0
        if len(window) >= 2 and window[-1][0] > window[0][0]:
            rate = sum(n for _, n in list(window)[1:]) / (window[-1][0] - window[0][0])
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            free_blocks=self.blocks.num_free, total_blocks=self.blocks.num_blocks,
            weight_version=self.weight_version, steps=self._steps, prefill_tokens=self._prefill_tokens,
            decode_tokens=self._decode_tokens, generated_tokens=self._generated,
            preemptions=self.scheduler.num_preemptions, prefix_cache_hit_tokens=self.scheduler.prefix_hit_tokens,
            tokens_per_s=rate, paused_tags=tuple(sorted(self.memory.paused_tags)))
