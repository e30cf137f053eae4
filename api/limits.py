"""Request limits (OWASP API4, resource consumption), as ASGI middleware in front of every route.

- :class:`HeaderLimit`: more than ``max_header_count`` headers, or more than ``max_header_bytes`` of
  them, is 431 ``headers_too_large``.
- :class:`RateLimit`: a token bucket per API key (the ``Authorization`` header) and one per client
  IP for requests without a key: past its rate a request is 429 ``rate_limit_exceeded`` with
  ``Retry-After`` (and ``retry-after-ms``, which the openai client prefers). A key is only given its
  own bucket once the API has accepted it: until then (and for every request the API answers 401)
  it counts against its IP, so inventing keys does not buy a fresh bucket per request. Health,
  readiness, /metrics, the workers' ingest and the dashboard's static files are exempt. The buckets
  live in this process: N API processes admit N times the rate.
- :class:`BodyLimit`: a body over ``max_bytes`` (Content-Length or chunked) is 413
  ``body_too_large``; a JSON body nested deeper than ``max_depth`` is 400 ``json_too_deep`` (before
  any parser could recurse on it). /v1/files streams its upload under its own limit
  (settings.max_upload_bytes, api/routes/files.py).

Each answers with api.errors.problem_response, so the body is the usual problem + OpenAI error.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from starlette.requests import Request

from api import errors
from api.asgi import answered_status
from service.settings import Settings

# JSON bodies (job specs, ingest batches) are small; uploads have their own limit (max_upload_bytes).
MAX_JSON_BODY_BYTES = Settings.model_fields["max_json_body_bytes"].default
UNLIMITED_BODY_PATHS = ("/v1/files",)
RATE_EXEMPT_PATHS = ("/healthz", "/readyz", "/metrics")
RATE_EXEMPT_PREFIXES = ("/v1/internal/", "/ui/static/")
MAX_BUCKETS = 10_000  # per kind; the least recently used bucket is dropped (a full bucket is a new one)


def _problem(scope, **kwargs):
    return errors.problem_response(Request(scope), **kwargs)


# --- headers ------------------------------------------------------------------------------------


class HeaderLimit:
    def __init__(self, app, max_bytes: int, max_count: int):
        self.app, self.max_bytes, self.max_count = app, max_bytes, max_count

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = scope["headers"]
            size = sum(len(k) + len(v) + 4 for k, v in headers)  # "name: value\r\n"
            if len(headers) > self.max_count or size > self.max_bytes:
                detail = (f"request has {len(headers)} headers of {size} bytes; the limits are {self.max_count} "
                          f"headers (MEMFIT_MAX_HEADER_COUNT) and {self.max_bytes} bytes (MEMFIT_MAX_HEADER_BYTES)")
                response = _problem(scope, status=431, code="headers_too_large",
                                    title="Request header fields too large", detail=detail)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


# --- rate -----------------------------------------------------------------------------------------


@dataclass
class TokenBucket:
    """``rate`` tokens a second up to ``burst``; each request takes one. ``rate`` 0: no limit."""

    rate: float
    burst: int
    tokens: float = field(init=False)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        self.tokens = float(self.burst)

    def _refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, now: float | None = None) -> float:
        """Take a token: 0.0 when granted, else the seconds until one is there (nothing taken)."""
        if not self.rate:
            return 0.0
        self._refill(time.monotonic() if now is None else now)
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate

    def wait(self, now: float | None = None) -> float:
        """The seconds until a token is there (0.0: one is), taking nothing."""
        if not self.rate:
            return 0.0
        self._refill(time.monotonic() if now is None else now)
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate


class _Buckets:
    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.items: OrderedDict[str, TokenBucket] = OrderedDict()

    def get(self, key: str, *, create: bool = True) -> TokenBucket | None:
        bucket = self.items.get(key)
        if bucket is None:
            if not create:
                return None
            bucket = self.items[key] = TokenBucket(self.rate, self.burst)
            if len(self.items) > MAX_BUCKETS:
                self.items.popitem(last=False)
        else:
            self.items.move_to_end(key)
        return bucket


def _exempt(path: str) -> bool:
    return path in RATE_EXEMPT_PATHS or path.startswith(RATE_EXEMPT_PREFIXES)


class RateLimit:
    """Per API key and per client IP token buckets (see the module's docstring)."""

    def __init__(self, app, settings: Settings):
        self.app = app
        self.keys = _Buckets(settings.rate_limit_key_per_s, settings.rate_limit_key_burst)
        self.ips = _Buckets(settings.rate_limit_ip_per_s, settings.rate_limit_ip_burst)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or _exempt(scope["path"]):
            return await self.app(scope, receive, send)
        credential = dict(scope["headers"]).get(b"authorization")
        digest = hashlib.sha256(credential).hexdigest() if credential else None
        ip = (scope.get("client") or ("unknown", 0))[0]
        key_bucket = self.keys.get(digest, create=False) if digest else None
        ip_bucket = self.ips.get(ip)
        if key_bucket is not None:
            wait, whose = key_bucket.take(), "this API key"
            rate, burst, setting = self.keys.rate, self.keys.burst, "MEMFIT_RATE_LIMIT_KEY_PER_S"
        else:
            # No key, or one not yet accepted: the IP's bucket. An unproven key only waits while its
            # IP's bucket is empty; it is charged only when the API refuses it (below).
            wait = ip_bucket.wait() if digest else ip_bucket.take()
            whose = "this client address without an accepted API key"
            rate, burst, setting = self.ips.rate, self.ips.burst, "MEMFIT_RATE_LIMIT_IP_PER_S"
        if wait > 0:
            retry_after = max(1, math.ceil(wait))
            detail = (f"rate limit exceeded for {whose}: at most {rate:g} requests per second "
                      f"(bursts of {burst}; {setting}); retry after {retry_after} s")
            response = _problem(
                scope, status=429, code="rate_limit_exceeded", title="Too many requests", detail=detail,
                retryable=True, headers={"Retry-After": str(retry_after), "retry-after-ms": str(math.ceil(wait * 1000))},
            )
            return await response(scope, receive, send)
        if digest is None:
            return await self.app(scope, receive, send)

        status = 0  # stays 0 if the app raises
        try:
            status = await answered_status(self.app, scope, receive, send)
        finally:
            if status == 401:
                self.keys.items.pop(digest, None)
                ip_bucket.take()
            elif 200 <= status < 500 and key_bucket is None:
                self.keys.get(digest)  # accepted (or at least not refused): its own bucket from now on


# --- body -----------------------------------------------------------------------------------------

# A JSON string literal (escapes included): removed before counting brackets, which may sit inside one.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether ``body`` nests arrays/objects deeper than ``limit`` (read as JSON, without parsing it)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    depth = 0
    for c in _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS):
        if c in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _is_json(scope) -> bool:
    content_type = dict(scope["headers"]).get(b"content-type", b"").lower()
    return not content_type or b"json" in content_type  # FastAPI reads a body without a type as JSON


