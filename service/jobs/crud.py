"""Job service: what the routes call (create, list, get, cancel, pause, resume, events, checkpoints)
and the store functions the scheduler and the ingest path build on (events, checkpoints, memory
samples, fenced field updates). Every status change goes through service.store.transitions.transition.

Write functions commit their own unit of work (create_job commits twice when it holds an
Idempotency-Key: once to claim the key, once with the job and the saved answer).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Callable, Container, Iterable, Sequence

from sqlalchemy import Row, Text, any_, bindparam, case, cast, delete, literal_column, null, or_, select, tuple_, update
from sqlalchemy.orm import Session

from service.domain.errors import (
    BadRequest,
    IdempotencyInFlight,
    IdempotencyMismatch,
    InvalidTransition,
    JobNotFound,
    SpecInvalid,
    StaleAttempt,
    UnprocessableEntity,
)
from service.domain.model_ref import ModelRefError, resolve_model
from service.domain.spec import SpecError, derive, validate_spec
from service.domain.states import JobStatus
from service.domain.storage import local_path
from service.jobs import quotas, series
from service.jobs.files import get_file
from service.memory import preflight as memory
from service.memory.compare import initial_summary, job_memory_view
from service.settings import Settings
from service.store.auth import Principal
from service.store.db import (
    Page,
    fetch_page,
    insert_ignoring_conflicts,
    newest_first_page,
)
from service.store.reads import Reads
from service.store.models import (
    MEMORY_BYTE_COLUMNS,
    Checkpoint,
    IdempotencyKey,
    Job,
    JobEvent,
    MemorySample,
    new_id,
    utcnow,
)
from service.store.transitions import transition

IDEMPOTENCY_TTL = timedelta(hours=24)
# A key whose first request has not finished after this long is taken to belong to a dead process.
IDEMPOTENCY_ABANDONED = timedelta(seconds=60)
MAX_LIMIT = 100


# --- create -----------------------------------------------------------------------------------


@dataclass
class Created:
    """create_job's answer: the new job, or the first answer replayed for a repeated Idempotency-Key."""

    status_code: int
    body: dict[str, Any]
    job: Job | None
    replayed: bool = False


