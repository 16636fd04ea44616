"""The pause/resume allocator on the CPU backend: RSS really drops, addresses survive, backups restore
bit-exactly, tags are independent and thread-local, and every failure is an exception that leaves
state consistent."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch

import april_ext.memory as mem
from april_ext import _C
from april_ext.errors import ConfigError
from april_ext.memory import torch_cuda
from april_ext.memory.devices import gpu_kind

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGESIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def new_tag(name: str) -> str:
    """Tags are process-wide: every test uses its own."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture
def capacity():
    """Sets a simulated CPU device size relative to what is committed now; removes it afterwards."""

    def set_free(free_bytes: int) -> None:
        mem.set_cpu_capacity(_C.memory.cpu_committed() + free_bytes)

    yield set_free
    mem.set_cpu_capacity(None)


def test_backends_reports_cpu_usable_and_every_backend_by_name():
    info = {b.name: b for b in mem.backends()}
    assert set(info) == {"cpu", "cuda", "hip"}
    assert info["cpu"].compiled and info["cpu"].usable and info["cpu"].reason == ""
    for name in ("cuda", "hip"):
        assert info[name].usable or info[name].reason


def test_pause_of_1gib_returns_its_pages_and_resume_keeps_the_address():
    tag = new_tag("big")
    t = mem.empty((1 << 30,), torch.uint8, tag=tag)
    t.fill_(1)
    ptr = t.data_ptr()
    before = rss_bytes()
    mem.pause(tag)
    after = rss_bytes()
    assert before - after >= 0.95 * (1 << 30)
    s = mem.stats()[tag]
    assert s.paused and s.resident_bytes == 0 and s.physical_bytes == 1 << 30
    mem.resume(tag)
    assert t.data_ptr() == ptr
    # Without a backup the contract on the CPU backend is fresh zero-filled pages.
    assert int(t[:: 1 << 20].sum()) == 0 and int(t[-1]) == 0
    del t
    assert mem.stats()[tag].allocations == 0


@pytest.mark.parametrize("numel", [1, 19, 989, 3 * MiB + 7])
def test_backup_restores_contents_bit_exactly(numel):
    tag = new_tag("backup")
    gen = torch.Generator().manual_seed(numel)
    t = mem.empty((numel,), torch.float32, tag=tag, cpu_backup=True)
    t.copy_(torch.randn(numel, generator=gen))
    want = digest(t)
    ptr = t.data_ptr()
    mem.pause(tag)
    s = mem.stats()[tag]
    assert s.backup_bytes == numel * 4 and s.last_pause_copied_bytes == numel * 4
    mem.resume(tag)
    assert t.data_ptr() == ptr
    assert digest(t) == want
    assert mem.stats()[tag].backup_bytes == 0


def run_isolated(body: str) -> None:
    """Runs a scenario that pauses every tag of the process in a fresh interpreter, so it cannot
    touch tensors other tests of the session keep alive."""
    script = "import torch\nimport april_ext.memory as mem\n" + body + "\nprint('ok')\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_tags_pause_and_resume_independently():
    a, b = new_tag("a"), new_tag("b")
    ta = mem.empty((1000,), torch.int64, tag=a, cpu_backup=True)
    tb = mem.empty((3, 5), torch.bfloat16, tag=b, cpu_backup=True)
    ta.copy_(torch.arange(1000))
    tb.fill_(2.5)
    mem.pause(a)
    assert mem.stats()[a].paused and not mem.stats()[b].paused
    tb.add_(1)  # b stays usable while a is paused
    mem.pause(b)
    mem.resume(a)
    assert torch.equal(ta, torch.arange(1000))
    mem.resume(b)
    assert bool((tb == 3.5).all())


