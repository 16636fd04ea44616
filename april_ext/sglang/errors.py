"""Errors of the SGLang adapter: every HTTP failure names the url, the status and the body (those classes live in
april_ext.protocol.sglang_errors, below the weight transports, and are the same here)."""

from __future__ import annotations

from april_ext.errors import AprilError
from april_ext.protocol.sglang_errors import SGLangBadRequestError, SGLangConnectionError, SGLangHTTPError


class SGLangLaunchError(AprilError, RuntimeError):
    """A launched server exited or did not become healthy in time; the message ends with its log tail."""


class SGLangNoWorkerError(AprilError, RuntimeError):
    """Failover removed every worker: the message names each one and why it was removed."""

    def __init__(self, removed: dict[str, str]) -> None:
        self.removed = dict(removed)
        reasons = "; ".join(f"{url}: {why}" for url, why in removed.items())
        super().__init__(f"no SGLang worker left to run requests, every one was removed ({reasons})")


__all__ = ["SGLangBadRequestError", "SGLangConnectionError", "SGLangHTTPError", "SGLangLaunchError",
           "SGLangNoWorkerError"]
