"""Random interleavings of allocate / write / free / pause / resume over a few tags, checked against
a plain Python model of the allocator's contract, plus threads racing on the allocator."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import april_ext.memory as mem

PAGE = mem.granularity("cpu")


class AllocatorModel(RuleBasedStateMachine):
    """The model: per tag a paused flag (None = never used); per live tensor its tag, backup flag and
    the byte every element must hold when its tag is active (0 after a resume without backup)."""

    def __init__(self) -> None:
        super().__init__()
        run = uuid.uuid4().hex[:8]
        self.tags = [f"sm-{run}-{i}" for i in range(3)]
        self.paused: dict[str, bool | None] = {t: None for t in self.tags}
        self.live: list[dict] = []

    def _active(self, tag: str) -> bool:
        return self.paused[tag] is False

    @rule(tag_index=st.integers(0, 2), nbytes=st.integers(1, 3 * PAGE), backup=st.booleans(),
          value=st.integers(0, 255))
    def allocate(self, tag_index, nbytes, backup, value):
        tag = self.tags[tag_index]
        if self.paused[tag]:
            with pytest.raises(mem.InvalidStateError):
                mem.empty((nbytes,), torch.uint8, tag=tag, cpu_backup=backup)
            return
        t = mem.empty((nbytes,), torch.uint8, tag=tag, cpu_backup=backup)
        t.fill_(value)
        self.paused[tag] = False
        self.live.append({"t": t, "tag": tag, "backup": backup, "value": value, "ptr": t.data_ptr()})

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000))
    def free(self, index):
        self.live.pop(index % len(self.live))

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000), value=st.integers(0, 255))
    def write(self, index, value):
        entry = self.live[index % len(self.live)]
        if self._active(entry["tag"]):
            entry["t"].fill_(value)
            entry["value"] = value

    @rule(tag_index=st.integers(0, 2))
    def pause(self, tag_index):
        tag = self.tags[tag_index]
        if self.paused[tag] is None:
            with pytest.raises(mem.UnknownIdError):
                mem.pause(tag)
        elif self.paused[tag]:
            with pytest.raises(mem.InvalidStateError):
                mem.pause(tag)
        else:
            mem.pause(tag)
            self.paused[tag] = True

    @rule(tag_index=st.integers(0, 2))
    def resume(self, tag_index):
        tag = self.tags[tag_index]
        if self.paused[tag] is None:
            with pytest.raises(mem.UnknownIdError):
                mem.resume(tag)
        elif not self.paused[tag]:
            with pytest.raises(mem.InvalidStateError):
                mem.resume(tag)
        else:
            mem.resume(tag)
            self.paused[tag] = False
            for entry in self.live:
                if entry["tag"] == tag and not entry["backup"]:
                    entry["value"] = 0

    @invariant()
    def stats_and_contents_match_the_model(self):
        stats = mem.stats()
        for tag in self.tags:
            if self.paused[tag] is None:
                assert tag not in stats
                continue
            entries = [e for e in self.live if e["tag"] == tag]
            s = stats[tag]
            assert s.paused == self.paused[tag]
            assert s.allocations == len(entries)
            assert s.logical_bytes == sum(e["t"].numel() for e in entries)
            assert s.physical_bytes == sum(-(-e["t"].numel() // PAGE) * PAGE for e in entries)
            assert s.resident_bytes == (0 if s.paused else s.physical_bytes)
            want_backup = sum(e["t"].numel() for e in entries if e["backup"]) if s.paused else 0
            assert s.backup_bytes == want_backup
        for e in self.live:
            assert e["t"].data_ptr() == e["ptr"]
            if self._active(e["tag"]):
                assert bool((e["t"] == e["value"]).all())

    def teardown(self):
        self.live.clear()
        for tag in self.tags:
            if self.paused[tag]:
                mem.resume(tag)


TestAllocatorModel = AllocatorModel.TestCase
TestAllocatorModel.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


def test_threads_allocate_pause_and_resume_their_own_tags_concurrently():
    n, rounds = 4, 30
    errors: list[BaseException] = []
    tags = [f"race-{uuid.uuid4().hex[:8]}" for _ in range(n)]
    barrier = threading.Barrier(n)

    def work(i: int) -> None:
        try:
            barrier.wait()
            keep = mem.empty((5 * PAGE + i,), torch.int32, tag=tags[i], cpu_backup=True)
            keep.fill_(i)
            for r in range(rounds):
                scratch = mem.empty((PAGE,), torch.uint8, tag=tags[i])
                scratch.fill_(r % 256)
                mem.pause(tags[i])
                mem.resume(tags[i])
                assert bool((keep == i).all())
                assert int(scratch.sum()) == 0
                del scratch
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for tag in tags:
        s = mem.stats()[tag]
        # Every tensor died with its thread, so every allocation was freed.
        assert s.pauses == rounds and s.resumes == rounds and s.allocations == 0