def test_pause_and_resume_of_every_tag_are_idempotent():
    run_isolated(
        """
ta = mem.empty((1000,), torch.int64, tag="a", cpu_backup=True)
tb = mem.empty((3, 5), torch.bfloat16, tag="b", cpu_backup=True)
ta.copy_(torch.arange(1000))
tb.fill_(2.5)
mem.pause("a")
mem.pause()  # pauses b, skips a (already paused)
assert mem.stats()["a"].paused and mem.stats()["b"].paused
assert mem.stats()["a"].pauses == 1 and mem.stats()["b"].pauses == 1
mem.pause()  # nothing left to pause: a no-op, not an error
mem.resume("b")
mem.resume()  # resumes a, skips b (already active)
mem.resume()
assert mem.stats()["a"].resumes == 1 and mem.stats()["b"].resumes == 1
assert torch.equal(ta, torch.arange(1000)) and bool((tb == 2.5).all())
"""
    )


def test_state_errors():
    tag = new_tag("state")
    t = mem.empty((10,), torch.float32, tag=tag)
    with pytest.raises(mem.InvalidStateError, match="not paused"):
        mem.resume(tag)
    mem.pause(tag)
    with pytest.raises(mem.InvalidStateError, match="already paused"):
        mem.pause(tag)
    with pytest.raises(mem.InvalidStateError, match="resume it before allocating"):
        mem.empty((4,), torch.float32, tag=tag)
    mem.resume(tag)
    assert mem.stats()[tag].pauses == 1 and mem.stats()[tag].resumes == 1
    with pytest.raises(mem.UnknownIdError, match="unknown tag"):
        mem.pause(new_tag("never-used"))
    with pytest.raises(mem.UnknownIdError):
        _C.memory.free(0x1000)
    del t


def test_free_while_paused_releases_the_allocation_and_its_backup():
    tag = new_tag("free-paused")
    t = mem.empty((MiB,), torch.uint8, tag=tag, cpu_backup=True)
    t.fill_(7)
    mem.pause(tag)
    assert mem.stats()[tag].backup_bytes == MiB
    del t
    s = mem.stats()[tag]
    assert s.allocations == 0 and s.backup_bytes == 0
    mem.resume(tag)
    assert not mem.stats()[tag].paused


def test_backup_cache_reuses_host_buffers_up_to_its_limit():
    tag = new_tag("cache")
    t = mem.empty((3 * MiB,), torch.uint8, tag=tag, cpu_backup=True)
    t.fill_(4)
    try:
        mem.set_backup_cache_limit(4 * MiB)
        mem.pause(tag)
        mem.resume(tag)
        assert mem.backup_cache() == (4 * MiB, 3 * MiB)  # the backup buffer was kept
        t.fill_(6)
        mem.pause(tag)
        assert mem.backup_cache()[1] == 0  # and taken again by the next pause
        mem.resume(tag)
        assert bool((t == 6).all())
        mem.set_backup_cache_limit(2 * MiB)  # lowering the limit frees what no longer fits
        assert mem.backup_cache() == (2 * MiB, 0)
    finally:
        mem.set_backup_cache_limit(0)
    with pytest.raises(mem.InvalidArgumentError, match="nbytes"):
        mem.set_backup_cache_limit(-1)


def test_nested_regions_supply_the_innermost_tag():
    outer, inner = new_tag("outer"), new_tag("inner")
    assert mem.current_region() is None
    with mem.region(outer):
        a = mem.to_region(torch.ones(4))
        with mem.region(inner, cpu_backup=True):
            assert mem.current_region() == (inner, True)
            b = mem.to_region(torch.ones(4))
        assert mem.current_region() == (outer, False)
        c = mem.empty((2,), torch.float32, tag=inner)
    assert mem.current_region() is None
    assert mem.allocation_info(a)["tag"] == outer
    assert mem.allocation_info(b)["tag"] == inner and mem.allocation_info(b)["cpu_backup"]
    assert mem.allocation_info(c)["tag"] == inner and not mem.allocation_info(c)["cpu_backup"]


