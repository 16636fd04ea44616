"""The errors of talking to an SGLang server over HTTP: every one names the url, the status and the body.
Here, below the adapter, so that the weight transports (april_ext.weights) raise and catch the same classes;
april_ext.sglang exports them."""

from __future__ import annotations

from april_ext.errors import AprilError, InvalidArgumentError


class SGLangHTTPError(AprilError, RuntimeError):
    """An SGLang server (or router) answered an error, or could not be reached (status None).

    ``what`` replaces the default description ("answered HTTP <status>" / "could not be reached")."""

    def __init__(self, url: str, status: int | None, body: str, what: str | None = None) -> None:
        self.url = url
        self.status = status
        self.body = body
        if what is None:
            what = "could not be reached" if status is None else f"answered HTTP {status}"
        super().__init__(f"{url} {what}: {body[:2000]}")


class SGLangBadRequestError(SGLangHTTPError, InvalidArgumentError):
    """The server refused the request's content (HTTP 400, or an in-band error of a stream)."""


class SGLangConnectionError(SGLangHTTPError, ConnectionError):
    """No answer: connection refused or reset, or a timeout (after the retries of idempotent calls), or
    a stream that broke before its end (the server died or dropped the connection mid-response)."""


__all__ = ["SGLangBadRequestError", "SGLangConnectionError", "SGLangHTTPError"]