def request_hash(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _claim_idempotency_key(session: Session, tenant_id: str, key: str, digest: str) -> IdempotencyKey | None:
    """Claim ``key`` (commits). Returns None when this request owns it, the saved row to replay otherwise."""
    for _ in range(5):
        now = utcnow()
        inserted = insert_ignoring_conflicts(
            session,
            IdempotencyKey,
            [{"tenant_id": tenant_id, "key": key, "request_hash": digest, "created_at": now}],
            ["tenant_id", "key"],
        )
        session.commit()
        if inserted:
            return None
        row = session.get(IdempotencyKey, (tenant_id, key), populate_existing=True)
        if row is None:
            continue  # expired and deleted by another request meanwhile
        abandoned = row.status_code is None and row.created_at < now - IDEMPOTENCY_ABANDONED
        if row.created_at < now - IDEMPOTENCY_TTL or abandoned:
            session.execute(
                delete(IdempotencyKey).where(
                    IdempotencyKey.tenant_id == tenant_id,
                    IdempotencyKey.key == key,
                    IdempotencyKey.created_at == row.created_at,
                )
            )
            session.commit()
            continue
        if row.request_hash != digest:
            raise IdempotencyMismatch(key)
        if row.status_code is None:
            raise IdempotencyInFlight(key)
        return row
    raise IdempotencyInFlight(key)


def create_job(
    session: Session,
    principal: Principal,
    settings: Settings,
    body: Any,
    *,
    render: Callable[[Job], dict[str, Any]],
    idempotency_key: str | None = None,
    known_gpus: set[str] | None = None,
) -> Created:
    """Validate ``body`` (a parsed JSON create body) and store a job in ``validating_files``.

    ``render`` turns the job into the response body; with an Idempotency-Key that body is saved and
    replayed for the same key and body, a different body with the same key is IdempotencyMismatch,
    and a first request still running is IdempotencyInFlight.
    """
    if idempotency_key is not None:
        if not 1 <= len(idempotency_key) <= 255:
            raise UnprocessableEntity("Idempotency-Key must be 1 to 255 characters", param="Idempotency-Key")
        saved = _claim_idempotency_key(session, principal.tenant_id, idempotency_key, request_hash(body))
        if saved is not None:
            return Created(status_code=saved.status_code, body=saved.response_body, job=None, replayed=True)
    try:
        job = _new_job(session, principal, settings, body, known_gpus)
        answer = render(job)
        if idempotency_key is not None:
            session.execute(
                update(IdempotencyKey)
                .where(IdempotencyKey.tenant_id == principal.tenant_id, IdempotencyKey.key == idempotency_key)
                .values(status_code=200, response_body=answer)
            )
        session.commit()
    except BaseException:
        session.rollback()
        if idempotency_key is not None:
            # A refused request saves nothing: the same key may be retried with a corrected body.
            session.execute(
                delete(IdempotencyKey).where(
                    IdempotencyKey.tenant_id == principal.tenant_id,
                    IdempotencyKey.key == idempotency_key,
                    IdempotencyKey.status_code.is_(None),
                )
            )
            session.commit()
        raise
    return Created(status_code=200, body=answer, job=job)


def _new_job(session: Session, principal: Principal, settings: Settings, body: Any, known_gpus: set[str] | None) -> Job:
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object", code="invalid_json")
    try:
        spec = validate_spec(body, known_gpus)
    except SpecError as exc:
        raise SpecInvalid([p.model_dump() for p in exc.problems]) from None
    try:
        resolve_model(spec.model, settings.model_dirs)
    except ModelRefError as exc:  # the API answers every model problem as invalid_model; the message says which
        raise SpecInvalid([{"param": "model", "message": exc.message, "code": "invalid_model"}]) from None
    files = {}
    for param in ("training_file", "validation_file"):
        file_id = getattr(spec, param)
        if file_id is not None:
            f = files[param] = get_file(session, principal, file_id, param=param)
            if f.purpose != "fine-tune" or f.status != "processed":
                raise UnprocessableEntity(f"file {file_id} is not a processed fine-tune file", param=param)
    check_training_data(spec, files, settings)
    # OpenAI's hyperparameters → memfit's, written into the spec (service/domain/spec.py: derive), so the stored
    # spec is what the planner plans and the workers run; each value filled in becomes an event below.
    derived = derive(spec, training_examples=files["training_file"].rows, seed=secrets.randbelow(2**31))
    spec = derived.spec
    # Memory pre-flight (issue 5, service/memory/preflight.py): memory_policy=reject raises DoesNotFit (422
    # insufficient_memory), auto returns the spec with the cheapest fitting change, ignore the spec as given.
    # The plan is for the training file's rows (service/memory/data.py), not only for max_seq_length.
    preflight = memory.preflight(spec, settings, training_path=local_path(settings, files["training_file"].path))
    spec = preflight.spec
    quotas.check_queued(session, principal.tenant_id, settings)  # 429 past quota_queued_jobs; locks until commit
    job = Job(
        id=new_id("ftjob-"),
        tenant_id=principal.tenant_id,
        status=JobStatus.validating_files.value,
        spec=spec.model_dump(mode="json"),
        model=spec.model,
        training_file=spec.training_file,
        validation_file=spec.validation_file,
        suffix=spec.suffix,
        seed=spec.seed,
        metadata_=spec.metadata,
        attempt=0,
        result_files=[],
    )
    session.add(job)
    session.flush()
    add_event(session, job.id, f"Validating training file: {spec.training_file}", attempt=0, created_at=job.created_at)
    for d in derived.derivations:
        add_event(session, job.id, d.message, level=d.level, data=d.data, attempt=0)
    record_preflight(session, job, preflight)  # jobs.plan, the memory summary, the pre-flight's event
    return job


def check_training_data(spec, files: dict, settings: Settings) -> None:
    """The files suit the method (DPO trains on preference rows, supervised on the others), and the model's
    chat template renders every row's tools (400 naming the line: service/memory/data.py check_tools_rendered)."""
    from service.domain.datafmt import PREFERENCE, REINFORCEMENT, DataError
    from service.memory.data import check_tools_rendered

    for param, f in files.items():
        dpo, preference = spec.method.type == "dpo", f.format == PREFERENCE
        if dpo and not preference:
            raise UnprocessableEntity(f"method.type 'dpo' trains on preference rows (input, preferred_output, "
                                      f"non_preferred_output); {f.id} holds {f.format} rows", param=param)
        if preference and not dpo:
            raise UnprocessableEntity(f"{f.id} holds preference rows, which train with method.type 'dpo'", param=param)
        rl, prompts = spec.method.type == "reinforcement", f.format == REINFORCEMENT
        if rl and not prompts:
            raise UnprocessableEntity(f"method.type 'reinforcement' trains on prompt rows (messages ending before the "
                                      f"assistant's turn, and the fields the grader reads); {f.id} holds {f.format} "
                                      "rows", param=param)
        if prompts and not rl:
            raise UnprocessableEntity(f"{f.id} holds reinforcement rows (messages with no assistant turn to learn, or "
                                      "fields a chat row does not have), which train with method.type "
                                      "'reinforcement'", param=param)
        if rl:
            check_grader_rows(spec, param, f, local_path(settings, f.path))
        try:
            check_tools_rendered(spec, local_path(settings, f.path), settings.model_dirs)
        except DataError as exc:
            raise BadRequest(f"{param} {f.id} line {exc.line}: {exc.message}", param=param, code="invalid_file") from None


def check_grader_rows(spec, param: str, f, path: str) -> None:
    """Every row of a reinforcement file has the fields the job's grader reads (400 naming the line)."""
    from service.domain.datafmt import DataError, check_grader_fields, iter_examples
    from service.domain.graders import item_fields

    fields = item_fields(spec.method.reinforcement.grader)
    if not fields:
        return
    try:
        check_grader_fields(iter_examples(path), fields)
    except DataError as exc:
        raise BadRequest(f"{param} {f.id} line {exc.line}: {exc.message}", param=param, code="invalid_file") from None


def record_preflight(session: Session, job: Job, outcome: memory.PreflightOutcome) -> None:
    """Store the pre-flight on a new job (its plan, the memory summary) and its events."""
    job.plan = outcome.plan
    job.memory_summary = initial_summary(outcome.plan)
    session.flush()
    for e in outcome.events:
        add_event(session, job.id, e["message"], level=e.get("level", "info"), data=e.get("data"), attempt=0)


# --- read -------------------------------------------------------------------------------------


def get_job(session: Session, principal: Principal, job_id: str) -> Job:
    """The tenant's job, or JobNotFound (also for another tenant's id, and for an id no database can
    hold: Postgres refuses a NUL byte in text, which would be a 500)."""
    job = None if "\x00" in job_id else session.get(Job, job_id)
    if job is None or job.tenant_id != principal.tenant_id:
        raise JobNotFound(job_id)
    return job


def list_jobs(
    session: Session,
    principal: Principal,
    *,
    after: str | None = None,
    limit: int = 20,
    metadata: dict[str, str] | None = None,
    status: str | None = None,
) -> Page:
    """Newest first. ``after`` is the last id of the previous page; ``metadata`` filters on equal values."""
    q = select(Job).where(Job.tenant_id == principal.tenant_id)
    for key, value in (metadata or {}).items():
        q = q.where(Job.metadata_[key].as_string() == value)
    if status:
        q = q.where(Job.status == status)
    return newest_first_page(session, q, Job, tenant_id=principal.tenant_id, after=after, limit=limit)


# What GET job and the job list read: each job's row, without ORM objects (a read has no use for an
# identity map), its JSON columns as the text the database holds — the API puts that text into its
# answer as it is, so nothing is parsed and serialized again. The spec is read only when asked for:
# it changes only with the job's (attempt, queued) — an out-of-memory downshift — so the API keeps
# each job's view of it per that version (api/schemas.py spec_version). The API
# unpacks these rows by position (api/schemas.py job_document): a column added here goes there too.
def spec_version(attempt: int, status: str) -> tuple[int, bool]:
    """What a job's spec can only change with. The one change after create is an out-of-memory
    downshift (service/scheduler/loop.py ``_downshift``): it writes the new spec in the transition
    running → queued, the attempt unchanged, and the next claim raises the attempt — so (attempt,
    queued) differs before and after it, and a view made from the old spec is not reused."""
    return attempt, status == "queued"


_jobs = Job.__table__.c
JOB_ROW = (
    _jobs.id, _jobs.tenant_id, _jobs.status, _jobs.model, _jobs.training_file, _jobs.validation_file,
    _jobs.suffix, _jobs.seed, _jobs.attempt, _jobs.desired_state, _jobs.created_at, _jobs.finished_at,
    _jobs.estimated_finish, _jobs.fine_tuned_model, _jobs.trained_tokens,
    cast(_jobs.metadata, Text).label("metadata_json"),
    cast(_jobs.result_files, Text).label("result_files_json"),
    cast(_jobs.error, Text).label("error_json"),
    cast(_jobs.memory_summary, Text).label("memory_summary_json"),
    # the plan only where there is no summary (the view shows {"plan": …} then): it is the largest column
    case((or_(_jobs.memory_summary.is_(None), cast(_jobs.memory_summary, Text) == "null"), cast(_jobs.plan, Text)),
         else_=null()).label("plan_json"),
)
_SPEC = cast(_jobs.spec, Text).label("spec_json")
# Built once, with bound parameters: SQLAlchemy computes a statement's cache key once per object, so a
# statement built per request would pay for that (and for its construction) on every read.
_cursor = Job.__table__.alias("cursor")
_NEWEST_FIRST = (_jobs.created_at.desc(), _jobs.id.desc())
_TENANT = _jobs.tenant_id == bindparam("tenant_id")
_JOB_BY_ID = select(*JOB_ROW).where(_jobs.id == bindparam("job_id"), _TENANT)
_READ_JOB = {True: _JOB_BY_ID.add_columns(_SPEC), False: _JOB_BY_ID.add_columns(null().label("spec_json"))}
_AFTER_CURSOR = tuple_(_jobs.created_at, _jobs.id) < tuple_(
    select(_cursor.c.created_at).where(_cursor.c.id == bindparam("after"), _cursor.c.tenant_id == bindparam("tenant_id"))
    .scalar_subquery(), bindparam("after"))
_PAGE = select(*JOB_ROW).where(_TENANT)
_READ_PAGE = {False: _PAGE.order_by(*_NEWEST_FIRST).limit(bindparam("limit")),
              True: _PAGE.where(_AFTER_CURSOR).order_by(*_NEWEST_FIRST).limit(bindparam("limit"))}
_CURSOR_EXISTS = select(_jobs.id).where(_jobs.id == bindparam("after"), _TENANT)
# Postgres: a row version's identity — the transaction that wrote it and where it lies. Any UPDATE
# writes a new version with a new xmin, so a page can be read as (id, version) pairs first and only
# the jobs whose version is not the one already in hand fetched whole (read_jobs).
_VERSION = literal_column("(jobs.xmin::text || '/' || jobs.ctid::text)").label("version")
_PAGE_VERSIONS = {after: select(_jobs.id, _VERSION).where(_TENANT, *((_AFTER_CURSOR,) if after else ()))
                  .order_by(*_NEWEST_FIRST).limit(bindparam("limit")) for after in (False, True)}
_ROWS_BY_ID = select(*JOB_ROW, _VERSION).where(_jobs.id == any_(bindparam("job_ids")), _TENANT)
_SPECS = select(_jobs.id, _SPEC).where(_jobs.id.in_(bindparam("job_ids", expanding=True)), _TENANT)


async def read_job(reads: Reads, principal: Principal, job_id: str, *, with_spec: bool = True) -> Row:
    """get_job for a read: the tenant's job as a JOB_ROW row (plus ``spec_json``, None unless
    ``with_spec``) in one statement, or JobNotFound."""
    row = None
    if "\x00" not in job_id:
        row = await reads.first(_READ_JOB[with_spec], {"job_id": job_id, "tenant_id": principal.tenant_id})
    if row is None:
        raise JobNotFound(job_id)
    return row


async def read_jobs(
    reads: Reads,
    principal: Principal,
    *,
    after: str | None = None,
    limit: int = 20,
    metadata: dict[str, str] | None = None,
    status: str | None = None,
    specs_known: Container[tuple[str, tuple[int, bool]]] = (),
    versions: Sequence[tuple[str, str]] | None = None,
) -> Page:
    """list_jobs for a read: a page of JOB_ROW rows, newest first, in one statement. The page's
    ``specs`` maps each listed id whose (id, :func:`spec_version`) is not in ``specs_known`` to its
    spec's text (one more statement, only when there is such an id). An ``after`` cursor is compared inside the statement; only an empty
    page looks for it (a second statement), to tell an unknown cursor (422) from the end of the list.
    A filter on metadata or status builds its statement per request: those go through the engine.
    ``versions``: the page's (id, version) pairs, where :func:`read_page_versions` has just read them."""
    params = {"tenant_id": principal.tenant_id, "limit": limit + 1, "after": after}
    if not metadata and not status and reads.on_loop:
        if versions is None:
            versions = await read_page_versions(reads, principal, after=after, limit=limit)
        rows = await _read_page_by_version(reads, principal.tenant_id, versions)
    elif not metadata and not status:
        rows = await reads.all(_READ_PAGE[bool(after)], params)
    else:
        q = _PAGE
        for key, value in (metadata or {}).items():
            q = q.where(_jobs.metadata[key].as_string() == value)
        if status:
            q = q.where(_jobs.status == status)
        if after:
            q = q.where(_AFTER_CURSOR)
        q = q.order_by(*_NEWEST_FIRST).limit(bindparam("limit"))
        rows = await reads.in_thread(lambda conn: conn.execute(q, params).all())
    if not rows and after and await reads.first(_CURSOR_EXISTS, params) is None:
        raise UnprocessableEntity(f"unknown cursor {after!r}", param="after", code="invalid_cursor")
    page = Page(rows[:limit], has_more=len(rows) > limit)
    page.specs = await read_specs(reads, principal, [r.id for r in page
                                                     if (r.id, spec_version(r.attempt, r.status)) not in specs_known])
    return page


class _RowVersions:
    """job id → (version, its JOB_ROW row) for the most recently read ``max_entries`` jobs."""

    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self.rows: OrderedDict[str, tuple[str, Row]] = OrderedDict()

    def get(self, job_id: str, version: str) -> Row | None:
        hit = self.rows.get(job_id)
        return hit[1] if hit is not None and hit[0] == version else None

    def put(self, job_id: str, version: str, row: Row) -> None:
        self.rows[job_id] = (version, row)
        self.rows.move_to_end(job_id)
        while len(self.rows) > self.max_entries:
            self.rows.popitem(last=False)


_ROW_VERSIONS = _RowVersions()


async def read_page_versions(reads: Reads, principal: Principal, *, after: str | None = None,
                             limit: int = 20) -> tuple[tuple[str, str], ...] | None:
    """The (id, row version) pairs of the unfiltered page read_jobs would answer (``limit`` + 1 rows,
    newest first), in one small statement; None where the store has no row versions (SQLite). Equal
    pairs mean every row on the page is the one read before: the list route answers that page's
    bytes again (api/schemas.py RenderedPages)."""
    if not reads.on_loop:
        return None
    params = {"tenant_id": principal.tenant_id, "limit": limit + 1, "after": after}
    return tuple((job_id, version) for job_id, version in await reads.all(_PAGE_VERSIONS[bool(after)], params))


async def _read_page_by_version(reads: Reads, tenant_id: str, page: Sequence[tuple[str, str]]) -> list:
    """The page's rows, on Postgres, from its (id, version) pairs (read_page_versions): whole rows
    only for the jobs not already held at that version (one statement, only then). A page that is
    polled again reads none of its JSON columns while its jobs are unchanged."""
    rows = {job_id: row for job_id, version in page if (row := _ROW_VERSIONS.get(job_id, version)) is not None}
    missing = [job_id for job_id, _ in page if job_id not in rows]
    if missing:
        for row in await reads.all(_ROWS_BY_ID, {"job_ids": missing, "tenant_id": tenant_id}):
            _ROW_VERSIONS.put(row.id, row.version, row)
            rows[row.id] = row
    return [rows[job_id] for job_id, _ in page if job_id in rows]  # one deleted in between is left out


async def read_specs(reads: Reads, principal: Principal, job_ids: list[str]) -> dict[str, str]:
    """job id → its spec's JSON text, for those of ``job_ids`` that are the tenant's. One statement
    (an expanding IN list, so through the engine: only views not yet cached need it)."""
    if not job_ids:
        return {}
    params = {"job_ids": job_ids, "tenant_id": principal.tenant_id}
    return await reads.in_thread(lambda conn: dict(conn.execute(_SPECS, params).tuples().all()))


# --- user actions -----------------------------------------------------------------------------


def cancel_job(session: Session, principal: Principal, job_id: str) -> Job:
    """Cancel at once in any non-terminal status. desired_state='cancel' tells the scheduler to stop
    the Ray job if one was submitted; later writes by that run fail because cancelled is terminal."""
    job = get_job(session, principal, job_id)
    if JobStatus(job.status).terminal:
        raise InvalidTransition(job_id, job.status, "cancelled", f"Job {job_id} is already {job.status}; it cannot be cancelled")
    job = transition(session, job_id, JobStatus.cancelled, desired_state="cancel")
    session.commit()
    return job


def pause_job(session: Session, principal: Principal, job_id: str) -> Job:
    """queued → paused now; validating_files/running → desired_state='pause' (the scheduler stops
    the run at a checkpoint and moves it to paused); paused or terminal → InvalidTransition."""
    job = get_job(session, principal, job_id)
    status = JobStatus(job.status)
    if status == JobStatus.queued:
        job = transition(session, job_id, JobStatus.paused, desired_state=None)
    elif status in (JobStatus.validating_files, JobStatus.running):
        if job.desired_state != "pause":
            job = _set_desired_state(session, job, "pause", "Pause requested")
    else:
        raise InvalidTransition(job_id, job.status, "paused", f"Job {job_id} is {job.status}; it cannot be paused")
    session.commit()
    return job


def resume_job(session: Session, principal: Principal, job_id: str) -> Job:
    """paused → queued (the scheduler resumes from the latest checkpoint); a pending pause request
    on a running job is withdrawn; anything else → InvalidTransition."""
    job = get_job(session, principal, job_id)
    status = JobStatus(job.status)
    if status == JobStatus.paused:
        job = transition(session, job_id, JobStatus.queued, desired_state=None, event_data={"resumed": True})
    elif job.desired_state == "pause" and not status.terminal:
        job = _set_desired_state(session, job, None, "Pause request withdrawn")
    else:
        raise InvalidTransition(job_id, job.status, "queued", f"Job {job_id} is {job.status}; only a paused job can be resumed")
    session.commit()
    return job


def _set_desired_state(session: Session, job: Job, desired: str | None, message: str) -> Job:
    result = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.status == job.status)
        .values(desired_state=desired, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        current = session.get(Job, job.id, populate_existing=True)
        raise InvalidTransition(job.id, current.status if current else None, job.status, f"Job {job.id} changed status meanwhile; retry")
    add_event(session, job.id, message, attempt=job.attempt)
    return session.get(Job, job.id, populate_existing=True)


# --- store functions for the scheduler and ingest ---------------------------------------------


def update_job(session: Session, job_id: str, *, expected_attempt: int | None = None, **fields: Any) -> Job:
    """Set non-status fields (lease, ray ids, plan, memory_summary, estimated_finish …), fenced on the
    attempt like transition(). Raises JobNotFound or StaleAttempt. The caller commits."""
    if "status" in fields:
        raise TypeError("status changes go through service.store.transitions.transition")
    stmt = update(Job).where(Job.id == job_id)
    if expected_attempt is not None:
        stmt = stmt.where(Job.attempt == expected_attempt)
    result = session.execute(
        stmt.values(updated_at=utcnow(), **fields).execution_options(synchronize_session=False)
    )
    job = session.get(Job, job_id, populate_existing=True)
    if job is None:
        raise JobNotFound(job_id)
    if result.rowcount != 1:
        raise StaleAttempt(job_id, expected_attempt, job.attempt)
    return job


def lock_job_events(session: Session, job_id: str) -> None:
    """Take ``job_id``'s row lock for the rest of the transaction, before any of its events get an id.

    Why: an SSE stream or a page follows ``id > cursor``. Postgres hands out ``job_events.id`` when a
    row is inserted, not when it commits, so two writers of one job's events could commit ids out of
    order (15 visible before 14), and a reader that saw 15 would never deliver 14. With every writer
    of a job's events holding the job's row lock from before its first insert until it commits, the
    writers of one job take turns: the next one gets its ids only after the previous one committed
    (Postgres makes a commit visible before it releases the row lock), so the ids a reader can see are
    always a prefix of the job's ids in commit order.

    ``FOR NO KEY UPDATE`` is the lock an ``UPDATE jobs …`` (``transition``, the scheduler's field
    updates) takes anyway and conflicts with ingest's ``FOR UPDATE``, yet not with the ``KEY SHARE``
    that foreign-key checks (checkpoints, memory samples) take, so it orders event writers and nothing
    else. Taking it again in the same transaction is free. SQLite needs nothing: it lets one writer at
    a time in and hands out the ids under that write lock.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(Job.id).where(Job.id == job_id).with_for_update(key_share=True))


def add_event(
    session: Session,
    job_id: str,
    message: str,
    *,
    level: str = "info",
    type: str = "message",
    data: dict[str, Any] | None = None,
    attempt: int | None = None,
    dedupe_key: str | None = None,
    created_at: datetime | None = None,
) -> bool:
    """Append an event; with ``dedupe_key`` a repeated key for the job is ignored. Returns whether it was stored.

    Holds the job's row lock until the caller commits (:func:`lock_job_events`): ids commit in order."""
    row = {
        "job_id": job_id,
        "message": message,
        "level": level,
        "type": type,
        "data": data,
        "attempt": attempt,
        "dedupe_key": dedupe_key,
        "created_at": created_at or utcnow(),
    }
    lock_job_events(session, job_id)
    return insert_ignoring_conflicts(session, JobEvent, [row], ["job_id", "dedupe_key"]) == 1


def add_events(session: Session, job_id: str, events: Iterable[dict[str, Any]]) -> int:
    """Bulk add_event: dicts with add_event's keyword names. Returns how many were new.

    Holds the job's row lock until the caller commits, like add_event."""
    now = utcnow()
    rows = [
        {
            "job_id": job_id,
            "level": "info",
            "type": "message",
            "data": None,
            "attempt": None,
            "dedupe_key": None,
            **e,
            "created_at": e.get("created_at") or now,
        }
        for e in events
    ]
    if not rows:
        return 0
    lock_job_events(session, job_id)
    return insert_ignoring_conflicts(session, JobEvent, rows, ["job_id", "dedupe_key"])


def store_events(session: Session, job_id: str, events: list[dict[str, Any]]) -> list[str | None]:
    """add_events answering the dedupe keys of the events it stored (None for one without a key), in
    order: ingest folds the new metrics events, and only those, into the job's series. Holds the job's
    row lock until the caller commits, like add_events."""
    if not events:
        return []
    now = utcnow()
    rows = [{"job_id": job_id, "level": "info", "type": "message", "data": None, "attempt": None,
             "dedupe_key": None, **e, "created_at": e.get("created_at") or now} for e in events]
    lock_job_events(session, job_id)
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    t = JobEvent.__table__
    stmt = insert(t).on_conflict_do_nothing(index_elements=["job_id", "dedupe_key"]).returning(t.c.dedupe_key)
    # insertmanyvalues with RETURNING: the rows returned are exactly those inserted.
    return [k for (k,) in session.execute(stmt, rows if len(rows) > 1 else rows[0]).all()]


def event_public_id(event_id: int) -> str:
    return f"ftevent-{event_id}"


def parse_event_cursor(after: str) -> int:
    raw = after.removeprefix("ftevent-")
    if not raw.isdigit():
        raise UnprocessableEntity(f"unknown cursor {after!r}", param="after", code="invalid_cursor")
    return int(raw)


def list_events(
    session: Session, principal: Principal, job_id: str, *, after: str | None = None, limit: int = 20
) -> Page:
    """Newest first, like OpenAI; ``after`` is the last event id of the previous page."""
    get_job(session, principal, job_id)
    q = select(JobEvent).where(JobEvent.job_id == job_id)
    if after:
        q = q.where(JobEvent.id < parse_event_cursor(after))
    return fetch_page(session, q.order_by(JobEvent.id.desc()), limit)


def events_since(session: Session, job_id: str, last_id: int = 0, *, limit: int = 500) -> list[JobEvent]:
    """Oldest first after ``last_id`` (an SSE Last-Event-ID): the stream resumes with no gap or duplicate."""
    q = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.id > last_id).order_by(JobEvent.id).limit(limit)
    return list(session.scalars(q))