def test_region_tags_stay_on_their_thread():
    n = 4
    barrier = threading.Barrier(n)
    results: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    tags = [new_tag(f"thread{i}") for i in range(n)]

    def work(i: int) -> None:
        try:
            with mem.region(tags[i]):
                barrier.wait()  # every thread is inside its region at once
                seen = []
                for _ in range(20):
                    t = mem.to_region(torch.full((64,), float(i)))
                    seen.append(mem.allocation_info(t)["tag"])
                    assert bool((t == i).all())
                results[i] = seen
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for i in range(n):
        assert results[i] == [tags[i]] * 20
    assert mem.current_region() is None


def test_out_of_memory_on_resume_keeps_the_tag_paused_and_can_be_retried(capacity):
    a, b = new_tag("oom-a"), new_tag("oom-b")
    capacity(8 * MiB)
    ta = mem.empty((4 * MiB,), torch.uint8, tag=a, cpu_backup=True)
    ta.copy_(torch.arange(4 * MiB) % 251)
    want = digest(ta)
    mem.pause(a)
    tb = mem.empty((6 * MiB,), torch.uint8, tag=b)  # takes the room a gave back
    with pytest.raises(mem.OutOfMemoryError, match="stays paused"):
        mem.resume(a)
    s = mem.stats()[a]
    assert s.paused and s.resident_bytes == 0 and s.backup_bytes == 4 * MiB
    with pytest.raises(mem.OutOfMemoryError):
        mem.resume(a)
    del tb
    mem.resume(a)
    assert digest(ta) == want


def test_out_of_memory_on_allocate_is_an_exception(capacity):
    capacity(2 * MiB)
    with pytest.raises(mem.OutOfMemoryError, match="capacity"):
        mem.empty((3 * MiB,), torch.uint8, tag=new_tag("too-big"))
    t = mem.empty((MiB,), torch.uint8, tag=new_tag("fits"))
    assert t.numel() == MiB


def test_memory_info_reports_the_simulated_capacity(capacity):
    capacity(5 * MiB)
    free, total = mem.memory_info("cpu")
    assert free == 5 * MiB and total == mem.cpu_capacity()


@pytest.mark.skipif(
    not any(b.name == gpu_kind() and b.compiled and not b.usable for b in mem.backends()),
    reason="needs a GPU backend that is compiled in but cannot be used here",
)
def test_an_unusable_gpu_backend_is_a_driver_error_with_its_reason():
    reason = next(b.reason for b in mem.backends() if b.name == gpu_kind())
    with pytest.raises(mem.DriverError) as info:
        mem.empty((4,), torch.float32, tag=new_tag("gpu"), device="cuda:0")
    assert reason and reason in str(info.value)


def test_sizes_are_rounded_to_the_granularity():
    t = mem.empty((3,), torch.uint8, tag=new_tag("round"))
    info = mem.allocation_info(t)
    assert info["logical_bytes"] == 3
    assert info["physical_bytes"] == mem.granularity("cpu") == PAGE


def test_empty_tensor_has_no_allocation():
    t = mem.empty((0, 4), torch.float32, tag=new_tag("zero"))
    assert t.shape == (0, 4)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: mem.empty((-1,), torch.float32, tag="x"), "dimensions must be >= 0"),
        (lambda: mem.empty((2.5,), torch.float32, tag="x"), "sequence of ints"),
        (lambda: mem.empty(None, torch.float32, tag="x"), "sequence of ints"),
        (lambda: mem.empty((2, True), torch.float32, tag="x"), "sequence of ints"),
        (lambda: mem.empty((4, -2**70), torch.float32, tag="x"), "dimensions must be >= 0"),
        (lambda: mem.empty((2,), "float32", tag="x"), "torch.dtype"),
        (lambda: mem.empty((2,), torch.float32, tag=""), "non-empty string"),
        (lambda: mem.empty((2,), torch.float32, tag="x", device="meta"), "'cpu', 'cuda'"),
        (lambda: mem.to_region(torch.ones(2)), "only allowed inside"),
        (lambda: mem.set_cpu_capacity(-5), "positive int"),
        (lambda: mem.pause(""), "non-empty string"),
    ],
)
def test_invalid_arguments_name_the_argument(call, message):
    with pytest.raises(mem.InvalidArgumentError, match=message):
        call()


