"""Cost model of one simulated inference engine (one GPU serving one model), and presets derived from specs.

Decode is memory-bound: a step streams the weights once (fixed term), does a little per-sequence work
(per-sequence term) and reads every running sequence's KV cache (per-KV-token term). Prefill is
compute-bound: linear FLOPs per token plus causal attention that grows with the context. The presets
derive every term from bandwidth, FLOPs and model shape; docs/sim.md shows the arithmetic.

With ``mixed_chunk`` (SGLang's --enable-mixed-chunk) prefill chunks ride in the decode batch's forward pass and
an iteration costs a roofline: max(memory time, compute time) + overhead, so prefill FLOPs hide partly under
the memory-bound decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from april_ext.errors import ConfigError

GIB = 1024**3


def _positive(owner: str, name: str, value: float, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        allowed = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ConfigError(f"{owner}.{name}={value!r} is not allowed: {allowed}")


@dataclass(frozen=True)
class CostModel:
    """Virtual-time costs of one engine replica, in seconds, and its capacity."""

    decode_fixed_s: float
    """Per decode step, independent of the batch: streaming the weights once, launch/scheduling overhead."""
    decode_per_seq_s: float
    """Per decode step and running sequence: the token's linear-layer FLOPs, sampling."""
    decode_per_kv_token_s: float
    """Per decode step and KV token read: KV bytes per token / effective HBM bandwidth."""
    prefill_per_token_s: float
    """Per prefilled token: linear-layer FLOPs at prefill efficiency."""
    prefill_attn_per_token_pair_s: float = 0.0
    """Per (query, key) pair of causal prefill attention: extending a context from a to b costs (b^2 - a^2) / 2
    pairs."""
    prefill_fixed_s: float = 0.0
    """Per prefill batch (one admission round)."""
    kv_capacity_tokens: int = 1 << 20
    """KV cache tokens of the replica; running sequences' contexts must fit."""
    max_num_seqs: int = 256
    """Running sequences at most (the engine's max running requests)."""
    admission_headroom: float = 0.05
    """New sequences are admitted only while the KV cache stays below (1 - headroom) x capacity; growth past the
    capacity preempts the newest sequence (recomputed later). The gap keeps admission and preemption from thrashing."""
    step_overhead_s: float = 0.0
    """The part of decode_fixed_s that is not memory traffic (scheduling, sampling, launches); only the mixed
    roofline needs the split: decode_fixed_s - step_overhead_s is the time of streaming the weights once."""
    mixed_chunk: bool = False
    """Mixed chunked prefill: an iteration runs the decode batch and up to chunked_prefill_size prefill tokens in
    one forward pass, costing max(memory, compute) + step_overhead_s. False: separate prefill batches during
    which decoding pauses (SGLang's default)."""
    chunked_prefill_size: int = 8192
    """Prefill tokens per mixed iteration at most (SGLang's default chunk)."""
    kv_backup_per_token_s: float = 0.0
    """Copying one KV token of the replica to host memory (a colocated carry step boundary backs up the carried
    KV while the trainer holds the GPUs): KV bytes per token / (GPUs x device-to-host bandwidth)."""
    kv_restore_per_token_s: float = 0.0
    """Copying one KV token back from host memory: KV bytes per token / (GPUs x host-to-device bandwidth)."""

    def __post_init__(self) -> None:
        for name in ("decode_fixed_s", "decode_per_seq_s", "decode_per_kv_token_s", "prefill_per_token_s",
                     "prefill_attn_per_token_pair_s", "prefill_fixed_s", "kv_backup_per_token_s",
                     "kv_restore_per_token_s"):
            _positive("CostModel", name, getattr(self, name), allow_zero=name != "decode_fixed_s")
        _positive("CostModel", "step_overhead_s", self.step_overhead_s, allow_zero=True)
        if self.step_overhead_s > self.decode_fixed_s:
            raise ConfigError(f"CostModel.step_overhead_s={self.step_overhead_s!r} is not allowed: at most "
                              f"decode_fixed_s ({self.decode_fixed_s!r}), of which it is a part")
        if not isinstance(self.mixed_chunk, bool):
            raise ConfigError(f"CostModel.mixed_chunk={self.mixed_chunk!r} is not allowed: True or False")
        for name in ("kv_capacity_tokens", "max_num_seqs", "chunked_prefill_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"CostModel.{name}={value!r} is not allowed: an int >= 1")
        if not (isinstance(self.admission_headroom, (int, float)) and 0 <= self.admission_headroom < 1):
            raise ConfigError(f"CostModel.admission_headroom={self.admission_headroom!r} is not allowed: in [0, 1)")

    @property
    def weights_read_s(self) -> float:
        """Memory time of streaming the weights once (the mixed roofline's fixed memory term)."""
        return self.decode_fixed_s - self.step_overhead_s

    def iteration_time(self, batch: int, kv_tokens: int, prefill_compute_s: float = 0.0,
                       prefill_kv_reads: int = 0) -> float:
        """Mixed chunk: one forward pass of ``batch`` decoding sequences holding ``kv_tokens`` plus prefill pieces
        whose compute time is ``prefill_compute_s`` and whose attention reads ``prefill_kv_reads`` cached tokens."""
        memory = self.weights_read_s + self.decode_per_kv_token_s * (kv_tokens + prefill_kv_reads)
        compute = self.decode_per_seq_s * batch + prefill_compute_s
        return max(memory, compute) + self.step_overhead_s

    def _compute_bound_steps(self, batch: int, kv_tokens: int, steps: int) -> int:
        # Decode step k is compute-bound while per_seq * B > weights + per_kv * (S + B k); the KV grows, so
        # those are the first ceil(x) steps and every later step is memory-bound.
        excess = self.decode_per_seq_s * batch - self.weights_read_s - self.decode_per_kv_token_s * kv_tokens
        if excess <= 0:
            return 0
        growth = self.decode_per_kv_token_s * batch
        return steps if growth == 0 else min(steps, math.ceil(excess / growth))

    def decode_time(self, batch: int, kv_tokens: int, steps: int) -> float:
        """Time of ``steps`` decode steps of ``batch`` sequences starting with ``kv_tokens`` cached tokens."""
        if self.mixed_chunk:
            k = self._compute_bound_steps(batch, kv_tokens, steps)
            n = steps - k
            memory = self.weights_read_s + self.decode_per_kv_token_s * (kv_tokens + batch * k)
            return (k * (self.decode_per_seq_s * batch + self.step_overhead_s) + n * (memory + self.step_overhead_s)
                    + self.decode_per_kv_token_s * batch * n * (n - 1) / 2)
        base = self.decode_fixed_s + self.decode_per_seq_s * batch + self.decode_per_kv_token_s * kv_tokens
        return base * steps + self.decode_per_kv_token_s * batch * steps * (steps - 1) / 2

    def steps_within(self, batch: int, kv_tokens: int, elapsed: float) -> int:
        """Whole decode steps that complete within ``elapsed`` seconds (inverse of decode_time)."""
        if elapsed <= 0:
            return 0
        if self.mixed_chunk:
            # decode_time is increasing in steps: bracket by doubling, then bisect (a few dozen evaluations).
            lo, hi = 0, 1
            while self.decode_time(batch, kv_tokens, hi) <= elapsed:
                lo, hi = hi, hi * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self.decode_time(batch, kv_tokens, mid) <= elapsed:
                    lo = mid
                else:
                    hi = mid
            return lo
        base = self.decode_fixed_s + self.decode_per_seq_s * batch + self.decode_per_kv_token_s * kv_tokens
        g = self.decode_per_kv_token_s * batch
        if g == 0:
            m = int(elapsed / base)
        else:
            b = base - g / 2
            m = int((-b + math.sqrt(b * b + 2 * g * elapsed)) / g)
        # Closed form in floating point: correct by one step where rounding put it on the wrong side.
        while m > 0 and self.decode_time(batch, kv_tokens, m) > elapsed:
            m -= 1
        while self.decode_time(batch, kv_tokens, m + 1) <= elapsed:
            m += 1
        return m

    def prefill_time(self, start: int, end: int) -> float:
        """Time to prefill context positions [start, end) of one sequence (a resume prefills prompt + partial)."""
        n = end - start
        return self.prefill_per_token_s * n + self.prefill_attn_per_token_pair_s * (end * end - start * start) / 2

    def least_busy_time(self, tokens: int, kv_reads: int, prefill_s: float) -> float:
        """The least engine time in which any schedule decodes ``tokens`` tokens whose steps read ``kv_reads`` KV
        tokens in all, and prefills ``prefill_s`` seconds of prefill work.

        A decode iteration runs at most max_num_seqs sequences over at most kv_capacity_tokens cached tokens, so
        the work needs at least max(tokens / max_num_seqs, kv_reads / kv_capacity_tokens) iterations; each costs
        its fixed term, and the per-sequence and per-KV-token terms sum to the same totals under any schedule.
        Mixed chunk: an iteration costs max(memory, compute) + overhead, so the sum is at least the larger of the
        summed memory and the summed compute (the prefill rides on the compute side).
        """
        iterations = max(tokens / self.max_num_seqs, kv_reads / self.kv_capacity_tokens)
        if self.mixed_chunk:
            memory = iterations * self.weights_read_s + self.decode_per_kv_token_s * kv_reads
            compute = self.decode_per_seq_s * tokens + prefill_s
            return max(memory, compute) + iterations * self.step_overhead_s
        return (iterations * self.decode_fixed_s + self.decode_per_seq_s * tokens
                + self.decode_per_kv_token_s * kv_reads + prefill_s)


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet numbers of an accelerator and the efficiencies assumed for them."""

    name: str
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    bandwidth_efficiency: float = 0.7  # achieved / peak HBM bandwidth in decode kernels
    prefill_mfu: float = 0.5  # achieved / peak FLOPs in prefill
    decode_mfu: float = 0.3  # achieved / peak FLOPs of the per-sequence decode work (small GEMMs)
    step_overhead_s: float = 1.0e-3  # scheduling, sampling, launches per decode step (CUDA graphs on)
    memory_fraction: float = 0.85  # share of HBM the engine may use (weights + KV)
    activation_reserve_bytes: float = 4 * GIB  # workspace kept free of KV
    link_bandwidth: float = 450e9  # bytes/s per direction between the GPUs of a tensor-parallel engine (peak)
    link_topology: str = "switch"
    """"switch": every GPU reaches any peer at its full link_bandwidth (NVLink through NVSwitch); "mesh": one link
    of link_bandwidth per pair of GPUs (AMD Infinity Fabric on an 8-GPU MI300X platform), so a tensor-parallel
    engine of tp GPUs moves its all-reduces over tp - 1 links per GPU."""
    allreduce_latency_s: float = 10e-6  # one small all-reduce inside a CUDA graph (decode)
    # Host link (PCIe Gen5 x16 on all three), as measured with nvbandwidth on an H100 cluster (NVIDIA/nvbandwidth
    # issue #24: device_to_host 52.8 GB/s, host_to_device 35.2 GB/s per GPU); docs/sim.md.
    device_to_host_bandwidth: float = 52.8e9  # bytes/s
    host_to_device_bandwidth: float = 35.2e9  # bytes/s
    source: str = ""
    """Where the datasheet figures (HBM, bandwidth, FLOP/s, links) come from; the efficiencies are assumptions
    (docs/sim.md, "Cost presets")."""

    def tp_link_bandwidth(self, tensor_parallel: int) -> float:
        """Bytes/s per direction each GPU of a tensor-parallel engine of ``tensor_parallel`` GPUs reaches its
        peers with (see link_topology)."""
        if self.link_topology == "mesh":
            return self.link_bandwidth * max(1, tensor_parallel - 1)
        return self.link_bandwidth


@dataclass(frozen=True)
class ModelSpec:
    """The model's shape: what the weights and the KV cache of one token weigh."""

    name: str
    params: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes  # K and V


def derive_cost_model(gpu: GpuSpec, model: ModelSpec, max_num_seqs: int = 256,
                      admission_headroom: float = 0.05, mixed_chunk: bool = False,
                      chunked_prefill_size: int = 8192, tensor_parallel: int = 1,
                      mem_fraction_static: float | None = None) -> CostModel:
    """A CostModel of one engine of ``tensor_parallel`` GPUs from datasheet numbers (docs/sim.md has the formulas
    and their assumptions). ``mem_fraction_static``: SGLang's setting, the share of each GPU's memory for weights
    and KV pool together (None: the GPU's memory_fraction minus its activation reserve)."""
    if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool) or tensor_parallel < 1:
        raise ConfigError(f"tensor_parallel={tensor_parallel!r} is not allowed: an int >= 1")
    if mem_fraction_static is not None and not (isinstance(mem_fraction_static, (int, float))
                                                and 0 < mem_fraction_static <= 1):
        raise ConfigError(f"mem_fraction_static={mem_fraction_static!r} is not allowed: a number in (0, 1]")
    tp = tensor_parallel
    bandwidth = gpu.hbm_bandwidth * gpu.bandwidth_efficiency * tp
    if mem_fraction_static is None:
        pool = (gpu.hbm_bytes * gpu.memory_fraction - gpu.activation_reserve_bytes) * tp
    else:
        pool = gpu.hbm_bytes * mem_fraction_static * tp
    kv_budget = pool - model.weight_bytes
    if kv_budget <= 0:
        raise ConfigError(f"{model.name} does not fit on {gpu.name} x{tp}: no memory left for the KV cache")
    # Tensor parallelism: two all-reduces per layer per forward pass; decode pays their latency, prefill moves
    # hidden x dtype bytes per token and all-reduce over the link (a two-GPU ring sends each byte once).
    allreduce_s = 2 * model.layers * gpu.allreduce_latency_s if tp > 1 else 0.0
    prefill_comm_s = (2 * model.layers * model.hidden * model.dtype_bytes * (tp - 1) / tp
                      / gpu.tp_link_bandwidth(tp) if tp > 1 else 0.0)
    overhead = gpu.step_overhead_s + allreduce_s
    flops = gpu.bf16_flops * tp
    return CostModel(
        decode_fixed_s=model.weight_bytes / bandwidth + overhead,
        decode_per_seq_s=2 * model.params / (flops * gpu.decode_mfu),
        decode_per_kv_token_s=model.kv_bytes_per_token / bandwidth,
        prefill_per_token_s=2 * model.params / (flops * gpu.prefill_mfu) + prefill_comm_s,
        # QK^T and PV: 2 matmuls x 2 FLOPs per multiply-add, per query head and head dim.
        prefill_attn_per_token_pair_s=4 * model.layers * model.q_heads * model.head_dim / (
            flops * gpu.prefill_mfu),
        prefill_fixed_s=overhead,
        kv_capacity_tokens=int(kv_budget // model.kv_bytes_per_token),
        max_num_seqs=max_num_seqs,
        admission_headroom=admission_headroom,
        step_overhead_s=overhead,
        mixed_chunk=mixed_chunk,
        chunked_prefill_size=chunked_prefill_size,
        kv_backup_per_token_s=model.kv_bytes_per_token / (tp * gpu.device_to_host_bandwidth),
        kv_restore_per_token_s=model.kv_bytes_per_token / (tp * gpu.host_to_device_bandwidth),
    )


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("H100 SXM 80GB", hbm_bytes=80 * GIB, hbm_bandwidth=3.35e12, bf16_flops=989e12,
                    source="NVIDIA H100 datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense BF16, NVLink "
                           "900 GB/s bidirectional through NVSwitch, PCIe Gen5 x16"),
    # H200 SXM: 141 GB HBM3e as sold (143,771 MiB as nvidia-smi reports it), the H100's compute and NVLink.
    "h200": GpuSpec("H200 SXM 141GB", hbm_bytes=143771 * 1024**2, hbm_bandwidth=4.8e12, bf16_flops=989e12,
                    source="NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s dense BF16, NVLink "
                           "900 GB/s bidirectional through NVSwitch, PCIe Gen5 x16"),
    # MI300X, the hardware of most of the APRIL paper's results: AMD's published figures. The achieved bandwidth
    # (60%) is lower than the NVIDIA presets' 70%: a measured single-stream decode of a dense 8B model ties the
    # H200 (1.02x, vLLM on both; docs/sim.md), i.e. ~0.7 x 4.8 / 5.3 of the MI300X's peak. The MFUs are assumptions.
    "mi300x": GpuSpec("MI300X 192GB", hbm_bytes=192 * GIB, hbm_bandwidth=5.3e12, bf16_flops=1307.4e12,
                      bandwidth_efficiency=0.6, prefill_mfu=0.4, decode_mfu=0.25, link_bandwidth=64e9,
                      link_topology="mesh",
                      source="AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s peak bandwidth, 1307.4 TFLOP/s peak "
                             "dense BF16 (2614.9 with sparsity), 7 Infinity Fabric links of 128 GB/s bidirectional "
                             "(one per peer of an 8-GPU platform, 896 GB/s in all), PCIe Gen5 x16 to the host"),
    # H20, the GPU of verl's fully_async_policy measurements (docs/sim.md, "Asynchronous modes at scale"): the
    # Hopper memory system with a seventh of the H100's compute, so its decode batches turn compute-bound early.
    "h20": GpuSpec("H20 96GB", hbm_bytes=96 * GIB, hbm_bandwidth=4.0e12, bf16_flops=148e12,
                   source="NVIDIA HGX H20 specification as published at its launch (Nov 2023, reported by the trade "
                          "press): 96 GB HBM3, 4.0 TB/s, 148 TFLOP/s dense FP16/BF16, NVLink 900 GB/s, PCIe Gen5 x16"),
}

