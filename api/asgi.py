"""Small ASGI helpers shared by memfit's middleware (and by the CLI's wrapper, through api.app)."""

from __future__ import annotations

from typing import Any


async def answered_status(app: Any, scope: dict, receive: Any, send: Any) -> int:
    """Run the ASGI ``app`` on one HTTP request and return the status it answered (500 when it
    answered none, e.g. it raised before starting the response)."""
    status = 500

    async def send_noting_status(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        await send(message)

    await app(scope, receive, send_noting_status)
    return status