class BodyLimit:
    """Read a request's body (at most ``max_bytes``) before the route does, refusing one too large or
    nested too deep; the route then gets the body as it came."""

    def __init__(self, app, max_bytes: int = MAX_JSON_BODY_BYTES, max_depth: int = 64):
        self.app, self.max_bytes, self.max_depth = app, max_bytes, max_depth

    def _too_large(self, scope):
        return _problem(scope, status=413, code="body_too_large", title="Payload too large",
                        detail=f"request body is larger than the limit of {self.max_bytes} bytes "
                               "(MEMFIT_MAX_JSON_BODY_BYTES)")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNLIMITED_BODY_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(scope)(scope, receive, send)
        if (not length or length == b"0") and b"transfer-encoding" not in headers:
            return await self.app(scope, receive, send)  # no body (GETs, the SSE streams)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away mid-body
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:  # a chunked body with no (or a false) Content-Length
                return await self._too_large(scope)(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if _is_json(scope) and json_depth_exceeds(body, self.max_depth):
            response = _problem(
                scope, status=400, code="json_too_deep", title="Bad request",
                detail=f"JSON body nests arrays/objects deeper than the limit of {self.max_depth} levels "
                       "(MEMFIT_MAX_JSON_DEPTH)",
            )
            return await response(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: http.disconnect when the client leaves
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)
