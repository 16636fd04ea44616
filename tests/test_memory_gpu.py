"""The allocator on a CUDA / ROCm device. Each scenario runs in a spawned subprocess, so a driver
crash fails one test instead of the session. Skipped without a GPU and a usable GPU backend."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch


def _gpu_backend_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    import april_ext.memory as mem
    from april_ext.memory.devices import gpu_kind

    return any(b.name == gpu_kind() and b.usable for b in mem.backends())


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _gpu_backend_usable(), reason="needs a CUDA / ROCm device and its allocator backend"),
]


def run_scenario(body: str, env: dict[str, str] | None = None) -> str:
    script = "import torch\nimport april_ext.memory as mem\n" + textwrap.dedent(body) + "\nprint('ok')\n"
    full_env = {**os.environ, **(env or {})}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=full_env)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert out.stdout.strip().endswith("ok")
    return out.stdout


def test_pause_frees_device_memory_and_backup_restores_it():
    run_scenario(
        """
        n = 2 << 30
        t = mem.empty((n,), torch.uint8, tag="kv", device="cuda", cpu_backup=True)
        t.copy_(torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda"))
        want = t[:: 4096].clone().cpu()
        total = int(t.to(torch.int64).sum())
        ptr = t.data_ptr()
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info()
        mem.pause("kv")
        free_paused, _ = torch.cuda.mem_get_info()
        assert free_paused - free_before >= 0.95 * n, (free_before, free_paused)
        mem.resume("kv")
        assert t.data_ptr() == ptr
        assert torch.equal(t[:: 4096].cpu(), want)
        assert int(t.to(torch.int64).sum()) == total
        """
    )


def test_torch_allocations_in_a_region_pause_and_resume():
    run_scenario(
        """
        with mem.region("weights", cpu_backup=True):
            w = torch.randn(4096, 4096, device="cuda")
            b = torch.randn(4096, device="cuda")
        want_w, want_b = w.cpu(), b.cpu()
        s = mem.stats()["weights"]
        assert s.physical_bytes >= (4096 * 4096 + 4096) * 4, s
        free_before, _ = torch.cuda.mem_get_info()
        mem.pause("weights")
        free_paused, _ = torch.cuda.mem_get_info()
        assert free_paused - free_before >= 0.9 * 4096 * 4096 * 4
        mem.resume("weights")
        assert torch.equal(w.cpu(), want_w) and torch.equal(b.cpu(), want_b)
        """
    )


def test_graph_replays_after_pause_and_resume():
    run_scenario(
        """
        tag = "graph"
        with mem.region(tag, cpu_backup=True):
            x = torch.randn(1024, 1024, device="cuda")
            w = torch.randn(1024, 1024, device="cuda")
            y = torch.empty(1024, 1024, device="cuda")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.matmul(x, w, out=y)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with mem.capture_graph(g):
                torch.matmul(x, w, out=y)
                z = y.relu() * 2
            after = torch.ones(8, device="cuda")  # routing to the region's pool resumed
        assert mem.stats()[tag].allocations >= 1
        g.replay()
        want = z.clone()
        mem.pause(tag)
        mem.resume(tag)
        y.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(z, want)
        """
    )


def test_nested_regions_allocate_in_the_inner_tag_and_pausing_it_spares_the_outer():
    run_scenario(
        """
        with mem.region("outer"):
            a = torch.ones(1 << 20, device="cuda")  # leaves room in the outer pool's segment
            with mem.region("inner"):
                b = torch.full((1 << 20,), 2.0, device="cuda")
            c = torch.full((1 << 20,), 3.0, device="cuda")
        assert mem.stats()["inner"].allocations >= 1, mem.stats()
        mem.pause("inner")
        assert float(a.sum()) == 1 << 20 and float(c.sum()) == 3 * (1 << 20)
        mem.resume("inner")
        b.fill_(5.0)
        assert float(b.sum()) == 5 * (1 << 20)
        """
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two devices")
def test_calls_on_one_device_use_its_context_while_another_is_current():
    run_scenario(
        """
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda:0")  # device 0's context is current on this thread
        held = torch.empty(4 << 30, dtype=torch.uint8, device="cuda:1")
        ours, torch_free = mem.memory_info("cuda:1")[0], torch.cuda.mem_get_info(1)[0]
        assert abs(ours - torch_free) < (256 << 20), (ours, torch_free)
        assert mem.memory_info("cuda:0")[0] - ours > (3 << 30)
        t = mem.empty((64 << 20,), torch.uint8, tag="dev1", device="cuda:1", cpu_backup=True)
        t.fill_(7)
        mem.pause("dev1")  # the backup copy runs on device 1's stream, in device 1's context
        mem.resume("dev1")
        assert bool((t == 7).all())
        """
    )


def test_resume_without_backup_keeps_addresses():
    run_scenario(
        """
        t = mem.empty((64 << 20,), torch.float16, tag="scratch", device="cuda")
        ptr = t.data_ptr()
        mem.pause("scratch")
        assert mem.stats()["scratch"].resident_bytes == 0
        mem.resume("scratch")
        assert t.data_ptr() == ptr
        t.fill_(1.0)
        assert float(t.float().sum()) == float(64 << 20)
        """
    )


def test_expandable_segments_are_refused_on_region_entry():
    run_scenario(
        """
        from april_ext.errors import ConfigError
        try:
            with mem.region("x"):
                pass
        except ConfigError as exc:
            assert "expandable_segments" in str(exc)
        else:
            raise SystemExit("expandable_segments was accepted")
        """,
        env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    )
