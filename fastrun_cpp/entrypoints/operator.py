"""GET /v1/server/status (an admin key, or a server open on loopback): the server at work, in
one answer, for the web page's operator view. Every account's use is in it, so it is an admin
path (entrypoints/middleware.py ADMIN_PATHS) like /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi import APIRouter, Request

router = APIRouter(prefix="/v1", include_in_schema=False)

USAGE_WINDOW_S = 24 * 3600


@router.get("/server/status")
async def server_status(request: Request) -> dict:
    state = request.app.state
    now = time.time()
    usage = await asyncio.to_thread(state.usage.by_account, int(now) - USAGE_WINDOW_S)
    return {
        "time": now,
        # Each model's state, slots, queue, memory, keep-alive and counters since start (the
        # page draws rates from the differences between two reads).
        "models": state.serving_models.status(),
        "batches": state.batches.progress(),
        "background_responses": state.serving_responses.background.progress(),
        "usage_window_s": USAGE_WINDOW_S,
        "usage": {account: dataclasses.asdict(used) for account, used in usage.items()},
    }
