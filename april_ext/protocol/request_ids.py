"""Request ids, checked and resolved the same way by every engine: fresh ids for requests that come
without one, the checks on given ones, and which requests an abort names."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Container, Iterable

from april_ext.errors import InvalidArgumentError, UnknownIdError


class RequestIds:
    """Hands out ``f"{prefix}-{n}"`` ids and checks the ids callers choose."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._count = itertools.count()

    def claim(self, request_id: str | None, live: Container[str]) -> str:
        """The id of a new request: a fresh one (not in ``live``) when request_id is None, else
        request_id itself. Raises InvalidArgumentError when it is not a non-empty str or is in ``live``."""
        if request_id is None:
            while True:
                fresh = f"{self.prefix}-{next(self._count)}"
                if fresh not in live:
                    return fresh
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError(f"request_id must be None or a non-empty string, got {request_id!r}")
        if request_id in live:
            raise InvalidArgumentError(f"request_id {request_id!r} is already in use")
        return request_id


def abort_ids(request_ids: str | Iterable[str] | None, live: Collection[str]) -> list[str]:
    """The ids an abort names, without repeats: every live id when request_ids is None, else the given
    ones (a str is one id). Raises UnknownIdError, before anything is aborted, when one of them is not live."""
    if request_ids is None:
        return list(live)
    ids = list(dict.fromkeys([request_ids] if isinstance(request_ids, str) else request_ids))
    unknown = [i for i in ids if i not in live]
    if unknown:
        raise UnknownIdError(f"abort: unknown or finished request ids {unknown[:8]}")
    return ids


__all__ = ["RequestIds", "abort_ids"]
