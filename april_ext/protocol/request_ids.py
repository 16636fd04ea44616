"""Which requests an abort names, resolved the same way by every engine."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from april_ext.errors import UnknownIdError


def abort_ids(request_ids: str | Iterable[str] | None, live: Collection[str]) -> list[str]:
    """The ids an abort names: every live id when request_ids is None, else the given ones (a str is one
    id). Raises UnknownIdError, before anything is aborted, when one of them is not live."""
    if request_ids is None:
        return list(live)
    ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
    unknown = [i for i in ids if i not in live]
    if unknown:
        raise UnknownIdError(f"abort: unknown or finished request ids {unknown[:8]}")
    return ids


__all__ = ["abort_ids"]
