"""Where a py-spy profile of memfit's API spends its samples, from py-spy's collapsed stacks.

    python bench/profile_summary.py PROFILE.txt [--requests N]

``py-spy record --format raw`` writes one line per distinct stack, ``frame;frame;…;frame count``,
each frame ``function (file:line)``. Two views of the same samples:

- by **phase**: each sample goes to the innermost frame of its stack that names a phase of a
  request (authentication, the store query, building JobPublic, FastAPI's response validation,
  the session's close, each middleware, h11's parsing, the event loop, the thread pool …), so
  the phases partition the samples and a middleware gets only what it does itself;
- by **library** of the sample's leaf frame (psycopg, sqlalchemy, pydantic, fastapi, starlette,
  uvicorn/h11, asyncio, memfit's own code …).

With ``--requests`` (the requests served while recording) each line also shows the CPU
milliseconds per request it stands for, at py-spy's sampling rate (``--rate``, 200 by default).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

# (phase, pattern on "function (file:line)"), matched innermost-first: the deepest frame that
# matches any pattern decides the sample's phase.
PHASES: list[tuple[str, re.Pattern]] = [(name, re.compile(p)) for name, p in [
    ("auth: service.store.auth.authenticate (key row by prefix, sha256)", r"^authenticate \(service/store/auth\.py"),
    ("store: service.jobs.crud get_job / list_jobs (ORM query, row → Job)",
     r"^(get_job|list_jobs|newest_first_page|fetch_page) \(service/(jobs/crud|store/db)\.py"),
    ("serialize: api.schemas job_public / _spec_view / page_public (JobPublic built)",
     r"^(job_public|_spec_view|page_public|method_public|job_public_dict) \(api/schemas\.py"),
    ("fastapi: serialize_response (response_model validate + dump_json)", r"^serialize_response \(fastapi/routing\.py"),
    ("session: api.deps get_read_session / get_session (open, close → pool checkin)", r"^(get_read_session|get_session) \(api/deps\.py"),
    ("fastapi: solve_dependencies (request parsing, dependency calls)", r"^solve_dependencies \(fastapi/"),
    ("fastapi: route handler glue (get_request_handler.app)", r"^get_request_handler\.<locals>\.app \(fastapi/routing\.py"),
    ("thread pool hop: anyio to_thread / run_in_threadpool",
     r"^(\w+\.)?(run_sync|run_sync_in_worker_thread|run_in_threadpool|_run_sync_endpoint) \((anyio|starlette|fastapi)/"),
    ("worker thread: anyio WorkerThread idle/loop", r"^WorkerThread\.run \(anyio/_backends/_asyncio\.py"),
    ("middleware: api.metrics LatencyMiddleware (histogram observe)", r"\(api/metrics\.py"),
    ("middleware: api.limits HeaderLimit / RateLimit / BodyLimit", r"\(api/(app|limits)\.py"),
    ("middleware: api.routes.stream PokeOnWrite", r"^PokeOnWrite\.__call__ \(api/routes/stream\.py"),
    ("starlette: routing / exception middleware / response send", r"\(starlette/"),
    ("uvicorn: h11 HTTP parsing and protocol", r"\((uvicorn|h11)/"),
    ("asyncio: event loop, selector, transports", r"\(asyncio/"),
    ("thread: threading / concurrent.futures", r"\((threading|concurrent/futures)"),
]]

LIBRARIES: list[tuple[str, re.Pattern]] = [(name, re.compile(p)) for name, p in [
    ("psycopg (driver: query send, result parse)", r"\(psycopg"),
    ("sqlalchemy (ORM, Core, pool)", r"\(sqlalchemy/"),
    ("pydantic", r"\(pydantic"),
    ("fastapi", r"\(fastapi/"),
    ("starlette", r"\(starlette/"),
    ("uvicorn + h11 (HTTP parsing)", r"\((uvicorn|h11)/"),
    ("anyio (thread pool)", r"\(anyio/"),
    ("asyncio (event loop)", r"\(asyncio/"),
    ("json", r"\(json/"),
    ("prometheus_client", r"\(prometheus_client/"),
    ("memfit api/", r"\(api/"),
    ("memfit service/", r"\(service/"),
    ("threading / queue / concurrent", r"\((threading|queue|concurrent)"),
    ("hashlib / hmac", r"(hashlib|hmac)"),
]]

# The functions the inclusive view lists (the event loop and uvicorn's frames enclose everything).
INCLUSIVE = re.compile(r"\((api|service|fastapi|starlette|sqlalchemy|pydantic|psycopg|json|anyio|h11)/")

# A leaf that waits (a worker thread parked on its queue, the loop in epoll): no CPU, counted apart.
WAITING = re.compile(r"^(Condition\.wait|EpollSelector\.select|Event\.wait|Queue\.get|_wait_for_tstate_lock) \(")

LINE = re.compile(r"^(.*) (\d+)$")


def read(path: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for line in path.read_text(errors="replace").splitlines():
        m = LINE.match(line.strip())
        if m:
            stacks.append((m.group(1).split(";"), int(m.group(2))))
    return stacks


def phase_of(frames: list[str]) -> str:
    if frames and WAITING.search(frames[-1]):
        return "waiting (a parked thread, the loop in epoll: not CPU)"
    for frame in reversed(frames):
        for name, pattern in PHASES:
            if pattern.search(frame):
                return name
    return "other"


def library_of(frames: list[str]) -> str:
    leaf = frames[-1] if frames else ""
    for name, pattern in LIBRARIES:
        if pattern.search(leaf):
            return name
    return "other (" + re.sub(r" \(.*", "", leaf)[:40] + ")"


def summarize(path: Path, *, requests: int | None = None, rate: int = 200, top: int = 18) -> str:
    stacks = read(Path(path))
    total = sum(n for _, n in stacks)
    if not total:
        return f"{path}: no samples"
    phases, libs, inclusive = Counter(), Counter(), Counter()
    for frames, n in stacks:
        phases[phase_of(frames)] += n
        libs[library_of(frames)] += n
        for name in {re.sub(r":\d+\)$", ")", f) for f in frames}:  # once per sample, whatever the line
            inclusive[name] += n

    def table(title: str, counts: Counter, top: int = top) -> list[str]:
        lines = [f"  {title}"]
        for name, n in counts.most_common(top):
            per = f"  {1000 * n / rate / requests:6.3f} ms/req" if requests else ""
            lines.append(f"    {100 * n / total:5.1f}%{per}  {name}")
        return lines

    head = f"{path.name}: {total} samples ({total / rate:.1f} CPU-s at {rate}/s)"
    if requests:
        head += f", {requests} requests → {1000 * total / rate / requests:.2f} CPU ms/request sampled"
    inside = Counter({k: v for k, v in inclusive.items() if INCLUSIVE.search(k)})
    return "\n".join([head, *table("by phase (innermost match)", phases), *table("by library of the leaf frame", libs),
                      *table("inclusive, per function (memfit, FastAPI, Starlette, SQLAlchemy, pydantic, psycopg)",
                             inside, top=40)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", type=Path)
    ap.add_argument("--requests", type=int)
    ap.add_argument("--rate", type=int, default=200)
    args = ap.parse_args()
    print(summarize(args.profile, requests=args.requests, rate=args.rate))


if __name__ == "__main__":
    main()
