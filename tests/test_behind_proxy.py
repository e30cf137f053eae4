"""memfit behind a real reverse proxy, on two API replicas (issue 37, item 3).

Everything here is real: Debian's nginx started by the test on free ports (TLS with a certificate made
for the test, round-robin over two upstreams, connecting to them from 127.0.0.5 as an Ingress
controller's pod address would), two `memfit serve` processes on one Postgres database, a Redis of the
test's own counting their rate limits, and clients on different loopback addresses (127.0.0.2,
127.0.0.3) standing for different users. What must hold:

- the rate limit is keyed by the real client address (uvicorn believes X-Forwarded-For from
  MEMFIT_FORWARDED_ALLOW_IPS only, so a client cannot spoof one) and counted once for both replicas:
  a client gets its burst and no more, wherever nginx sends each request, and another client is not
  starved by it;
- the login cookie over https is Secure, HttpOnly and SameSite=Strict and holds a session token, not
  the API key; logging out, or revoking the key, ends the session;
- every /ui response carries a Content-Security-Policy with frame-ancestors 'none' (and X-Frame-Options).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.scheduler.local_head import free_port
from service.store import auth, db
from service.store.db import session_scope
from tests.factories import new_key

pytestmark = pytest.mark.slow  # starts servers: not in `make test-fast`

ROOT = Path(__file__).resolve().parent.parent
PROXY_ADDRESS = "127.0.0.5"  # where nginx connects to memfit from: the "Ingress controller's pod"
BURST = 6


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2, verify=False).status_code == 200
    except httpx.HTTPError:
        return False


def _stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A Redis of this module's own, on a free port, keeping nothing on disk."""
    port = free_port()
    folder = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(folder)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        import redis

        client = redis.Redis(port=port)
        wait_until(lambda: _ping(client), 20, "redis-server to answer")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(proc)


def _ping(client) -> bool:
    try:
        return client.ping()
    except Exception:  # noqa: BLE001 - not up yet
        return False


@pytest.fixture(scope="module")
def replicas(new_database, redis_url, tmp_path_factory):
    """Two `memfit serve` processes (API only) on one database and one Redis: (db url, [ports])."""
    folder = tmp_path_factory.mktemp("replicas")
    with new_database() as url:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MEMFIT_DATABASE_URL": url,
               "MEMFIT_STORAGE_DIR": str(folder / "storage"), "MEMFIT_SCHEDULER_ENABLED": "0",
               "MEMFIT_RATE_LIMIT_STORAGE_URI": redis_url, "MEMFIT_FORWARDED_ALLOW_IPS": PROXY_ADDRESS,
               "MEMFIT_RATE_LIMIT_IP_PER_S": "0.01", "MEMFIT_RATE_LIMIT_IP_BURST": str(BURST)}
        procs, ports = [], []
        try:
            for i in range(2):
                port = free_port()
                with open(folder / f"serve-{i}.log", "ab") as log:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "service.cli.main", "serve", "--port", str(port), "--log-level", "warning"],
                        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
                ports.append(port)
            for proc, port in zip(procs, ports):
                wait_until(lambda: proc.poll() is not None or _answers(f"http://127.0.0.1:{port}/readyz"), 90,
                           f"memfit serve on {port}")
                assert proc.poll() is None, (folder / "serve-0.log").read_text()[-2000:]
            yield url, ports
        finally:
            for proc in procs:
                _stop(proc)


NGINX_CONF = """
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
user root;
events {{ worker_connections 64; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy; fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;
  upstream memfit {{ server 127.0.0.1:{a}; server 127.0.0.1:{b}; }}
  server {{
    listen 127.0.0.1:{port} ssl;
    ssl_certificate {dir}/cert.pem;
    ssl_certificate_key {dir}/key.pem;
    location / {{
      proxy_pass http://memfit;
      proxy_bind {proxy_address};
      proxy_set_header Host $host;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto $scheme;
    }}
  }}
}}
"""


