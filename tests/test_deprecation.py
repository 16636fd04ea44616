"""Old names that users passed still work, and warn with the name to use."""

from __future__ import annotations

import importlib

import pytest

from april_ext.server.app import EmbeddedServer


@pytest.mark.parametrize("module", ["april_ext.server", "april_ext.server.app"])
def test_engine_server_is_the_embedded_server_and_warns(module: str) -> None:
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.EngineServer is deprecated: it is now "
                                                rf"{module}\.EmbeddedServer"):
        old = mod.EngineServer
    assert old is EmbeddedServer


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    import april_ext.server as server

    with pytest.raises(AttributeError, match="has no attribute 'EngineServr'"):
        server.EngineServr  # noqa: B018
    with pytest.raises(ImportError):
        from april_ext.server.app import NotAServer  # noqa: F401
