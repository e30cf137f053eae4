"""Request limits (OWASP API4, resource consumption), as ASGI middleware in front of every route.

- :class:`HeaderLimit`: more than ``max_header_count`` headers, or more than ``max_header_bytes`` of
  them, is 431 ``headers_too_large``.
- :class:`RateLimit`: a limit per API key (the ``Authorization`` header) or dashboard session (its
  cookie), and one per client IP for requests without either: past its rate a request is 429 ``rate_limit_exceeded`` with
  ``Retry-After`` (and ``retry-after-ms``, which the openai client prefers). A key is only given its
  own allowance once the API has accepted it: until then (and for every request the API answers 401)
  it counts against its IP, so inventing keys does not buy a fresh allowance per request. Health,
  readiness, /metrics and the dashboard's static files are exempt; the workers' ingest has a limit of
  its own, per job attempt, checked after its token (api/routes/ingest.py). Every limit is counted by
  the app's :class:`Limiter`, which routes with limits of their own call too (:func:`take`).
- :class:`BodyLimit`: a body over ``max_bytes`` (Content-Length or chunked) is 413
  ``body_too_large``; a JSON body nested deeper than ``max_depth`` is 400 ``json_too_deep`` (before
  any parser could recurse on it). /v1/files streams its upload under its own limit
  (settings.max_upload_bytes, api/routes/files.py).

Each answers with api.errors.problem_response, so the body is the usual problem + OpenAI error.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from starlette.requests import Request

from api import errors
from api.asgi import answered_status
from service.domain.errors import DomainError
from service.settings import Settings

# JSON bodies (job specs, ingest batches) are small; uploads have their own limit (max_upload_bytes).
MAX_JSON_BODY_BYTES = Settings.model_fields["max_json_body_bytes"].default
UNLIMITED_BODY_PATHS = ("/v1/files",)
# The workers' ingest reads its body itself, after its token and its rate limit, under its own cap
# (api/routes/ingest.py): nothing of the body is read before the token is checked.
OWN_BODY_PREFIXES = ("/v1/internal/",)
RATE_EXEMPT_PATHS = ("/healthz", "/readyz", "/metrics")
RATE_EXEMPT_PREFIXES = ("/v1/internal/", "/ui/static/")
log = logging.getLogger("memfit.api")
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

    def take(self, now: float | None = None, cost: int = 1) -> float:
        """Take ``cost`` tokens: 0.0 when granted, else the seconds until they are there (nothing taken)."""
        if not self.rate:
            return 0.0
        self._refill(time.monotonic() if now is None else now)
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.rate

    def wait(self, now: float | None = None, cost: int = 1) -> float:
        """The seconds until ``cost`` tokens are there (0.0: they are), taking nothing."""
        if not self.rate:
            return 0.0
        self._refill(time.monotonic() if now is None else now)
        return 0.0 if self.tokens >= cost else (cost - self.tokens) / self.rate


class Limiter:
    """Where every rate limit of the API is counted: ``await limiter.take(key, per_s=…, burst=…)``.

    A key is any string naming what is limited (``ip:<address>``, ``key:<sha256>``, ``ingest:<job>:<attempt>``;
    a feature adds its own prefix); ``cost`` is how much of the allowance one request uses (1 for a
    request; a route that spends more, e.g. generated tokens, passes its count). Answers 0.0 when
    granted, else the seconds until it would be (and nothing is charged).

    The counting is the ``limits`` library's sliding-window counter, on the storage of
    ``MEMFIT_RATE_LIMIT_STORAGE_URI``: ``memory://`` in this process, or Redis, shared by every API
    replica (one count per key whichever replica a request reaches). A rate of ``per_s`` with bursts of
    ``burst`` is ``burst`` requests per ``burst / per_s`` seconds. When Redis does not answer, a request
    is let through (and the failure logged): the limiter never takes the API down with it."""

    def __init__(self, uri: str = "memory://") -> None:
        from limits.aio.strategies import SlidingWindowCounterRateLimiter
        from limits.storage import storage_from_string

        options = {} if uri.startswith("memory://") else {"implementation": "redispy", "socket_timeout": 1,
                                                           "socket_connect_timeout": 1}
        self.uri = uri
        self.storage = storage_from_string(f"async+{uri}", wrap_exceptions=True, **options)
        self.strategy = SlidingWindowCounterRateLimiter(self.storage)
        self._items: dict[tuple[float, int], object] = {}
        self._failing_since: float | None = None

    def _item(self, per_s: float, burst: int):
        item = self._items.get((per_s, burst))
        if item is None:
            from limits import RateLimitItemPerSecond

            item = self._items[(per_s, burst)] = RateLimitItemPerSecond(burst, max(1, math.ceil(burst / per_s)),
                                                                        namespace="memfit")
        return item

    async def _wait(self, item, key: str) -> float:
        stats = await self.strategy.get_window_stats(item, key)
        return max(0.001, stats.reset_time - time.time())

    async def take(self, key: str, *, per_s: float, burst: int, cost: int = 1) -> float:
        if not per_s:
            return 0.0
        item = self._item(per_s, burst)
        try:
            if await self.strategy.hit(item, key, cost=cost):
                return 0.0
            return await self._wait(item, key)
        except Exception as exc:  # noqa: BLE001 - StorageError, a connection refused: let it through
            return self._unavailable(exc)

    async def wait(self, key: str, *, per_s: float, burst: int, cost: int = 1) -> float:
        """The seconds until ``cost`` would be granted, charging nothing."""
        if not per_s:
            return 0.0
        item = self._item(per_s, burst)
        try:
            if await self.strategy.test(item, key, cost=cost):
                return 0.0
            return await self._wait(item, key)
        except Exception as exc:  # noqa: BLE001
            return self._unavailable(exc)

    def _unavailable(self, exc: Exception) -> float:
        now = time.monotonic()
        if self._failing_since is None or now - self._failing_since > 60:  # once a minute
            self._failing_since = now
            log.warning("rate limit storage %s unavailable (requests are let through): %s", self.uri, exc)
        return 0.0

    async def close(self) -> None:
        pass


def limiter_for(settings: Settings) -> Limiter:
    return Limiter(settings.rate_limit_storage_uri)


async def take(app, key: str, *, per_s: float, burst: int, cost: int = 1) -> float:
    """Charge ``cost`` to ``key`` on the app's limiter (see :class:`Limiter`); the wait, 0.0 when granted.
    For a route with a limit of its own: ``if (wait := await take(request.app, ...)): raise RateLimited(...)``."""
    return await app.state.limiter.take(key, per_s=per_s, burst=burst, cost=cost)


class RateLimited(DomainError):
    """429 ``rate_limit_exceeded`` with Retry-After, for a route that applies a limit of its own."""

    status, code, title, openai_type, retryable = 429, "rate_limit_exceeded", "Too many requests", "rate_limit_error", True

    def __init__(self, wait_s: float, *, whose: str, per_s: float, burst: int, setting: str):
        retry_after = max(1, math.ceil(wait_s))
        super().__init__(
            f"rate limit exceeded for {whose}: at most {per_s:g} requests per second (bursts of {burst}; "
            f"{setting}); retry after {retry_after} s",
            headers={"Retry-After": str(retry_after), "retry-after-ms": str(math.ceil(wait_s * 1000))})


def client_address(scope) -> str:
    """The client's address as uvicorn gives it: the caller's own behind a proxy it trusts
    (MEMFIT_FORWARDED_ALLOW_IPS), else the peer's."""
    return (scope.get("client") or ("unknown", 0))[0]