def test_region_rejects_a_non_bool_backup_flag():
    with pytest.raises(mem.InvalidArgumentError, match="cpu_backup"):
        with mem.region("x", cpu_backup="yes"):
            pass


def test_module_and_optimizer_state_survive_pause_with_backup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(8, 16)
    model(x).square().mean().backward()
    opt.step()
    weights, states = new_tag("weights"), new_tag("optim")
    params_before = [id(p) for p in model.parameters()]
    moved = mem.move_module_to_region(model, weights, cpu_backup=True)
    assert moved == sum(p.numel() * 4 for p in model.parameters())
    assert mem.move_optimizer_to_region(opt, states, cpu_backup=True) > 0
    assert mem.stats()[weights].allocations == 1  # packed into one allocation
    want = model(x).detach().clone()
    mem.pause(weights)
    mem.pause(states)
    assert mem.stats()[weights].resident_bytes == 0
    mem.resume(states)
    mem.resume(weights)
    assert [id(p) for p in model.parameters()] == params_before
    assert torch.equal(model(x), want)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    assert not torch.equal(model(x), want)


def test_to_region_copies_contents_and_keeps_dtype_and_shape():
    src = torch.arange(24, dtype=torch.int16).reshape(2, 3, 4).transpose(0, 2)
    t = mem.to_region(src, new_tag("copy"))
    assert t.dtype == src.dtype and t.shape == src.shape and t.is_contiguous()
    assert torch.equal(t, src)


