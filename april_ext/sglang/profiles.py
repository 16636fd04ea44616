"""ServerProfile: what one SGLang server serves, probed once, so the adapter speaks each release's API.

SGLang's HTTP API moved between releases (april_ext.protocol.sglang_wire.DIALECTS): /get_server_info became
/server_info, /get_model_info became /model_info, /get_weight_version was removed (the label is in
/model_info and in every /generate answer's meta_info), /pause_generation gained modes and the weight
updates gained fields. The probe reads the info endpoints that answer (trying the newer name first) and
the server's version; the fields and modes of a release come from the dialect of that version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from april_ext.protocol.sglang_wire import SGLangDialect, dialect_for
from april_ext.sglang.client import HTTPClient
from april_ext.sglang.errors import SGLangHTTPError

_SERVER_INFO = ("/server_info", "/get_server_info")
_MODEL_INFO = ("/model_info", "/get_model_info")


@dataclass(frozen=True)
class ServerProfile:
    """url; version: the release the server reports (None if it reports none); dialect: the release line
    the adapter speaks to it; server_info_path; weight_version_path: where the label of its current
    weights is read (None: the release labels no weights, as 0.4.x)."""

    url: str
    version: str | None
    dialect: SGLangDialect
    server_info_path: str
    weight_version_path: str | None

    def fields(self, endpoint: str, payload: dict[str, Any]) -> dict[str, Any]:
        """The payload without the fields this server's release does not define (a weight update's
        weight_version on 0.4.x, flush_cache before it was added, ...)."""
        known = {"/update_weights_from_disk": self.dialect.disk_fields,
                 "/update_weights_from_tensor": self.dialect.tensor_fields}.get(endpoint)
        return payload if known is None else {k: v for k, v in payload.items() if k in known}


async def probe(http: HTTPClient, url: str) -> ServerProfile:
    """GETs the server's info (and its model info, and /get_weight_version where the model info has no
    label) and returns its profile. A server that answers none of the info endpoints raises."""
    info, info_path = await _first(http, url, _SERVER_INFO)
    if info_path is None:
        raise SGLangHTTPError(f"{url}{_SERVER_INFO[0]}", 404, f"the server answers none of {list(_SERVER_INFO)}: "
                              "is it an SGLang server?")
    version = info.get("version") if isinstance(info, dict) else None
    version = str(version) if version is not None else None
    model, model_path = await _first(http, url, _MODEL_INFO)
    label_path = model_path if isinstance(model, dict) and "weight_version" in model else None
    if label_path is None:
        _, label_path = await _first(http, url, ("/get_weight_version",))
    return ServerProfile(url, version, dialect_for(version), info_path, label_path)


async def _first(http: HTTPClient, url: str, paths: tuple[str, ...]) -> tuple[Any, str | None]:
    """The answer of the first path that is served (404: the release does not have it), and that path."""
    for path in paths:
        try:
            return await http.call("GET", f"{url}{path}", idempotent=True), path
        except SGLangHTTPError as exc:
            if exc.status != 404:
                raise
    return None, None


__all__ = ["ServerProfile", "probe"]
