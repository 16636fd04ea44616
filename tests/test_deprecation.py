"""Old names that users passed still work, and warn with the name to use."""

from __future__ import annotations

import importlib

import pytest

from april_ext.server.app import EmbeddedServer
from april_ext.weights import StagedSource, WeightBroadcastError


@pytest.mark.parametrize("module, old, new, obj", [
    ("april_ext.server", "EngineServer", "april_ext.server.app.EmbeddedServer", EmbeddedServer),
    ("april_ext.server.app", "EngineServer", "april_ext.server.app.EmbeddedServer", EmbeddedServer),
    ("april_ext.sglang.broadcast", "WeightBroadcastError", "april_ext.weights.broadcast.WeightBroadcastError",
     WeightBroadcastError),
    ("april_ext.sglang.broadcast", "StagedSource", "april_ext.weights.sources.StagedSource", StagedSource),
])
def test_an_old_name_is_the_new_object_and_warns(module: str, old: str, new: str, obj: object) -> None:
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is deprecated: use {new}"):
        assert getattr(mod, old) is obj


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    import april_ext.server as server

    with pytest.raises(AttributeError, match="has no attribute 'EngineServr'"):
        server.EngineServr  # noqa: B018
    with pytest.raises(ImportError):
        from april_ext.server.app import NotAServer  # noqa: F401