MODELS: dict[str, ModelSpec] = {
    # Qwen3-4B: tied embeddings (151936 x 2560 counted once), GQA 32 query / 8 KV heads of 128.
    "qwen3-4b": ModelSpec("Qwen3-4B", params=4.02e9, layers=36, q_heads=32, kv_heads=8, head_dim=128, hidden=2560),
    # Qwen3-8B: untied embeddings and LM head, GQA 32 / 8 heads of 128.
    "qwen3-8b": ModelSpec("Qwen3-8B", params=8.19e9, layers=36, q_heads=32, kv_heads=8, head_dim=128, hidden=4096),
    # Qwen2.5-Math-7B (Qwen/Qwen2.5-Math-7B config.json: hidden 3584, 28 layers, 28 query / 4 KV heads of 128,
    # intermediate 18944, vocabulary 152064, untied embeddings; 7.62e9 parameters as Qwen2.5-7B): verl's model.
    "qwen2.5-math-7b": ModelSpec("Qwen2.5-Math-7B", params=7.62e9, layers=28, q_heads=28, kv_heads=4, head_dim=128,
                                 hidden=3584),
}


@dataclass(frozen=True)
class ClusterConfig:
    """Engine replicas behind a router, all with the same cost model."""

    cost: CostModel
    num_engines: int = 8
    router: str = "least_loaded"
    """"least_loaded": the replica with the fewest running + waiting requests; "round_robin"."""
    name: str = "custom"
    abort_latency_s: float = 0.0
    """Virtual seconds an abort call takes before the engines are free (the request round trip and the engines'
    next scheduling pass); the clock moves on by this much at every abort call that ends requests."""
    weight_sync_s: float = 0.0
    """Virtual seconds a weight update takes (trainer to engines); outside the rollout window."""
    gpus_per_engine: int = 1
    """GPUs behind one engine (tensor parallelism), for reports."""
    colocated: bool = False
    """The engines share their GPUs with the trainer (as the APRIL scripts run): with the carry step boundary the
    carried KV is backed up to host memory when the engines pause and restored before they continue, at the cost
    model's kv_backup / kv_restore rates (abort leaves no KV to keep)."""

    def __post_init__(self) -> None:
        if not isinstance(self.cost, CostModel):
            raise ConfigError(f"ClusterConfig.cost is a {type(self.cost).__name__}; a CostModel is required")
        for name in ("num_engines", "gpus_per_engine"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ClusterConfig.{name}={value!r} is not allowed: an int >= 1")
        if self.router not in ("least_loaded", "round_robin"):
            raise ConfigError(f"ClusterConfig.router={self.router!r} is not allowed: 'least_loaded' or 'round_robin'")
        _positive("ClusterConfig", "abort_latency_s", self.abort_latency_s, allow_zero=True)
        _positive("ClusterConfig", "weight_sync_s", self.weight_sync_s, allow_zero=True)
        if not isinstance(self.colocated, bool):
            raise ConfigError(f"ClusterConfig.colocated={self.colocated!r} is not allowed: True or False")


def is_cluster_name(name: object) -> bool:
    """Whether ``name`` is ``<gpu>-<model>`` with a GPU of GPUS and a model of MODELS (what cluster_preset takes)."""
    if not isinstance(name, str):
        return False
    gpu, _, model = name.partition("-")
    return gpu in GPUS and model in MODELS


def cluster_preset(name: str, num_engines: int = 8, mixed_chunk: bool = False,
                   chunked_prefill_size: int = 8192, tensor_parallel: int = 1,
                   mem_fraction_static: float | None = None, abort_latency_s: float = 0.0,
                   weight_sync_s: float = 0.0, colocated: bool = False) -> ClusterConfig:
    """``<gpu>-<model>``: h100-qwen3-4b, h100-qwen3-8b, h200-qwen3-4b, h200-qwen3-8b, mi300x-qwen3-4b,
    mi300x-qwen3-8b, h20-qwen2.5-math-7b (CLUSTER_PRESETS), or any other GPUS x MODELS pairing; ``num_engines`` engines of ``tensor_parallel`` GPUs each. ``mixed_chunk``: engines run mixed
    chunked prefill with ``chunked_prefill_size`` tokens per iteration; ``mem_fraction_static``: SGLang's share of
    GPU memory for weights + KV (None: the GPU's default); abort latency and weight-sync time in seconds;
    ``colocated``: engines and trainer share the GPUs (see ClusterConfig.colocated)."""
    if not is_cluster_name(name):
        raise ConfigError(f"cluster preset {name!r} is not known: one of {sorted(CLUSTER_PRESETS)}, or "
                          f"<gpu>-<model> with a GPU of {sorted(GPUS)} and a model of {sorted(MODELS)}")
    gpu_name, _, model_name = name.partition("-")
    gpu, model = GPUS[gpu_name], MODELS[model_name]
    cost = derive_cost_model(gpu, model, mixed_chunk=mixed_chunk, chunked_prefill_size=chunked_prefill_size,
                             tensor_parallel=tensor_parallel, mem_fraction_static=mem_fraction_static)
    return ClusterConfig(cost=cost, num_engines=num_engines, name=name, abort_latency_s=abort_latency_s,
                         weight_sync_s=weight_sync_s, gpus_per_engine=tensor_parallel, colocated=colocated)


CLUSTER_PRESETS = (*(f"{g}-{m}" for g in ("h100", "h200", "mi300x") for m in ("qwen3-4b", "qwen3-8b")),
                   "h20-qwen2.5-math-7b")
"""The named presets: the APRIL paper's GPUs and models, and verl's asynchronous-RL setting (H20, Qwen2.5-Math-7B).
cluster_preset derives any other pairing of GPUS and MODELS as well."""

__all__ = ["CLUSTER_PRESETS", "ClusterConfig", "CostModel", "GPUS", "GpuSpec", "MODELS", "ModelSpec",
           "cluster_preset", "derive_cost_model"]
