"""SGLang's collective weight update, served for the embedded engine: the server joins the trainer's
process group (/init_weights_update_group), receives each update's tensors by broadcast from rank 0
(/update_weights_from_distributed) and leaves it (/destroy_weights_update_group). The updates of the current
release run inside a weight-update session (/begin_weight_update ... /end_weight_update), as SGLang's do.

Joining and receiving block on the other ranks, so they run in a worker thread: the server keeps answering
meanwhile. Both are bounded by ServerConfig.weight_group_timeout_s; a broadcast that fails (a peer died or
stalled) leaves the group unusable, so the server drops it and the trainer has to build a new one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import torch.distributed as dist
from aiohttp import web

from april_ext.protocol import sglang_wire
from april_ext.weights.group import broadcast_tensors, destroy_weight_group, join_weight_group, parse_dtype

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The server's body reader, and its weight update: (named tensors, label, abort_all, source) -> (ok, message).
ReadBody = Callable[[web.Request], Awaitable[Any]]
Update = Callable[[Any, Any, bool, str], Awaitable[tuple[bool, str]]]


def _answer(ok: bool, message: str) -> web.Response:
    return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)


class DistributedWeights:
    """The process groups this server has joined, by name, and the open weight-update session."""

    def __init__(self, read_body: ReadBody, update: Update, timeout_s: float) -> None:
        self._read_body = read_body
        self._update = update
        self.timeout_s = timeout_s
        self._groups: dict[str, tuple[dist.ProcessGroup, str]] = {}
        self._session = False
        # One broadcast at a time: two updates interleaving on one group would mix their tensors.
        self._lock = asyncio.Lock()

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [("POST", "/init_weights_update_group", self.init_group),
                ("POST", "/update_weights_from_distributed", self.update_weights),
                ("POST", "/destroy_weights_update_group", self.destroy_group),
                ("POST", "/begin_weight_update", self.begin),
                ("POST", "/end_weight_update", self.end)]

    async def init_group(self, request: web.Request) -> web.Response:
        req = sglang_wire.parse_init_weights_group(await self._read_body(request))
        if req.group_name in self._groups:
            return _answer(False, f"Failed to initialize custom process group: group {req.group_name!r} exists; "
                                  "destroy it first.")
        if req.backend == "nccl" and not torch.cuda.is_available():
            return _answer(False, "Failed to initialize custom process group: backend 'nccl' needs a GPU; this "
                                  "server runs on CPU: use backend 'gloo'.")
        try:
            group = await asyncio.to_thread(join_weight_group, req.master_address, req.master_port, req.rank_offset,
                                            req.world_size, req.group_name, req.backend, self.timeout_s)
        except (RuntimeError, ValueError, OSError) as exc:  # torch's store / gloo errors, refused connections
            return _answer(False, f"Failed to initialize custom process group: {exc}.")
        self._groups[req.group_name] = (group, "cuda" if req.backend == "nccl" else "cpu")
        return _answer(True, "Succeeded to initialize custom process group.")

    async def update_weights(self, request: web.Request) -> web.Response:
        req = sglang_wire.parse_weights_from_distributed(await self._read_body(request))
        if not self._session:
            return _answer(False, "update_weights_from_distributed must run between begin_weight_update() and "
                                  "end_weight_update()")
        if req.group_name not in self._groups:
            return _answer(False, f"Group {req.group_name} not in {sorted(self._groups)}. Please call "
                                  "`init_weights_update_group` first.")
        group, device = self._groups[req.group_name]
        tensors = [torch.empty(shape, dtype=parse_dtype(dtype), device=device)
                   for dtype, shape in zip(req.dtypes, req.shapes)]
        async with self._lock:
            try:
                await asyncio.to_thread(broadcast_tensors, group, tensors)
            except RuntimeError as exc:  # a peer died or stalled: the group cannot carry another broadcast
                self._drop(req.group_name)
                return _answer(False, f"Failed to receive weights: {exc} (group {req.group_name!r} destroyed)")
        named = dict(zip(req.names, tensors))
        return _answer(*await self._update(named, req.weight_version, req.abort_all_requests, "the broadcast"))

    async def destroy_group(self, request: web.Request) -> web.Response:
        name = sglang_wire.parse_destroy_weights_group(await self._read_body(request))
        if name not in self._groups:
            return _answer(False, "The group to be destroyed does not exist.")
        self._drop(name)
        return _answer(True, "Succeeded to destroy custom process group.")

    async def begin(self, request: web.Request) -> web.Response:
        sglang_wire.parse_weight_update_session(await self._read_body(request), "/begin_weight_update")
        if self._session:
            return _answer(False, "a weight-update session is already open; call end_weight_update() first")
        self._session = True
        return _answer(True, "Success")

    async def end(self, request: web.Request) -> web.Response:
        sglang_wire.parse_weight_update_session(await self._read_body(request), "/end_weight_update")
        if not self._session:
            return _answer(False, "no weight-update session is open; call begin_weight_update() first")
        self._session = False
        return _answer(True, "Success")

    def close(self) -> None:
        for name in list(self._groups):
            self._drop(name)

    def _drop(self, name: str) -> None:
        group, _ = self._groups.pop(name)
        try:
            destroy_weight_group(group)
        except (RuntimeError, ValueError) as exc:  # a broken group may fail to shut down; it is gone either way
            logger.warning("destroying weight group %r: %s", name, exc)


__all__ = ["DistributedWeights"]