def add_checkpoint(
    session: Session, job_id: str, *, attempt: int, step: int, path: str, metrics: dict[str, Any] | None = None
) -> bool:
    """Record a checkpoint; a second one at the same step of the job is ignored. Returns whether stored."""
    row = {"id": new_id("ftckpt-"), "job_id": job_id, "attempt": attempt, "step": step, "path": path,
           "metrics": metrics or {}, "created_at": utcnow()}
    return insert_ignoring_conflicts(session, Checkpoint, [row], ["job_id", "step"]) == 1


def list_checkpoints(
    session: Session, principal: Principal, job_id: str, *, after: str | None = None, limit: int = 10
) -> Page:
    """Newest (highest step) first; ``after`` is the last checkpoint id of the previous page."""
    get_job(session, principal, job_id)
    q = select(Checkpoint).where(Checkpoint.job_id == job_id)
    if after:
        cursor = session.get(Checkpoint, after)
        if cursor is None or cursor.job_id != job_id:
            raise UnprocessableEntity(f"unknown cursor {after!r}", param="after", code="invalid_cursor")
        q = q.where(Checkpoint.step < cursor.step)
    return fetch_page(session, q.order_by(Checkpoint.step.desc()), limit)


def latest_checkpoint(session: Session, job_id: str) -> Checkpoint | None:
    return session.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc()).limit(1))