@pytest.fixture(scope="module")
def proxy(replicas, tmp_path_factory):
    """nginx terminating TLS in front of both replicas: its https base URL."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    assert Path(nginx).exists(), "nginx is not installed (Debian's nginx-light: .ci/run installs it)"
    folder = tmp_path_factory.mktemp("nginx")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(folder / "key.pem"), "-out", str(folder / "cert.pem"), "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    port = free_port()
    (folder / "nginx.conf").write_text(NGINX_CONF.format(dir=folder, a=replicas[1][0], b=replicas[1][1], port=port,
                                                         proxy_address=PROXY_ADDRESS))
    proc = subprocess.Popen([nginx, "-p", str(folder), "-c", str(folder / "nginx.conf"), "-e", str(folder / "error.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: proc.poll() is not None or _answers(f"https://127.0.0.1:{port}/healthz"), 20, "nginx")
        assert proc.poll() is None, (folder / "error.log").read_text()[-2000:]
        yield f"https://127.0.0.1:{port}"
    finally:
        _stop(proc, signal.SIGQUIT)


def client_at(address: str, base_url: str) -> httpx.Client:
    """A client whose connections come from ``address`` (another user, as far as the network is concerned)."""
    return httpx.Client(base_url=base_url, verify=False, timeout=15, follow_redirects=False,
                        transport=httpx.HTTPTransport(local_address=address, verify=False))


def test_one_limit_per_real_client_address_shared_by_both_replicas(proxy):
    with client_at("127.0.0.2", proxy) as alice, client_at("127.0.0.3", proxy) as bob:
        # alice claims to be someone else each time: a client's own X-Forwarded-For is not believed
        codes = [alice.get("/ui/login", headers={"X-Forwarded-For": f"198.51.100.{i}"}).status_code
                 for i in range(BURST + 4)]
        assert codes == [200] * BURST + [429] * 4, codes  # BURST in all, not BURST per replica
        limited = alice.get("/ui/login")
        assert limited.status_code == 429 and "client address" in limited.json()["detail"]
        assert int(limited.headers["Retry-After"]) >= 1
        # bob is another address: alice's requests did not spend his allowance
        assert [bob.get("/ui/login").status_code for _ in range(3)] == [200] * 3


def test_the_login_cookie_over_https_is_secure_and_holds_a_session_not_the_key(replicas, proxy):
    url, ports = replicas
    engine = db.make_engine(url, pool_size=1)
    try:
        sessions = db.make_sessionmaker(engine)
        key = new_key(sessions)
        with client_at("127.0.0.4", proxy) as browser:
            r = browser.post("/ui/login", data={"api_key": key, "next": "/ui/jobs"})
            assert r.status_code == 303, r.text
            cookie = next(v for k, v in r.headers.multi_items() if k == "set-cookie" and v.startswith("memfit_session="))
            attributes = {a.strip().split("=")[0].lower() for a in cookie.split(";")[1:]}
            assert {"secure", "httponly", "samesite"} <= attributes and "samesite=strict" in cookie.lower(), cookie
            token = cookie.split(";")[0].split("=", 1)[1]
            assert token.startswith("mfs_") and key not in cookie and key[8:20] not in cookie
            # the session opens the pages on either replica; the key itself as a cookie opens nothing
            assert [browser.get("/ui/jobs", cookies={"memfit_session": token}).status_code for _ in range(2)] == [200, 200]
            assert browser.get("/ui/jobs", cookies={"memfit_session": key}).status_code == 303
            page = browser.get("/ui/jobs", cookies={"memfit_session": token})
            csp = page.headers["content-security-policy"]
            assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp.split(
                "script-src")[1].split(";")[0], csp
            assert page.headers["x-frame-options"] == "DENY" and page.headers["x-content-type-options"] == "nosniff"
            assert "content-security-policy" not in browser.get("/healthz").headers  # pages only
            # logging out ends the session (the cookie, replayed, opens nothing)
            assert browser.post("/ui/logout", cookies={"memfit_session": token}).status_code == 303
            assert browser.get("/ui/jobs", cookies={"memfit_session": token}).status_code == 303
            # a second session ends when its key is revoked
            r = browser.post("/ui/login", data={"api_key": key, "next": "/ui/jobs"})
            second = r.cookies.get("memfit_session") or r.headers["set-cookie"].split(";")[0].split("=", 1)[1]
            assert browser.get("/ui/jobs", cookies={"memfit_session": second}).status_code == 200
            with session_scope(sessions) as s:
                auth.revoke_key(s, auth.key_prefix(key))
            assert browser.get("/ui/jobs", cookies={"memfit_session": second}).status_code == 303
        # straight to a replica over plain http (no proxy): no Secure cookie on an http answer
        with httpx.Client(base_url=f"http://127.0.0.1:{ports[0]}", timeout=15) as direct:
            other = new_key(sessions)
            r = direct.post("/ui/login", data={"api_key": other, "next": "/ui/jobs"})
            assert r.status_code == 303 and "secure" not in r.headers["set-cookie"].lower()
    finally:
        engine.dispose()


def test_forwarded_allow_ips_is_a_checked_setting():
    from service.settings import SettingsInvalid, load_settings

    assert load_settings(forwarded_allow_ips="10.0.0.0/8, 192.168.1.7").forwarded_allow_ips == "10.0.0.0/8,192.168.1.7"
    with pytest.raises(SettingsInvalid, match="MEMFIT_FORWARDED_ALLOW_IPS"):
        load_settings(forwarded_allow_ips="10.0.0.0/8,not-an-address")
    with pytest.raises(SettingsInvalid, match="MEMFIT_RATE_LIMIT_STORAGE_URI"):
        load_settings(rate_limit_storage_uri="memcached://x")