def test_expandable_segments_are_refused(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    with pytest.raises(ConfigError, match="expandable_segments"):
        torch_cuda.check_alloc_conf()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    torch_cuda.check_alloc_conf()


def test_torch_hook_symbols_allocate_in_the_current_region():
    """The C symbols torch's pluggable allocator calls, driven here on the CPU backend."""
    lib = ctypes.CDLL(_C.__file__)
    malloc_name, free_name = _C.memory.torch_symbols()
    malloc = getattr(lib, malloc_name)
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free = getattr(lib, free_name)
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    tag = new_tag("hook")
    _C.memory.set_hook_device_kind("cpu")
    try:
        assert malloc(4096, 0, None) is None  # outside a region: refused, with a reason
        assert "outside a region" in _C.memory.take_hook_error()
        with mem.region(tag, cpu_backup=True):
            ptr = malloc(10000, 0, None)
        assert ptr is not None
        ctypes.memset(ptr, 9, 10000)
        info = _C.memory.info(ptr)
        assert info["tag"] == tag and info["cpu_backup"] and info["logical_bytes"] == 10000
        mem.pause(tag)
        mem.resume(tag)
        assert ctypes.string_at(ptr, 10000) == b"\x09" * 10000
        free(ptr, 10000, 0, None)
        assert mem.stats()[tag].allocations == 0
    finally:
        _C.memory.set_hook_device_kind(gpu_kind())


def test_host_out_of_memory_on_pause_leaves_the_tag_active():
    """A real OS limit (RLIMIT_AS in a subprocess) makes the backup buffer fail: pause raises and
    nothing of the tag is paused."""
    script = r"""
import resource, torch
import april_ext.memory as mem
t = mem.empty((64 << 20,), torch.uint8, tag="big", cpu_backup=True)
t.fill_(5)
with open("/proc/self/statm") as f:
    vm = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), resource.RLIM_INFINITY))
try:
    mem.pause("big")
except mem.OutOfMemoryError as exc:
    assert "stays active" in str(exc), exc
else:
    raise SystemExit("pause did not fail")
s = mem.stats()["big"]
assert not s.paused and s.resident_bytes == 64 << 20 and s.backup_bytes == 0, s
assert int(t[::4096].sum()) == 5 * (64 << 20) // 4096
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize(
    ("shape", "dtype", "nbytes"),
    [
        ((2**40, 2**40), torch.float32, 2**82),  # the product overflows 64 bits
        ((2**62,), torch.float32, 2**64),
        ((2**63,), torch.uint8, 2**63),  # fits size_t, but no torch tensor can address it
    ],
)
def test_a_size_no_device_can_hold_is_an_invalid_argument(shape, dtype, nbytes):
    with pytest.raises(mem.InvalidArgumentError) as info:
        mem.empty(shape, dtype, tag=new_tag("huge"))
    assert f"is {nbytes} bytes" in str(info.value)
    assert f"largest tensor of {2**63 - 1} bytes" in str(info.value)


def test_a_representable_size_the_device_cannot_hold_is_out_of_memory():
    # 4 EiB: more than any 48- or 57-bit address space can reserve.
    with pytest.raises(mem.OutOfMemoryError):
        mem.empty((2**62,), torch.uint8, tag=new_tag("huge"))


def test_the_core_rejects_a_size_its_rounding_would_wrap():
    with pytest.raises(mem.InvalidArgumentError, match="largest allocation"):
        _C.memory.allocate(2**64 - 1, "cpu", 0, new_tag("wrap"), False)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: mem.set_cpu_capacity(2**64), "2\\*\\*64 - 1"),
        (lambda: mem.set_cpu_capacity(1.5), "positive int"),
        (lambda: mem.set_backup_cache_limit(2**64), "2\\*\\*64 - 1"),
        (lambda: mem.set_backup_cache_limit("1"), "nbytes"),
    ],
)
def test_byte_counts_beyond_size_t_are_invalid_arguments(call, message):
    with pytest.raises(mem.InvalidArgumentError, match=message):
        call()
    assert mem.cpu_capacity() is None and mem.backup_cache()[0] == 0


def test_documented_allocation_info_keys_are_the_returned_keys():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "memory.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `allocation_info("))
    description = row.split("|")[2]
    documented = set(re.findall(r"`(\w+)`", description))
    info = mem.allocation_info(mem.empty((3,), torch.uint8, tag=new_tag("info")))
    assert documented == set(info)


def test_free_and_pause_synchronize_the_device_before_unmapping():
    """A kernel still queued on memory must finish before the memory is unmapped: a free of a live
    allocation (a tensor deleter, torch's free hook) and a pause synchronize the device first; a free
    of a paused allocation has nothing mapped and does not."""
    calls = _C.memory.cpu_synchronize_calls
    tag = new_tag("sync")
    a = mem.empty((MiB,), torch.uint8, tag=tag)
    b = mem.empty((MiB,), torch.uint8, tag=tag)
    before = calls()
    del a
    assert calls() == before + 1
    mem.pause(tag)  # one device: one synchronize, however many allocations
    assert calls() == before + 2
    del b
    assert calls() == before + 2
    mem.resume(tag)

    lib = ctypes.CDLL(_C.__file__)
    malloc_name, free_name = _C.memory.torch_symbols()
    malloc = getattr(lib, malloc_name)
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free = getattr(lib, free_name)
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    _C.memory.set_hook_device_kind("cpu")
    try:
        with mem.region(tag):
            ptr = malloc(4096, 0, None)
        before = calls()
        free(ptr, 4096, 0, None)
        assert calls() == before + 1
    finally:
        _C.memory.set_hook_device_kind(gpu_kind())


_HOOKS = """
import ctypes
from april_ext import _C
lib = ctypes.CDLL(_C.__file__)
malloc_name, free_name = _C.memory.torch_symbols()
malloc = getattr(lib, malloc_name)
malloc.restype = ctypes.c_void_p
malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
free = getattr(lib, free_name)
free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
_C.memory.set_hook_device_kind("cpu")
"""


@pytest.mark.parametrize("foreign", [False, True], ids=["april-error", "std-exception"])
def test_no_exception_escapes_the_torch_free_hook(foreign):
    """torch calls the free hook from C++ through an extern "C" function: any exception in it (a
    driver error, or one that is not april_ext's) becomes the hook error instead of escaping into
    torch, which would terminate the process."""
    run_isolated(_HOOKS + f"""
with mem.region("hooked"):
    ptr = malloc(8192, 0, None)
_C.memory.cpu_inject_faults("unmap", 1, {foreign})
free(ptr, 8192, 0, None)
assert "injected failure of unmapping" in _C.memory.take_hook_error()
assert _C.memory.take_hook_error() == ""
""")


def test_no_exception_escapes_the_dlpack_deleter():
    """The deleter of a tensor's DLPack capsule runs inside torch when the tensor dies."""
    run_isolated("""
from april_ext import _C
t = mem.empty((8192,), torch.uint8, tag="deleted")
_C.memory.cpu_inject_faults("unmap", 1, True)
del t
assert mem.stats()["deleted"].allocations == 0
""")


def test_a_range_a_pause_could_not_reserve_again_is_reserved_by_resume():
    """ROCm returns memory only when its range is freed, so pause frees the range and reserves the
    same address again (simulated here on the CPU backend). When that fails, the allocation is paused
    without a range: resume must reserve the address again before it maps memory there, and while it
    cannot, fail and leave the tag paused."""
    tag = new_tag("rocm-va")
    t = mem.empty((3 * MiB + 5,), torch.uint8, tag=tag, cpu_backup=True)
    t.copy_(torch.arange(3 * MiB + 5, dtype=torch.int64).remainder(251).to(torch.uint8))
    want, ptr = digest(t), t.data_ptr()
    _C.memory.cpu_set_pause_frees_va(True)
    try:
        mem.pause(tag)  # the simulation itself works: a pause that frees and re-reserves the range
        mem.resume(tag)
        assert digest(t) == want and t.data_ptr() == ptr
        _C.memory.cpu_inject_faults("reserve_at", 1, False)
        with pytest.raises(mem.DriverError, match="could not be reserved again"):
            mem.pause(tag)
        assert mem.stats()[tag].paused and mem.stats()[tag].resident_bytes == 0
        _C.memory.cpu_inject_faults("reserve_at", 1, False)
        with pytest.raises(mem.DriverError, match="resume of tag .* stays paused"):
            mem.resume(tag)
        s = mem.stats()[tag]
        assert s.paused and s.resident_bytes == 0 and s.backup_bytes > 0
        mem.resume(tag)
        assert digest(t) == want and t.data_ptr() == ptr
    finally:
        _C.memory.cpu_inject_faults("reserve_at", 0, False)
        _C.memory.cpu_set_pause_frees_va(False)
    with pytest.raises(mem.InvalidArgumentError, match="'reserve_at' or 'unmap'"):
        _C.memory.cpu_inject_faults("map", 1, False)


class TorchPoolModel:
    """The pool bookkeeping of torch's CUDA caching allocator that region routing relies on, as
    c10/cuda/CUDACachingAllocator.cpp has it (torch on a GPU is not available here): begin appends a
    (pool, filter) entry and takes a use count, refusing a pool already begun ("already recording to
    mempool_id"); end removes the entry and keeps the count; release gives a count back; an
    allocation is served by the first entry whose filter matches (get_pool). The MemPool object holds
    one count of its own."""

    def __init__(self, *pools: tuple[int, int]) -> None:
        self.use_count = dict.fromkeys(pools, 1)
        self.underway: list[tuple[tuple[int, int], str]] = []

    def begin_thread(self, device: int, pool: tuple[int, int]) -> None:
        self._begin(pool, "thread")

    def begin_capture(self, pool: tuple[int, int]) -> None:
        self._begin(pool, "capture")

    def _begin(self, pool: tuple[int, int], kind: str) -> None:
        self.use_count[pool] += 1
        if any(p == pool for p, _ in self.underway):
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.underway.append((pool, kind))

    def end(self, device: int, pool: tuple[int, int]) -> None:
        for i, (p, _) in enumerate(self.underway):
            if p == pool:
                del self.underway[i]
                return
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    def release(self, device: int, pool: tuple[int, int]) -> None:
        self.use_count[pool] -= 1
        assert self.use_count[pool] >= 1, "released the MemPool's own count: torch would free the pool"

    def serving(self, *kinds: str) -> tuple[int, int] | None:
        """The pool an allocation matching these filters comes from (None: torch's default pool)."""
        return next((p for p, k in self.underway if k in kinds), None)


OUTER, INNER = (0, 1), (0, 2)


def test_nested_regions_route_torch_allocations_to_the_innermost_pool():
    torch_model = TorchPoolModel(OUTER, INNER)
    routing = torch_cuda.PoolRouting(torch_model.begin_thread, torch_model.end, torch_model.release)
    with routing.route(0, OUTER):
        assert torch_model.serving("thread") == OUTER
        with routing.route(0, INNER):
            # Both begun, torch would serve the outer pool while the hook tags the inner region.
            assert torch_model.serving("thread") == INNER
            assert routing.routed() == [(0, INNER)]
        assert torch_model.serving("thread") == OUTER
    assert torch_model.underway == [] and torch_model.use_count == {OUTER: 1, INNER: 1}


def test_a_failed_route_routes_the_enclosing_pool_again():
    torch_model = TorchPoolModel(OUTER)  # INNER unknown to torch: its begin fails
    routing = torch_cuda.PoolRouting(torch_model.begin_thread, torch_model.end, torch_model.release)
    with routing.route(0, OUTER):
        with pytest.raises(KeyError):
            with routing.route(0, INNER):
                pass
        assert torch_model.serving("thread") == OUTER and routing.routed() == [(0, OUTER)]
    assert torch_model.underway == [] and torch_model.use_count == {OUTER: 1}


def test_a_graph_captures_into_the_region_pool_while_its_routing_is_suspended():
    refused = TorchPoolModel(OUTER)
    refused.begin_thread(0, OUTER)
    with pytest.raises(RuntimeError, match="already recording"):
        refused.begin_capture(OUTER)  # torch.cuda.graph(pool=...) inside a plain use_mem_pool

    torch_model = TorchPoolModel(OUTER)
    routing = torch_cuda.PoolRouting(torch_model.begin_thread, torch_model.end, torch_model.release)
    with routing.route(0, OUTER):
        with routing.suspended() as (device, pool):
            assert (device, pool) == (0, OUTER) and routing.routed() == []
            torch_model.begin_capture(pool)  # capture_begin(pool)
            assert torch_model.serving("capture", "thread") == OUTER
            torch_model.end(0, pool)  # capture_end; the graph keeps its count until it is reset
        assert torch_model.serving("thread") == OUTER and routing.routed() == [(0, OUTER)]
    assert torch_model.underway == [] and torch_model.use_count == {OUTER: 2}  # MemPool + graph
    with pytest.raises(mem.InvalidStateError, match="no region pool is routed"):
        with routing.suspended():
            pass


def test_capture_graph_needs_a_region_and_a_gpu_backend():
    with pytest.raises(mem.InvalidStateError, match="only allowed inside"):
        with mem.capture_graph(None):
            pass
    if torch_cuda.active():
        return
    with mem.region(new_tag("graph")):
        with pytest.raises(mem.InvalidStateError, match="CUDA / ROCm device"):
            with mem.capture_graph(None):
                pass