def add_memory_samples(session: Session, job_id: str, records: Iterable[Any]) -> int:
    """Store MemoryRecord objects (service.domain.records) or dicts; a repeated (attempt, rank, step, phase)
    is ignored. Returns how many were new."""
    return len(store_memory_samples(session, job_id, records))


def store_memory_samples(session: Session, job_id: str, records: Iterable[Any]) -> list[dict[str, Any]]:
    """add_memory_samples answering the rows it stored (those whose (attempt, rank, step, phase) was new,
    the first of repeats within ``records``), for ingest to fold into the job's series exactly once."""
    rows, seen = [], set()
    for r in records:
        d = r.model_dump() if hasattr(r, "model_dump") else dict(r)
        row = {"job_id": job_id, "attempt": d["attempt"], "rank": d["rank"], "step": d["step"],
               "phase": d.get("phase", "step"), "source": d.get("source", "counters"),
               "device": d.get("device") or None, "created_at": utcnow()}
        row.update({c: d.get(c) for c in MEMORY_BYTE_COLUMNS})
        key = (row["attempt"], row["rank"], row["step"], row["phase"])
        if key not in seen:
            seen.add(key)
            rows.append(row)
    if not rows:
        return []
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    t = MemorySample.__table__
    stmt = (insert(t).on_conflict_do_nothing(index_elements=["job_id", "attempt", "rank", "step", "phase"])
            .returning(t.c.attempt, t.c.rank, t.c.step, t.c.phase))
    # insertmanyvalues with RETURNING: the rows returned are exactly those inserted.
    new = {tuple(k) for k in session.execute(stmt, rows if len(rows) > 1 else rows[0]).all()}
    return [r for r in rows if (r["attempt"], r["rank"], r["step"], r["phase"]) in new]


