"""Bad values of the serving configs (ServerConfig, SGLangEngineConfig, SGLangServerArgs, SamplingParams) raise
the library's errors naming the field, never a TypeError or OverflowError from deeper down, and never pass
into a later hang (asyncio.sleep(nan)) or overflow (timedelta(seconds=inf))."""

from __future__ import annotations

from typing import Any

import pytest

from april_ext.errors import AprilError, ConfigError, InvalidArgumentError
from april_ext.protocol import SamplingParams
from april_ext.server import ServerConfig
from april_ext.sglang import SGLangEngineConfig, SGLangServerArgs

INF = float("inf")
NAN = float("nan")
NOT_NUMBERS = [None, "5", [1], {}, object()]
NOT_ITERABLE = [None, 3, 1.5, True, object()]


def _raises(error: type[AprilError], call: Any, name: str, value: Any, *, show_value: bool = True) -> None:
    with pytest.raises(error, match=rf"\.{name} must be") as info:
        call(**{name: value})
    if show_value:
        assert repr(value) in str(info.value)


@pytest.mark.parametrize("name, value", [
    *[("health_timeout_s", v) for v in (*NOT_NUMBERS, True, INF)],
    ("weight_group_timeout_s", INF),
    ("weight_group_timeout_s", True),
    ("sglang_compat", []),
    ("sglang_compat", {}),
])
def test_server_config_refuses(name: str, value: Any) -> None:
    _raises(ConfigError, ServerConfig, name, value)


def _engine_config(**kwargs: Any) -> SGLangEngineConfig:
    return SGLangEngineConfig(**{"worker_urls": ("http://127.0.0.1:1",), **kwargs})


@pytest.mark.parametrize("value", NOT_ITERABLE)
def test_engine_config_refuses_worker_urls(value: Any) -> None:
    _raises(ConfigError, SGLangEngineConfig, "worker_urls", value)


@pytest.mark.parametrize("name, value", [
    *[(name, v) for name in ("timeout_s", "connect_timeout_s", "abort_timeout_s", "abort_resend_s",
                             "weight_bucket_mb", "weight_sync_timeout_s") for v in (INF, True)],
    ("backoff_s", NAN),
    ("backoff_s", INF),
    ("backoff_s", True),
])
def test_engine_config_refuses(name: str, value: Any) -> None:
    _raises(ConfigError, _engine_config, name, value)


def _server_args(**kwargs: Any) -> SGLangServerArgs:
    return SGLangServerArgs(**{"model_path": "ckpt", **kwargs})


@pytest.mark.parametrize("name, value", [
    *[("mem_fraction_static", v) for v in ("0.5", [0.5], {}, object(), True)],
    *[("extra_args", v) for v in (None, 3, object(), "--flag")],
    *[("host", v) for v in (None, 3, "", ["127.0.0.1"], "--port")],
    ("port", True),
    ("tp", True),
    *[(name, v) for name in ("enable_memory_saver", "skip_tokenizer_init", "enable_weights_cpu_backup")
      for v in (None, 1, "yes")],
])
def test_server_args_refuse(name: str, value: Any) -> None:
    _raises(ConfigError, _server_args, name, value)


@pytest.mark.parametrize("value", ["", 3, "a key", "key\n", b"key", "--enable-memory-saver"])
def test_server_args_refuse_api_key_without_showing_it(value: Any) -> None:
    _raises(ConfigError, _server_args, "api_key", value, show_value=False)


@pytest.mark.parametrize("value", [None, 3, 2.5, object()])
def test_sampling_params_refuse_stop_token_ids(value: Any) -> None:
    _raises(InvalidArgumentError, SamplingParams, "stop_token_ids", value)


@pytest.mark.parametrize("field, value", [("enable_memory_saver", "no"), ("model_path", 3), ("tokenizer_path", "")])
def test_server_config_refuses_a_wrong_flag_or_path(field, value):
    with pytest.raises(ConfigError, match=rf"ServerConfig\.{field} must be"):
        ServerConfig(**{field: value})