def _exempt(path: str) -> bool:
    return path in RATE_EXEMPT_PATHS or path.startswith(RATE_EXEMPT_PREFIXES)


class RateLimit:
    """Per API key and per client IP limits on the app's :class:`Limiter` (see the module's docstring)."""

    def __init__(self, app, settings: Settings):
        self.app = app
        self.key_rate = (settings.rate_limit_key_per_s, settings.rate_limit_key_burst)
        self.ip_rate = (settings.rate_limit_ip_per_s, settings.rate_limit_ip_burst)
        self.accepted: OrderedDict[str, None] = OrderedDict()  # credentials this process saw accepted

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or _exempt(scope["path"]):
            return await self.app(scope, receive, send)
        limiter: Limiter = scope["app"].state.limiter
        headers = dict(scope["headers"])
        # the tinker SDK's key header (api/routes/tinker.py) is a key like a bearer token: its own bucket once accepted
        credential = headers.get(b"authorization") or headers.get(b"x-api-key") or _session_cookie(headers.get(b"cookie"))
        digest = hashlib.sha256(credential).hexdigest() if credential else None
        ip_key = f"ip:{client_address(scope)}"
        ip_per_s, ip_burst = self.ip_rate
        if digest is not None and digest in self.accepted:
            self.accepted.move_to_end(digest)
            per_s, burst = self.key_rate
            wait = await limiter.take(f"key:{digest}", per_s=per_s, burst=burst)
            whose, setting = "this API key", "MEMFIT_RATE_LIMIT_KEY_PER_S"
        else:
            # No key, or one not yet accepted: the IP's bucket. An unproven key only waits while its
            # IP's bucket is empty; it is charged only when the API refuses it (below).
            per_s, burst = ip_per_s, ip_burst
            if digest:
                wait = await limiter.wait(ip_key, per_s=per_s, burst=burst)
            else:
                wait = await limiter.take(ip_key, per_s=per_s, burst=burst)
            whose = "this client address without an accepted API key"
            setting = "MEMFIT_RATE_LIMIT_IP_PER_S"
        if wait > 0:
            response = errors.problem_response(Request(scope), **_limited_problem(wait, whose, per_s, burst, setting))
            return await response(scope, receive, send)
        if digest is None:
            return await self.app(scope, receive, send)

        status = 0  # stays 0 if the app raises
        try:
            status = await answered_status(self.app, scope, receive, send)
        finally:
            refused = status == 401 or (credential.startswith(b"session:") and not 200 <= status < 300
                                        and digest not in self.accepted)
            if refused:
                self.accepted.pop(digest, None)
                await limiter.take(ip_key, per_s=ip_per_s, burst=ip_burst)
            elif (200 <= status < 300 or (200 <= status < 500 and not credential.startswith(b"session:"))) \
                    and digest not in self.accepted:
                # accepted (or at least not refused): its own allowance from now on. A dashboard session
                # only once a page was served with it (a forged one is a redirect to the login, not a 401).
                self.accepted[digest] = None
                if len(self.accepted) > MAX_BUCKETS:
                    self.accepted.popitem(last=False)


def _session_cookie(cookie_header: bytes | None) -> bytes | None:
    """The dashboard's session cookie (api/web_auth.py), as a credential the limiter tells apart."""
    if not cookie_header:
        return None
    for part in cookie_header.split(b";"):
        name, _, value = part.strip().partition(b"=")
        if name == b"memfit_session" and value:
            return b"session:" + value
    return None


def _limited_problem(wait: float, whose: str, per_s: float, burst: int, setting: str) -> dict:
    limited = RateLimited(wait, whose=whose, per_s=per_s, burst=burst, setting=setting)
    return {"status": 429, "code": limited.code, "title": limited.title, "detail": limited.message,
            "retryable": True, "headers": limited.headers}


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
        if scope["type"] != "http" or scope["path"] in UNLIMITED_BODY_PATHS or scope["path"].startswith(OWN_BODY_PREFIXES):
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