def plan_memory(session: Session, principal: Principal, settings: Settings, body: Any, *, gpu: str | None = None,
                known_gpus: set[str] | None = None):
    """``POST /v1/memory/plan``: the plan of a create body; with a ``training_file`` (the tenant's: another
    tenant's id is FileNotFound, as at creation) the plan is for that file's rows."""
    return memory.plan_request(body, settings, gpu=gpu, known_gpus=known_gpus,
                               training_path=lambda file_id: local_path(settings, get_file(
                                   session, principal, file_id, param="training_file").path))


def get_job_memory(session: Session, principal: Principal, job_id: str) -> dict[str, Any]:
    """The tenant's job's memory view, predicted against measured (JobNotFound for another tenant's id):
    whole-run peaks and a bounded number of points per rank (service/jobs/series.py)."""
    job = get_job(session, principal, job_id)
    return memory_view(session, job)


def memory_view(session: Session, job: Any) -> dict[str, Any]:
    """job_memory_view over the job's series: its latest attempt's whole-run peaks per rank, and per
    rank the last series.RECENT_STEPS steps' samples after at most series.MAX_BUCKETS older buckets.
    ``job`` needs id, status, attempt, plan and memory_summary (the dashboard passes its own plan)."""
    hs = series.heads(session, job.id, series.MEMORY)
    attempt, peaks = series.memory_peaks(hs)
    if attempt is None:
        return job_memory_view(job, [])
    buckets, raw = series.memory_points(session, job.id, attempt, hs)
    return job_memory_view(job, raw, peaks=peaks, attempt=attempt, buckets=buckets,
                           phase_samples=phase_samples(session, job.id, attempt))


