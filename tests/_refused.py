"""`april-ext train` refusing a run before it starts: the error the train command raises, with torchrun's
launcher, the run and the model's constructor replaced by failures (so a refusal that comes too late, or
not at all, fails the test)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.run

from april_ext import cli
from april_ext.errors import AprilError
from april_ext.model import LlamaForCausalLM
from april_ext.training import run as run_module


def forbidden(what: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} before the refusal")
    return fail


def refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *flags: str) -> AprilError:
    """The error `april-ext train FLAGS` raises through the train command, which must neither launch torchrun,
    nor start the run, nor build a model."""
    monkeypatch.setattr(torch.distributed.run, "run", forbidden("torchrun launched ranks"))
    monkeypatch.setattr(run_module, "train", forbidden("the run started"))
    monkeypatch.setattr(LlamaForCausalLM, "__init__", forbidden("a model was built"))
    argv = ["train", *flags, "--output-dir", str(tmp_path / "run")]
    args = cli.build_parser().parse_args(argv)
    args.argv = argv
    with pytest.raises(AprilError) as caught:
        args.func(args)
    return caught.value