def phase_samples(session: Session, job_id: str, attempt: int) -> list[MemorySample]:
    """The attempt's samples of the job's phases outside the step (load, eval, checkpoint, export): a few per
    rank, whatever the run's length (workers/telemetry.py PhaseMeter)."""
    from service.memory.compare import MEASURED_PHASES

    return list(session.scalars(select(MemorySample).where(
        MemorySample.job_id == job_id, MemorySample.attempt == attempt, MemorySample.phase.in_(MEASURED_PHASES))
        .order_by(MemorySample.rank, MemorySample.step)))


def list_memory_samples(
    session: Session, job_id: str, *, attempt: int | None = None, after_id: int = 0, limit: int = 1_000
) -> list[MemorySample]:
    """One page of a job's raw samples in the order stored (``after_id``: the last id of the previous
    page). Views read the bounded series instead (memory_view)."""
    q = select(MemorySample).where(MemorySample.job_id == job_id, MemorySample.id > after_id)
    if attempt is not None:
        q = q.where(MemorySample.attempt == attempt)
    return list(session.scalars(q.order_by(MemorySample.id).limit(limit)))


def purge_idempotency_keys(session: Session, older_than: timedelta = IDEMPOTENCY_TTL) -> int:
    """Delete keys past their 24 h life (the scheduler's loop calls this every few minutes; a request
    that meets an expired key also replaces it). Caller commits. Returns the keys deleted."""
    cutoff = utcnow() - older_than
    return session.execute(delete(IdempotencyKey).where(IdempotencyKey.created_at < cutoff)).rowcount or 0
