"""The scheduler: moves jobs from the Postgres queue onto a Ray cluster and keeps both views agreeing.

One loop (``Scheduler.tick``, every ``settings.poll_seconds``, or at once when :func:`wake` is called
after a job was created in this process) does, in order:

1. **heartbeat** — renew the lease on every job this scheduler owns (``lease_owner = me``); ``run``
   also renews them from a thread of its own every quarter lease, so a slow tick does not let them
   lapse (while the loop is alive: not once a tick is stuck for three leases);
2. **validate** — jobs in ``validating_files``, taken under a validation lease and validated outside
   any transaction (no row lock is held while files are read, so a cancel never waits): files exist
   and parse, the model resolves, the memory pre-flight (:func:`memory_preflight`) runs → ``queued``
   or ``failed`` with a structured error;
3. **adopt** — ``running`` jobs whose lease expired (their scheduler died) get a new owner. The
   attempt does *not* change: if their Ray submission is still alive it is kept, not resubmitted;
4. **claim** — ``queued`` jobs are claimed with ``SELECT … FOR UPDATE SKIP LOCKED`` (on SQLite the
   lock clause is a no-op and the fenced UPDATE in :func:`service.store.transitions.transition` is what makes a
   claim exclusive — fine for its single scheduler): ``attempt += 1``, a lease, a fresh ingest
   token; then the run request is written and submitted through the Ray Jobs API as
   ``memfit-<job id>-<attempt>``. Ray refuses a second submission with the same id, so a retried or
   duplicated submit cannot start the job twice ("already exists" counts as success);
5. **reconcile** — Ray's status of each owned job is compared with the database: FAILED → ``failed``
   with the driver's error type and last log lines, STOPPED → ``cancelled``/``paused`` when the user
   asked for it, a submission Ray no longer knows (head restart: believed after three answers over
   ten seconds) or whose supervisor died with its node → ``queued`` again, so the next claim resubmits
   it as a new attempt, in a folder of its own, that resumes from the latest recorded checkpoint;
   jobs already terminal or paused in the database whose Ray job still runs are stopped. A run that
   ended (or was lost) with records its sink never got confirmed — the API was away — has them
   stored from its spool first (``metrics-attempt-N.jsonl``, service/store/spool.py) through
   service.jobs.ingest, so a result or failure record in it ends the job as the run did.

The run request (with the attempt's ingest token) is written under ``<storage>/requests/``, outside
the job's output folder that tenants read artefacts from.

The database, not Ray, is the source of truth; every status write is fenced on the attempt number
and, for the scheduler's own writes, on its lease (``expected_owner``), so a scheduler that lost its
lease (or a late worker) cannot overwrite newer state; no Ray call may take longer than half a lease.
Each attempt writes into ``jobs/<id>/attempts/<n>`` (paths.attempt_dir) and only its records are
stored, so an earlier attempt that still runs somewhere can neither overwrite what the current one
reads nor have its outputs served.

Running the code on the cluster: the entrypoint is ``<python> -m workers.run <request.json>``. By
default the ``service`` and ``workers`` packages are shipped with the job as runtime_env
``py_modules`` (zipped once per content hash and cached in the cluster's GCS), so a local head and a
KubeRay cluster run exactly the scheduler's code; the cluster image only needs the training
dependencies (deploy/Dockerfile has them and memfit itself, so MEMFIT_RAY_SHIP_CODE=0 works there
too). ``<python>`` is this process's interpreter for a cluster on this host (loopback address) and
``python`` — the image's — otherwise; MEMFIT_RAY_PYTHON overrides both. Job storage
(``settings.storage_dir``) must be a path every Ray node sees at the same place: the local disk here,
a shared volume (NFS/EFS/Filestore PVC) mounted on the head and workers on KubeRay.
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import shutil
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from service.domain.errors import (
    RUN_LOST_EXIT_CODE,
    ErrorInfo,
    InvalidTransition,
    JobNotFound,
    StaleAttempt,
)
from service.domain.model_ref import resolve_model
from service.domain.spec import JobSpec, RunRequest
from service.domain.states import EVENT_MESSAGES, TERMINAL, JobStatus
from service.domain.storage import ObjectStore, StorageEscape, join, local_path, object_store
from service.domain.units import human_bytes
from service.jobs import ingest, metrics, quotas
from service.jobs.claimed_paths import contained, located
from service.jobs.crud import add_event, purge_idempotency_keys
from service.memory.elastic import world_plans
from service.scheduler import faults
from service.scheduler.paths import (
    INGEST_PATH,
    attempt_dir,
    job_dir,
    request_path,
    spool_path,
    submission_id,
)
from service.scheduler.ray_jobs import (
    RAY_ACTIVE,
    LogCursor,
    RayJobs,
    RayUnavailable,
)
from service.scheduler.validate import ValidationFailed, validate_job
from service.settings import Settings
from service.store import spool
from service.store.models import Checkpoint, File, Job, JobEvent, SeriesHead, utcnow
from service.store.tokens import new_ingest_token
from service.store.transitions import transition

log = logging.getLogger("memfit.scheduler")

# Ray's error types for a run lost with its infrastructure (the supervisor actor, on the head or a
# node, died), as opposed to the entrypoint failing: such a run is resubmitted, not failed.
RAY_LOST_RUN = frozenset({"JOB_SUPERVISOR_ACTOR_DIED", "JOB_SUPERVISOR_ACTOR_UNKNOWN_FAILURE"})
LOST_REASONS = frozenset({"ray_submission_missing", "ray_run_lost"})


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --- the scheduler ------------------------------------------------------------------------------


@dataclass
class _Watch:
    """What the loop remembers about one owned job between ticks (never needed for correctness)."""

    ray_terminal_since: float | None = None
    pause_from_step: int | None = None
    pause_since: float | None = None
    logs_checked_at: float = 0.0
    log: LogCursor = field(default_factory=LogCursor)
    log_of: str | None = None  # the submission whose driver log ``log`` reads
    restarts_seen: int = 0
    retries_told: set = field(default_factory=set)  # (source, error count) of Ray Train retries already told
    missing_since: float | None = None  # Ray first answered "no such submission"
    missing_answers: int = 0
    # Progress, for stall detection: the attempt watched, its first and latest step seen (with when
    # this loop first saw each), and the spec's stall bound and restart budget.
    progress_of: int | None = None
    first_step: tuple[int, float] | None = None
    last_step: tuple[int, float] | None = None
    progress_checked_at: float = 0.0
    stall_limits: tuple[float | None, int] | None = None
    late_checked_at: float = 0.0  # when earlier attempts were last looked for in Ray (late submissions)
    # Capacity: when the cluster was last compared with the job's demand, since when it cannot hold it,
    # the bound on that wait, and how many workers fit when last told (an event per change).
    capacity_checked_at: float = 0.0
    short_since: float | None = None
    short_bound_s: float = 0.0
    told_fit: int | None = None


@dataclass
class Scheduler:
    sessions: sessionmaker[Session]
    settings: Settings
    ray: RayJobs
    owner: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}")
    batch: int = 8
    # How long a terminal Ray status may wait for the worker's result/failure record to arrive.
    result_grace_s: float = 5.0
    # Pause waits for the next checkpoint, at most this long, then stops anyway.
    pause_timeout_s: float = 120.0
    # A run that ended itself (result/failure posted) gets this long to exit before it is stopped.
    exit_grace_s: float = 30.0
    # How often a running job's Ray log is scanned for Ray Train worker-group restarts: its new bytes
    # where the driver log is a file on this host, else the whole log through the Jobs API, 5× less often.
    restart_check_s: float = 3.0
    extra_env: dict[str, str] = field(default_factory=dict)
    # How often the loop deletes Idempotency-Keys past their 24 h life.
    purge_every_s: float = 300.0
    # A submission Ray says it does not know is requeued only after Ray said so this many times in a
    # row, over at least vanish_confirm_s (a head that restarts answers "does not exist" while its
    # GCS reloads; one answer is no proof the run is gone).
    vanish_confirm_s: float = 10.0
    vanish_confirm_answers: int = 3
    # How many times a job is resubmitted after Ray lost its run before it fails ray_run_lost.
    max_lost_runs: int = 3
    # A running job whose ranks report no new step for longer than stall_factor × its mean step time
    # so far (at least stall_floor_s; the spec's training.stall_timeout_s instead, if given) has
    # stalled: a node that died mid-collective leaves the others waiting with no error (gloo, NCCL).
    stall_floor_s: float = 300.0
    stall_factor: float = 10.0
    # How often a running attempt > 1 looks for an earlier attempt Ray runs (a late submission).
    late_check_s: float = 15.0
    # How often a running job's demand is compared with the live nodes (service/scheduler/capacity.py),
    # and how long a job the cluster cannot hold waits for a node before it fails insufficient_resources:
    # capacity_factor × its start-up time (submission to first step), at least capacity_floor_s.
    capacity_check_s: float = 5.0
    capacity_floor_s: float = 60.0
    capacity_factor: float = 3.0
    _watch: dict[str, _Watch] = field(default_factory=dict)
    _unsubmitted: dict[tuple[str, int], str] = field(default_factory=dict)  # deferred submissions → token
    _last_heartbeat: float = 0.0
    _last_purge: float | None = None
    _tick_started: float | None = None

    def __post_init__(self) -> None:
        # No single Ray call may outlive a lease: one that hangs past half of it is given up (the
        # loop retries next tick), so the scheduler acts on Ray's answers while it still holds the
        # jobs — and every write it then makes is fenced on its lease (transition's expected_owner).
        self.ray.call_timeout_s = min(self.ray.call_timeout_s, self.settings.lease_seconds / 2)

    # ---- the loop ----

    def run(self, stop: threading.Event) -> None:
        log.info("scheduler %s polling every %.2f s (lease %.0f s, Ray %s)", self.owner,
                 self.settings.poll_seconds, self.settings.lease_seconds, self.ray.address)
        beats = threading.Thread(target=self._keep_leases, args=(stop,), name="memfit-heartbeat", daemon=True)
        beats.start()
        woken = threading.Event()
        _WAKERS.add(woken)
        try:
            while not stop.is_set():
                woken.clear()  # a wake() during the tick runs the next one at once
                self.tick()
                _wait(stop, woken, self.settings.poll_seconds)
        finally:
            _WAKERS.discard(woken)
        beats.join(self.settings.lease_seconds)
        try:
            self.release_all()
        except OperationalError as exc:  # stopping while the database is away: the leases just expire
            log.warning("could not release leases (database unavailable): %s", _first_line(exc.orig or exc))

    def _keep_leases(self, stop: threading.Event) -> None:
        """Renew the leases every quarter lease from a thread of its own, so a tick slowed by Ray
        (each call bounded by half a lease) or by a long validation does not let them lapse — but
        only while the loop is alive: a tick stuck for three leases stops renewing, and another
        scheduler adopts the jobs."""
        while not stop.wait(self.settings.lease_seconds / 4):
            started = self._tick_started
            if started is not None and time.monotonic() - started > 3 * self.settings.lease_seconds:
                log.warning("scheduler tick stuck for %.0f s: leases not renewed", time.monotonic() - started)
                continue
            try:
                self.heartbeat(force=True)
            except OperationalError as exc:
                log.warning("heartbeat failed (database unavailable): %s", _first_line(exc.orig or exc))
            except Exception:  # noqa: BLE001 - the next beat retries
                log.exception("heartbeat failed")

    def tick(self) -> None:
        self._tick_started = time.monotonic()
        try:
            self._tick()
        finally:
            self._tick_started = None

    def _tick(self) -> None:
        for step in (self.heartbeat, self.validate_pending, self.adopt_expired, self.claim_and_submit,
                     self.reconcile, self.purge_expired_keys):
            try:
                step()
            except RayUnavailable as exc:
                log.warning("Ray unavailable during %s: %s", step.__name__, exc)
            except OperationalError as exc:  # the database is away (restart, failover): next tick retries
                log.warning("database unavailable during %s: %s", step.__name__, _first_line(exc.orig or exc))
            except Exception:  # noqa: BLE001 - one bad tick must not end the loop
                log.exception("scheduler %s failed", step.__name__)

    @property
    def lease(self) -> timedelta:
        return timedelta(seconds=self.settings.lease_seconds)

    def heartbeat(self, force: bool = False) -> int:
        now = time.monotonic()
        if not force and now - self._last_heartbeat < self.settings.lease_seconds / 4:
            return 0
        self._last_heartbeat = now
        with self.sessions.begin() as s:
            result = s.execute(
                update(Job)
                .where(Job.lease_owner == self.owner,
                       Job.status.in_([JobStatus.running.value, JobStatus.validating_files.value]))
                .values(lease_expires_at=utcnow() + self.lease)
                .execution_options(synchronize_session=False)
            )
            return result.rowcount

    def release_all(self) -> None:
        """Give up every lease at a clean shutdown so another scheduler adopts the jobs at once."""
        with self.sessions.begin() as s:
            s.execute(
                update(Job)
                .where(Job.lease_owner == self.owner)
                .values(lease_expires_at=utcnow())
                .execution_options(synchronize_session=False)
            )

    def purge_expired_keys(self, force: bool = False) -> int:
        """Delete expired Idempotency-Keys, at most every ``purge_every_s`` (any scheduler may: the
        DELETE is idempotent). Without this, a key is only ever replaced when its tenant reuses it."""
        now = time.monotonic()
        if not force and self._last_purge is not None and now - self._last_purge < self.purge_every_s:
            return 0
        self._last_purge = now
        with self.sessions.begin() as s:
            return purge_idempotency_keys(s)

    # ---- validating_files ----

    def validate_pending(self) -> int:
        """validating_files → queued or failed, in three steps so that no row lock is held while the
        files are read (up to eight of max_upload_bytes each) and the planner runs — a cancel of a
        job being validated must not wait for it:

        1. a short transaction takes up to ``batch`` jobs nobody is validating (``SKIP LOCKED``, and
           a validation lease: ``lease_owner`` = this scheduler until ``lease_expires_at``);
        2. each is validated outside any transaction;
        3. a short transaction per job moves it on, fenced on the status and on this scheduler still
           holding the lease: a job cancelled (or taken over) meanwhile is left as it is."""
        now = utcnow()
        with self.sessions.begin() as s:
            ids = list(s.scalars(
                select(Job.id)
                .where(Job.status == JobStatus.validating_files.value,
                       or_(Job.lease_owner.is_(None), Job.lease_expires_at.is_(None), Job.lease_expires_at < now))
                .order_by(Job.created_at)
                .limit(self.batch)
                .with_for_update(skip_locked=True)
            ))
            if ids:
                s.execute(update(Job).where(Job.id.in_(ids))
                          .values(lease_owner=self.owner, lease_expires_at=now + self.lease)
                          .execution_options(synchronize_session=False))
        done = 0
        for job_id in ids:
            with self.sessions() as s:  # reads only; closed before the result is written
                job = s.get(Job, job_id)
                if job is None or job.status != JobStatus.validating_files.value or job.lease_owner != self.owner:
                    continue
                try:
                    _, plan = validate_job(s, job, self.settings)
                    failure = None
                except ValidationFailed as exc:
                    plan, failure = None, exc.error
            with self.sessions.begin() as s:
                mine = {"expected_owner": self.owner, "lease_owner": None, "lease_expires_at": None}
                if failure is not None:
                    moved = _try(transition, s, job_id, JobStatus.failed, error=failure, event_data={"error": failure},
                                 **mine)
                    metrics.SCHEDULER_FAILURES.labels(failure["code"]).inc()  # /metrics
                else:
                    fields = {"plan": plan} if plan is not None else {}
                    moved = _try(transition, s, job_id, JobStatus.queued, **fields, **mine)
                    if moved is not None and moved.desired_state == "pause":  # paused while validating
                        _try(transition, s, job_id, JobStatus.paused, desired_state=None)
                if moved is None:  # cancelled meanwhile: the validation lease goes with it (if still ours)
                    s.execute(update(Job).where(Job.id == job_id, Job.lease_owner == self.owner,
                                                Job.status != JobStatus.running.value)
                              .values(lease_owner=None, lease_expires_at=None)
                              .execution_options(synchronize_session=False))
            done += 1
        return done

    # ---- claim ----

    def claim(self, limit: int | None = None) -> list[tuple[str, int, str]]:
        """Claim queued jobs: → running, attempt + 1, leased to us, a fresh ingest token.
        Returns (job id, attempt, ingest token) for each job this call won."""
        won: list[tuple[str, int, str]] = []
        with self.sessions.begin() as s:
            jobs = s.scalars(
                select(Job)
                .where(Job.status == JobStatus.queued.value, quotas.claimable(self.settings))
                .order_by(Job.created_at, Job.id)
                .limit(limit or self.batch)
                .with_for_update(skip_locked=True)
            ).all()
            for job in jobs:
                if not quotas.may_start(s, job.tenant_id, self.settings):
                    continue  # the tenant is at quota_running_jobs: the job stays queued
                attempt = job.attempt + 1
                token, token_hash = new_ingest_token()
                now = utcnow()
                try:
                    transition(
                        s, job.id, JobStatus.running, expected_attempt=job.attempt,
                        attempt=attempt, lease_owner=self.owner, lease_expires_at=now + self.lease,
                        ingest_token_hash=token_hash, ray_submission_id=submission_id(job.id, attempt),
                        ray_status=None, desired_state=None, started_at=job.started_at or now,
                        output_dir=str(attempt_dir(self.settings, job.id, attempt)),
                        event_data={"attempt": attempt, "scheduler": self.owner},
                    )
                except (StaleAttempt, InvalidTransition):
                    continue  # another claimer won it (SQLite) — not ours
                faults.point("claim")
                won.append((job.id, attempt, token))
                metrics.SCHEDULER_CLAIMS.inc()  # /metrics
        return won

    def claim_and_submit(self) -> int:
        claimed = self.claim()
        for job_id, attempt, token in claimed:
            self.submit(job_id, attempt, token)
        return len(claimed)

    def run_request(self, s: Session, job: Job, attempt: int, token: str) -> RunRequest:
        spec = JobSpec.model_validate(job.spec)
        training = s.get(File, spec.training_file)
        validation = s.get(File, spec.validation_file) if spec.validation_file else None
        out = attempt_dir(self.settings, job.id, attempt)
        model_path = resolve_model(spec.model, self.settings.model_dirs).local_dir
        store = object_store(self.settings)
        return RunRequest(
            job_id=job.id,
            attempt=attempt,
            spec=spec,
            training_path=training.path,
            validation_path=validation.path if validation else None,
            model_path=model_path,
            output_dir=str(out),
            object_store=store,
            output_uri=store.uri(store.key_for(self.settings.storage_dir, out)) if store is not None else None,
            resume_from=self._stage_resume(s, job.id, attempt, out),
            ingest_url=self.settings.api_url.rstrip("/") + INGEST_PATH.format(job_id=job.id),
            ingest_token=token,
            metrics_path=str(spool_path(self.settings, job.id, attempt)),
            plan=job.plan,
            # resources.min_workers: each smaller world size re-planned before the run (service/memory/elastic.py)
            world_sizes=world_plans(spec, self.settings, model_path=model_path,
                                    training_path=local_path(self.settings, training.path)),
        )

    def _stage_resume(self, s: Session, job_id: str, attempt: int, out: Path) -> str | None:
        """The checkpoint this attempt starts from: the newest one the database recorded (only the
        attempt then current could record it) whose folder is still there, hard-linked into
        ``<attempt>/resume`` — an earlier attempt's Ray Train, should it still run, deletes its old
        checkpoints as it makes new ones (num_to_keep), and a link keeps the files alive. Staged
        once per attempt (a retried submission reuses it); None when there is nothing to resume.
        On object storage the checkpoint is copied inside the bucket instead (:meth:`_stage_resume_in_store`)."""
        store = object_store(self.settings)
        if store is not None:
            return self._stage_resume_in_store(s, store, job_id, attempt, out)
        staged = out / "resume"
        if (staged / "meta.json").is_file():
            return str(staged)
        rows = s.execute(select(Checkpoint.step, Checkpoint.path, Checkpoint.attempt)
                         .where(Checkpoint.job_id == job_id, Checkpoint.attempt < attempt)
                         .order_by(Checkpoint.step.desc()).limit(10)).all()
        for step, path, from_attempt in rows:
            src = located(attempt_dir(self.settings, job_id, from_attempt), path)
            # A stored path is a worker's claim: link only from this job's own folders (resolved), never
            # another job's, an upload, or anything a symlink reaches (service/jobs/claimed_paths.py).
            if not contained(job_dir(self.settings, job_id), src):
                log.warning("job %s: not resuming from %s: outside the job's own folders", job_id, path)
                continue
            if not (src / "meta.json").is_file():
                continue
            part = out / "resume.part"
            if part.exists():
                shutil.rmtree(part)
            _link_tree(src, part)
            os.replace(part, staged)
            with self.sessions.begin() as w:
                add_event(w, job_id, f"Attempt {attempt} resumes from the checkpoint of step {step} (attempt {from_attempt})",
                          attempt=attempt, dedupe_key=f"resume-from:{attempt}",
                          data={"step": step, "checkpoint": path, "from_attempt": from_attempt, "attempt": attempt})
            return str(staged)
        return None

    def _stage_resume_in_store(self, s: Session, store: ObjectStore, job_id: str, attempt: int, out: Path) -> str | None:
        """:meth:`_stage_resume` in the bucket: the newest recorded checkpoint whose ``meta.json`` is there,
        copied server-side to ``<attempt>/resume/`` (``meta.json`` last, so a copy cut short is not taken
        for a staged one); its ``s3://`` URI, which the workers download (workers/steps.py: latest_checkpoint)."""
        storage_dir = self.settings.storage_dir
        staged = store.key_for(storage_dir, out / "resume")
        if store.size(join(staged, "meta.json")) is not None:
            return store.uri(staged)
        own = store.key_for(storage_dir, job_dir(self.settings, job_id))
        rows = s.execute(select(Checkpoint.step, Checkpoint.path, Checkpoint.attempt)
                         .where(Checkpoint.job_id == job_id, Checkpoint.attempt < attempt)
                         .order_by(Checkpoint.step.desc()).limit(10)).all()
        for step, path, from_attempt in rows:
            # A stored path is a worker's claim: only under this job's own prefix; '..' is refused, not folded.
            try:
                src = store.key_for(storage_dir, located(attempt_dir(self.settings, job_id, from_attempt), path))
            except StorageEscape:
                src = None
            if src is None or not src.startswith(own + "/"):
                log.warning("job %s: not resuming from %s: outside the job's own folders", job_id, path)
                continue
            if store.size(join(src, "meta.json")) is None:
                continue
            store.delete_tree(staged)
            store.copy_tree(src, staged, last="meta.json")
            with self.sessions.begin() as w:
                add_event(w, job_id, f"Attempt {attempt} resumes from the checkpoint of step {step} (attempt {from_attempt})",
                          attempt=attempt, dedupe_key=f"resume-from:{attempt}",
                          data={"step": step, "checkpoint": store.uri(src), "from_attempt": from_attempt, "attempt": attempt})
            return store.uri(staged)
        return None

    def _fence(self, job_id: str, attempt: int) -> bool:
        """Act on Ray for this job only under a lease held at that moment: renew this scheduler's lease
        on the job if — and only if — it holds it now (running, this attempt, its owner, not expired).
        True then, and no other scheduler can adopt the job for a whole lease: longer than the one Ray
        call that follows, which is given up after half a lease. False: the job is another's (or moved
        on), and this scheduler does nothing to it in Ray. A scheduler paused past that call's end (a
        stopped VM) can still make a late submission: any scheduler that sees it stops it
        (:meth:`_stop_late_submissions`)."""
        now = utcnow()
        with self.sessions.begin() as s:
            result = s.execute(
                update(Job)
                .where(Job.id == job_id, Job.attempt == attempt, Job.status == JobStatus.running.value,
                       Job.lease_owner == self.owner, Job.lease_expires_at > now)
                .values(lease_expires_at=now + self.lease)
                .execution_options(synchronize_session=False)
            )
            held = result.rowcount == 1
        if not held:
            log.info("job %s attempt %s: not acting on Ray, the lease is not %s's now", job_id, attempt, self.owner)
        return held

    def _stop_late_submissions(self, job_id: str, attempt: int, watch: _Watch) -> None:
        """Stop any earlier attempt of the job that Ray runs while ``attempt`` is current: a submission
        that arrived late (a scheduler that lost its lease mid-call and sent it anyway). Checked when a
        new attempt is submitted and then every ``late_check_s`` while it runs."""
        now = time.monotonic()
        if now - watch.late_checked_at < self.late_check_s:
            return
        watch.late_checked_at = now
        self._stop_earlier_attempts(job_id, attempt)

    def _stop_earlier_attempts(self, job_id: str, attempt: int) -> None:
        """A new attempt fences the ones before it in Ray too: any of them still running (a head
        restart that only lost track of it) is stopped. Its records are refused anyway (ingest is
        fenced on the attempt) and its files are in its own folder."""
        for earlier in range(attempt - 1, max(0, attempt - 4), -1):
            sid = submission_id(job_id, earlier)
            try:
                st = self.ray.status(sid)
                if st is not None and st.status in RAY_ACTIVE and self._fence(job_id, attempt):
                    self.ray.stop(sid)
                    with self.sessions.begin() as s:
                        add_event(s, job_id, f"Stopping {sid}, an earlier attempt still running in Ray", level="warn",
                                  attempt=attempt, dedupe_key=f"stop-earlier:{attempt}:{earlier}",
                                  data={"submission_id": sid, "attempt": attempt})
            except RayUnavailable as exc:
                log.warning("could not check %s: %s", sid, exc)

    def submit(self, job_id: str, attempt: int, token: str) -> None:
        sid = submission_id(job_id, attempt)
        with self.sessions() as s:
            job = s.get(Job, job_id)
            if (job is None or job.attempt != attempt or job.status != JobStatus.running.value
                    or job.lease_owner != self.owner):
                return
            try:
                request = self.run_request(s, job, attempt, token)
            except Exception as exc:  # noqa: BLE001 - e.g. a file deleted since validation
                self._fail(job_id, attempt, "submission_failed", f"could not build the run request: {exc}")
                return
            # What the tenant may still store: the workers check it before each checkpoint and export.
            budget = quotas.storage_budget(s, job.tenant_id, self.settings)
        Path(request.output_dir).mkdir(parents=True, exist_ok=True)
        if attempt > 1:
            self._stop_earlier_attempts(job_id, attempt)
        path = request_path(self.settings, job_id, attempt)
        # The file carries the ingest token: outside the folder tenants read, readable by the owner only.
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(request.model_dump_json(indent=1))
        env = {
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1"),
            "RAY_AUTH_MODE": self.ray.auth_mode,
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            # How long Ray Jobs waits after its stop signal before SIGKILL (3 s by default): the driver
            # aborts Ray Train's controller on SIGTERM (workers/run.py: abort_on_sigterm), which on a
            # loaded node can take longer than 3 s
            "RAY_JOB_STOP_WAIT_TIME_S": os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", "15"),
            "MEMFIT_JOB_ID": job_id,
            "MEMFIT_ATTEMPT": str(attempt),
            "MEMFIT_ATTEMPT_DIR": request.output_dir,
            **({"MEMFIT_STORAGE_BUDGET_BYTES": str(budget)} if budget is not None else {}),
            **{k: v for k, v in os.environ.items() if k.startswith("MEMFIT_WORKER_")},
            **self.extra_env,
        }
        entrypoint = f"{shlex.quote(self.ray.python)} -m workers.run {shlex.quote(str(path))}"
        faults.point("before_submit")
        if not self._fence(job_id, attempt):  # the lease went while the request was built: not ours to submit
            self._unsubmitted.pop((job_id, attempt), None)
            return
        try:
            created = self.ray.submit(sid, entrypoint, env, {"memfit_job_id": job_id, "attempt": str(attempt)})
        except RayUnavailable as exc:
            # The job stays running without a Ray job; reconcile retries this same submission id
            # (it cannot start twice) until Ray answers or the job's lease passes to another scheduler.
            log.warning("submission %s deferred: %s", sid, exc)
            self._unsubmitted[(job_id, attempt)] = token
            return
        except Exception as exc:  # noqa: BLE001 - Ray refused it (bad runtime_env …)
            self._fail(job_id, attempt, "submission_failed", f"Ray refused the submission {sid}: {exc}")
            return
        self._unsubmitted.pop((job_id, attempt), None)
        faults.point("after_submit")
        with self.sessions.begin() as s:
            add_event(s, job_id, f"Submitted to Ray as {sid}" if created else f"Ray already had {sid}; kept it",
                      data={"submission_id": sid, "attempt": attempt}, attempt=attempt,
                      dedupe_key=f"submit:{attempt}")

    # ---- adopt ----

    def adopt_expired(self) -> list[str]:
        """Take over running jobs whose lease expired. Same attempt: the Ray job (if alive) is kept."""
        adopted = []
        with self.sessions.begin() as s:
            jobs = s.scalars(
                select(Job)
                .where(Job.status == JobStatus.running.value,
                       or_(Job.lease_expires_at.is_(None), Job.lease_expires_at < utcnow()))
                .limit(self.batch)
                .with_for_update(skip_locked=True)
            ).all()
            for job in jobs:
                result = s.execute(
                    update(Job)
                    .where(Job.id == job.id, Job.attempt == job.attempt, Job.status == JobStatus.running.value,
                           Job.lease_owner.is_not_distinct_from(job.lease_owner))
                    .values(lease_owner=self.owner, lease_expires_at=utcnow() + self.lease)
                    .execution_options(synchronize_session=False)
                )
                if result.rowcount == 1:
                    s.add(JobEvent(job_id=job.id, attempt=job.attempt, level="warn", type="message",
                                   message=f"Scheduler {self.owner} adopted the job (lease of {job.lease_owner} expired)",
                                   data={"previous_owner": job.lease_owner, "owner": self.owner,
                                         "attempt": job.attempt}))
                    adopted.append(job.id)
        return adopted

    # ---- reconcile ----

    def reconcile(self) -> None:
        with self.sessions() as s:
            owned = s.execute(
                select(Job.id, Job.attempt, Job.ray_status, Job.desired_state)
                .where(Job.status == JobStatus.running.value, Job.lease_owner == self.owner)
            ).all()
            # Terminal or paused in the database while Ray may still run them: stop those (any owner).
            strays = s.execute(
                select(Job.id, Job.attempt, Job.status, Job.ray_status, Job.desired_state, Job.finished_at)
                .where(Job.status.in_([*(t.value for t in TERMINAL), JobStatus.paused.value]),
                       Job.ray_submission_id.is_not(None),
                       or_(Job.ray_status.is_(None), Job.ray_status.in_(RAY_ACTIVE)))
            ).all()
        for job_id, attempt, ray_status, desired in owned:
            self._reconcile_running(job_id, attempt, ray_status, desired)
        for job_id, attempt, status, _, desired, finished_at in strays:
            # A run that reported its own result or failure exits by itself within seconds: let it
            # (its Ray status then reads SUCCEEDED/FAILED); a cancelled or paused one is stopped now.
            ended_by_worker = status in (JobStatus.succeeded.value, JobStatus.failed.value) and desired is None
            young = finished_at is not None and utcnow() - finished_at < timedelta(seconds=self.exit_grace_s)
            self._stop_stray(job_id, attempt, status, stop=not (ended_by_worker and young))
        live = {row[0] for row in owned}
        for job_id in list(self._watch):
            if job_id not in live:
                del self._watch[job_id]
        for key in list(self._unsubmitted):
            if key[0] not in live:
                del self._unsubmitted[key]

    def _reconcile_running(self, job_id: str, attempt: int, known: str | None, desired: str | None) -> None:
        sid = submission_id(job_id, attempt)
        token = self._unsubmitted.get((job_id, attempt))
        if token is not None and desired != "cancel":
            self.submit(job_id, attempt, token)  # a deferred submission: same id, so never twice
            return
        st = self.ray.status(sid)
        watch = self._watch.setdefault(job_id, _Watch())
        if st is None:
            # Requeue only on proof: "does not exist" answered again and again, for a while.
            now = time.monotonic()
            if watch.missing_since is None:
                watch.missing_since, watch.missing_answers = now, 0
            watch.missing_answers += 1
            if (watch.missing_answers >= self.vanish_confirm_answers
                    and now - watch.missing_since >= self.vanish_confirm_s):
                self._vanished(job_id, attempt, sid, "ray_submission_missing")
            return
        watch.missing_since, watch.missing_answers = None, 0
        if st.status != known:
            self._set_ray_status(job_id, attempt, st.status)
        if st.status in RAY_ACTIVE:
            if attempt > 1:
                self._stop_late_submissions(job_id, attempt, watch)
            if desired is None and self._watch_capacity(job_id, attempt, sid, watch):
                return
            if st.status == "RUNNING":
                self._watch_restarts(job_id, attempt, sid, watch)
                if desired is None and self._stalled(job_id, attempt, sid, watch):
                    return
            if desired == "cancel" and self._fence(job_id, attempt):
                self.ray.stop(sid)
            elif desired == "pause" and self._pause_point_reached(job_id, attempt, watch) and self._fence(job_id, attempt):
                self.ray.stop(sid)
            return
        # Ray says the job is over. The worker posts its result/failure before the driver exits, so
        # the database normally is terminal already; give an in-flight post a moment to land.
        if st.status == "STOPPED" and desired in ("cancel", "pause"):
            if desired == "pause":
                self._replay_spool(job_id, attempt)  # its last checkpoint, should the API have missed it
            to = JobStatus.cancelled if desired == "cancel" else JobStatus.paused
            self._finish(job_id, attempt, to, lease_owner=None, desired_state=None)
            return
        if watch.ray_terminal_since is None:
            watch.ray_terminal_since = time.monotonic()
        if time.monotonic() - watch.ray_terminal_since < self.result_grace_s:
            return
        # What the run's sink could not deliver (the API was away when the run ended) is still in
        # its spool: store it now; its result or failure record then ends the job as the run did.
        if self._replay_spool(job_id, attempt) != JobStatus.running.value:
            self._watch.pop(job_id, None)
            return
        oom = self._pending_oom(job_id, attempt)
        if oom is not None:  # training.on_oom: downshift (service/jobs/ingest.py held the failure back)
            self._downshift(job_id, attempt, sid, oom)
            return
        if st.status == "SUCCEEDED":
            self._fail(job_id, attempt, "missing_result",
                       f"Ray job {sid} succeeded but the worker never reported a result")
        elif st.status == "FAILED" and (st.error_type in RAY_LOST_RUN or st.driver_exit_code == RUN_LOST_EXIT_CODE):
            # Not the run failing: its supervisor died with the node or head it was on (a head
            # restart with GCS fault tolerance reads like this), or its driver saw Ray lose the
            # run's actors (workers/run.py: RunLost). A new attempt resumes from the latest
            # checkpoint, a bounded number of times.
            self._vanished(job_id, attempt, sid, "ray_run_lost", detail=f"{st.error_type}: {st.message or ''}")
        elif st.status == "FAILED":
            tail = self.ray.log_tail(sid)
            self._fail(job_id, attempt, "ray_job_failed",
                       f"{st.error_type or 'ray job failed'}: {st.message or ''}".strip(),
                       details={"submission_id": sid, "error_type": st.error_type,
                                "driver_exit_code": st.driver_exit_code, "log_tail": tail})
        else:  # STOPPED by someone else (ray job stop, dashboard)
            self._fail(job_id, attempt, "ray_job_stopped", f"Ray job {sid} was stopped outside memfit",
                       details={"submission_id": sid})

    def _watch_restarts(self, job_id: str, attempt: int, sid: str, watch: _Watch) -> None:
        """Ray Train's own retries (FailureConfig.max_failures) as job events. The controller logs
        each decision ("[FailurePolicy] RETRY") to the driver, i.e. the Ray job's log; the workers'
        callback also reports exceptions it sees, but a worker process that dies (SIGKILL, OOM
        killer) only shows up here."""
        now = time.monotonic()
        every = self.restart_check_s if watch.log.from_file or watch.log.offset == 0 else 5 * self.restart_check_s
        if now - watch.logs_checked_at < every:
            return
        watch.logs_checked_at = now
        if watch.log_of != sid:
            watch.log, watch.log_of, watch.restarts_seen, watch.retries_told = LogCursor(), sid, 0, set()
        lines = self.ray.new_log_lines(sid, watch.log)
        retries = [_retry_detail(lines[i + 1:i + 3]) for i, line in enumerate(lines) if "[FailurePolicy] RETRY" in line]
        for source, count in retries:
            # Ray's log deduplication may print one decision several times: a decision is told once.
            if source is not None and count is not None:
                if (source, count) in watch.retries_told:
                    continue
                watch.retries_told.add((source, count))
            watch.restarts_seen += 1
            n = watch.restarts_seen
            # Ray counts a worker group's failures against max_failures, the controller's (e.g. a worker
            # group that could not be placed yet) against a limit of their own: say which this was.
            detail = f": {source} failure {count}" if source else ""
            with self.sessions.begin() as s:
                add_event(s, job_id, f"Ray Train restarted the worker group from its latest checkpoint (restart {n}{detail})",
                          level="warn", attempt=attempt, dedupe_key=f"raytrain-restart:{attempt}:{n}",
                          data={"restart": n, "attempt": attempt, "submission_id": sid, "source": source,
                                "error_count": count})

    def _live_nodes(self):
        """The cluster's live nodes (Ray's State API, cached for capacity_check_s), or None when unknown."""
        now = time.monotonic()
        cached = getattr(self, "_nodes_cache", None)
        if cached is not None and now - cached[0] < self.capacity_check_s:
            return cached[1]
        from service.memory.nodes import read_ray_nodes

        found = read_ray_nodes(self.ray.address, self.ray.auth_mode)
        nodes = found.nodes if found.error is None else None
        self._nodes_cache = (now, nodes)
        return nodes

    def _watch_capacity(self, job_id: str, attempt: int, sid: str, watch: _Watch) -> bool:
        """Whether the live nodes can hold the job (service/scheduler/capacity.py), said as it changes:
        an elastic job that fits on fewer workers is told so (Ray Train re-plans it onto them); one the
        cluster cannot hold is told at once — what it waits for, what the cluster has — and fails
        ``insufficient_resources`` once no node has come for capacity_factor × its start-up time (at least
        capacity_floor_s), instead of waiting in silence. True when it ended the job."""
        from service.scheduler.capacity import Demand, describe, workers_that_fit

        now = time.monotonic()
        if now - watch.capacity_checked_at < self.capacity_check_s:
            return False
        watch.capacity_checked_at = now
        nodes = self._live_nodes()
        if nodes is None:
            return False  # the State API did not answer: nothing is concluded
        with self.sessions() as s:
            d = Demand.of(s.scalar(select(Job.spec).where(Job.id == job_id)), self.ray.entrypoint_num_cpus)
        fit = workers_that_fit(nodes, d)
        data = {"attempt": attempt, "fit": fit, "num_workers": d.num_workers, "min_workers": d.min_workers,
                "worker": {"CPU": d.cpus_per_worker, "GPU": d.gpus_per_worker}, "driver_cpus": d.driver_cpus,
                "nodes": [{"node_id": n.node_id, "CPU": n.cpus, "GPU": n.gpus} for n in nodes]}
        if fit >= d.num_workers:
            if watch.short_since is not None or (watch.told_fit is not None and watch.told_fit < d.num_workers):
                self._tell(job_id, attempt, f"The cluster can hold the run again ({describe(nodes)})",
                           f"capacity-ok:{attempt}:{len(nodes)}", data, level="info")
            watch.short_since, watch.told_fit = None, fit
            return False
        if fit >= d.min_workers:
            if watch.told_fit != fit:
                self._tell(job_id, attempt, f"The cluster's live nodes ({describe(nodes)}) hold {fit} of the run's "
                           f"{d.num_workers} workers of {d.worker()}: Ray Train runs it on {fit} "
                           f"(resources.min_workers {d.min_workers}), re-planned for that world size",
                           f"capacity-elastic:{attempt}:{fit}", data)
            watch.short_since, watch.told_fit = None, fit
            return False
        if watch.short_since is None:
            watch.short_since, watch.told_fit = now, fit
            watch.short_bound_s, why = self._capacity_bound(job_id, attempt)
            self._tell(job_id, attempt, f"Waiting for resources the cluster cannot give: the run needs {d.min_workers} "
                       f"workers of {d.worker()} each (one node each) and its driver {d.driver_cpus:g} CPU; the "
                       f"cluster's live nodes have {describe(nodes)}, room for {fit}. Unless a node joins, the job "
                       f"fails in {watch.short_bound_s:.0f} s ({why})", f"capacity-short:{attempt}:{fit}",
                       {**data, "bound_s": round(watch.short_bound_s, 1)})
            return False
        if now - watch.short_since <= watch.short_bound_s:
            return False
        if not self._fence(job_id, attempt):
            return True
        self.ray.stop(sid)
        self._fail(job_id, attempt, "insufficient_resources",
                   f"The cluster cannot hold the run: it needs {d.min_workers} workers of {d.worker()} each and its "
                   f"driver {d.driver_cpus:g} CPU, the live nodes ({describe(nodes)}) have room for {fit}, and no node "
                   f"joined within {watch.short_bound_s:.0f} s; add nodes, or allow fewer workers (resources.min_workers)",
                   details={**data, "waited_s": round(now - watch.short_since, 1), "submission_id": sid})
        return True

    def _capacity_bound(self, job_id: str, attempt: int) -> tuple[float, str]:
        """capacity_factor × the attempt's start-up time (its submission to its first step), at least
        capacity_floor_s; capacity_factor × capacity_floor_s before a first step."""
        with self.sessions() as s:
            submitted = s.scalar(select(JobEvent.created_at).where(
                JobEvent.job_id == job_id, JobEvent.dedupe_key == f"submit:{attempt}"))
            first = s.scalar(select(JobEvent.created_at).where(
                JobEvent.job_id == job_id, JobEvent.attempt == attempt, JobEvent.type == "metrics")
                .order_by(JobEvent.created_at).limit(1))
        if submitted is not None and first is not None and first > submitted:
            startup = (first - submitted).total_seconds()
            bound = max(self.capacity_floor_s, self.capacity_factor * startup)
            return bound, f"{self.capacity_factor:g} × its start-up time of {startup:.0f} s, at least {self.capacity_floor_s:g} s"
        bound = self.capacity_factor * self.capacity_floor_s
        return bound, f"{self.capacity_factor:g} × {self.capacity_floor_s:g} s before its first step"

    def _tell(self, job_id: str, attempt: int, message: str, dedupe: str, data: dict, level: str = "warn") -> None:
        with self.sessions.begin() as s:
            add_event(s, job_id, message, level=level, attempt=attempt, dedupe_key=dedupe, data=data)

    def _stalled(self, job_id: str, attempt: int, sid: str, watch: _Watch) -> bool:
        """Whether the attempt has stalled, and if so act: a job event, the Ray job stopped, and a new
        attempt queued that resumes from the latest checkpoint — or, once ``training.max_failures``
        such restarts were spent, the job failed ``stalled``. Before its first step a run is never
        stalled (start-up: Ray Train, model load); after it, the bound is stall_timeout_s from the
        spec, else stall_factor × the mean step time seen so far, at least stall_floor_s."""
        now = time.monotonic()
        if now - watch.progress_checked_at < self.restart_check_s:
            return False
        watch.progress_checked_at = now
        if watch.progress_of != attempt:
            watch.progress_of, watch.first_step, watch.last_step = attempt, None, None
        with self.sessions() as s:
            step = s.scalar(select(func.max(SeriesHead.last_step)).where(
                SeriesHead.job_id == job_id, SeriesHead.attempt == attempt, SeriesHead.series == "metrics"))
            if watch.stall_limits is None:
                spec = s.scalar(select(Job.spec).where(Job.id == job_id)) or {}
                training = spec.get("training") or {}
                watch.stall_limits = (training.get("stall_timeout_s"), int(training.get("max_failures", 1)))
        if step is None:
            return False
        if watch.last_step is None or step > watch.last_step[0]:
            watch.last_step = (step, now)
            if watch.first_step is None:
                watch.first_step = (step, now)
            return False
        timeout_s, max_restarts = watch.stall_limits
        bound_s, why = self._stall_bound(watch, timeout_s)
        idle_s = now - watch.last_step[1]
        if idle_s <= bound_s:
            return False
        restarts = self._requeues(job_id, frozenset({"stalled"}))
        what = (f"No training step for {idle_s:.0f} s after step {step} (the bound is {bound_s:.0f} s: {why})")
        data = {"step": step, "idle_s": round(idle_s, 1), "bound_s": round(bound_s, 1), "attempt": attempt,
                "restarts": restarts, "max_failures": max_restarts, "submission_id": sid}
        if not self._fence(job_id, attempt):  # another scheduler's job now: it decides
            return True
        self.ray.stop(sid)  # the ranks still alive are waiting on a collective that will never complete
        if restarts >= max_restarts:
            self._fail(job_id, attempt, "stalled",
                       f"{what}; the run was restarted {restarts} times for stalling "
                       f"(training.max_failures {max_restarts})", details=data)
        else:
            with self.sessions.begin() as s:
                add_event(s, job_id, f"{what}: restarting from the latest checkpoint "
                          f"({restarts + 1} of training.max_failures {max_restarts})", level="warn",
                          attempt=attempt, dedupe_key=f"stalled:{attempt}", data=data)
            self._vanished(job_id, attempt, sid, "stalled", detail=what)
        self._watch.pop(job_id, None)
        return True

    def _stall_bound(self, watch: _Watch, timeout_s: float | None) -> tuple[float, str]:
        if timeout_s is not None:
            return float(timeout_s), "training.stall_timeout_s"
        (first, first_at), (last, last_at) = watch.first_step, watch.last_step
        if last > first and last_at > first_at:
            mean = (last_at - first_at) / (last - first)
            if self.stall_factor * mean > self.stall_floor_s:
                return self.stall_factor * mean, f"{self.stall_factor:g} × the mean step time so far, {mean:.1f} s"
            return self.stall_floor_s, f"{self.stall_factor:g} × the mean step time so far ({mean:.1f} s), at least {self.stall_floor_s:g} s"
        return self.stall_floor_s, f"at least {self.stall_floor_s:g} s until two steps are seen"

    def _pause_point_reached(self, job_id: str, attempt: int, watch: _Watch) -> bool:
        with self.sessions() as s:
            latest = s.scalar(select(Checkpoint.step).where(Checkpoint.job_id == job_id)
                              .order_by(Checkpoint.step.desc()).limit(1))
        latest = -1 if latest is None else latest
        if watch.pause_from_step is None:
            watch.pause_from_step, watch.pause_since = latest, time.monotonic()
            return False
        return latest > watch.pause_from_step or time.monotonic() - watch.pause_since > self.pause_timeout_s

    def _vanished(self, job_id: str, attempt: int, sid: str, reason: str, detail: str = "") -> None:
        """Ray does not know the submission — never made (a scheduler died between claim and
        submit) or lost (head restart) — or its supervisor died with its node. Requeue: the next
        claim is a new attempt that resumes from the latest recorded checkpoint (staged into its own
        folder). What the lost run spooled is stored first: it may have finished, or checkpointed,
        before its submission was lost. After ``max_lost_runs`` such losses the job fails instead."""
        if self._replay_spool(job_id, attempt) != JobStatus.running.value:
            self._watch.pop(job_id, None)
            return
        if self._lost_runs(job_id) >= self.max_lost_runs:
            self._fail(job_id, attempt, "ray_run_lost",
                       f"Ray lost the run {sid} ({detail or reason}); it was already resubmitted "
                       f"{self.max_lost_runs} times after such losses",
                       details={"submission_id": sid, "reason": reason})
            return
        with self.sessions.begin() as s:
            job = s.get(Job, job_id)
            if (job is None or job.attempt != attempt or job.status != JobStatus.running.value
                    or job.lease_owner != self.owner):
                return
            if job.desired_state == "cancel":
                _try(transition, s, job_id, JobStatus.cancelled, expected_attempt=attempt,
                     expected_owner=self.owner, lease_owner=None)
                return
            _try(transition, s, job_id, JobStatus.queued, expected_attempt=attempt, expected_owner=self.owner,
                 lease_owner=None,
                 lease_expires_at=None, ray_status=None,
                 event_data={"reason": reason, "submission_id": sid, "attempt": attempt,
                             **({"detail": detail} if detail else {})})
        self._watch.pop(job_id, None)

    def _pending_oom(self, job_id: str, attempt: int) -> dict | None:
        """The out-of-memory failure of this attempt that ingest held back for a downshift, or None."""
        with self.sessions() as s:
            data = s.scalar(select(JobEvent.data).where(JobEvent.job_id == job_id,
                                                        JobEvent.dedupe_key == ingest.oom_dedupe_key(attempt)))
        return (data or {}).get(ingest.OOM_EVENT_KEY) if data else None

    def _downshift(self, job_id: str, attempt: int, sid: str, error: dict) -> None:
        """``training.on_oom: downshift``, once the attempt that ran out of memory has ended in Ray:
        requeue the job — running → queued, fenced on the attempt and this scheduler's lease like the
        other requeues — with the spec service/memory/downshift.py chooses (same global batch, same
        optimizer) and its plan, so the next claim is a new attempt that resumes from the latest
        checkpoint with it. A job event says what changed, with the plans before and after. When
        ``training.max_downshifts`` are spent, or no change fits, the job fails ``out_of_memory`` with
        the worker's post-mortem, the reason added."""
        from service.memory import downshift
        from service.memory.compare import initial_summary

        with self.sessions() as s:
            job = s.get(Job, job_id)
            if (job is None or job.attempt != attempt or job.status != JobStatus.running.value
                    or job.lease_owner != self.owner):
                return
            spec = JobSpec.model_validate(job.spec)
        done = self._requeues(job_id, frozenset({downshift.DOWNSHIFT_REASON}))
        limit = spec.training.max_downshifts
        where = ", ".join(f"{k} {error[k]}" for k in ("rank", "step", "phase") if error.get(k) is not None)
        if done >= limit:
            return self._fail_oom(job_id, attempt, error, f"training.max_downshifts ({limit}) already spent")
        try:
            model_path = resolve_model(spec.model, self.settings.model_dirs).local_dir
            choice = downshift.choose(spec, self.settings, error, model_path)
        except Exception as exc:  # noqa: BLE001 - a failure to plan must not lose the post-mortem
            log.exception("job %s: no downshift could be planned", job_id)
            return self._fail_oom(job_id, attempt, error, f"no downshift could be planned ({_first_line(exc)})")
        if isinstance(choice, downshift.NoDownshift):
            return self._fail_oom(job_id, attempt, error, choice.why, tried=choice.tried)
        n = done + 1
        changes = ", ".join(f"{k.removeprefix('training.')} {v0} → {choice.spec_changes[k]}"
                            for k, v0 in downshift.before_values(spec, choice.spec_changes).items())
        need = (f"; predicted need {human_bytes(choice.before.need_bytes)} → {human_bytes(choice.after.need_bytes)}"
                if choice.before is not None and choice.after is not None else "")
        message = (f"Downshift {n} of training.max_downshifts {limit} after running out of memory ({where}): "
                   f"{choice.description} ({changes}){need}; resuming from the latest checkpoint")
        data = {"downshift": n, "max_downshifts": limit, "attempt": attempt, "submission_id": sid,
                "change": choice.change, "description": choice.description,
                "spec_changes": choice.spec_changes,
                "before_values": downshift.before_values(spec, choice.spec_changes),
                "before": downshift.summary(choice.before), "after": downshift.summary(choice.after),
                "miss_factor": round(choice.miss, 4), "why": choice.why, "tried": choice.tried,
                "out_of_memory": {k: error.get(k) for k in ("code", "message", "rank", "step", "phase")}}
        plan = choice.after.model_dump(mode="json") if choice.after is not None else None
        with self.sessions.begin() as s:
            job = s.get(Job, job_id)
            if job is not None and job.desired_state == "cancel":
                _try(transition, s, job_id, JobStatus.cancelled, expected_attempt=attempt,
                     expected_owner=self.owner, lease_owner=None)
                return
            moved = _try(transition, s, job_id, JobStatus.queued, expected_attempt=attempt,
                         expected_owner=self.owner, lease_owner=None, lease_expires_at=None, ray_status=None,
                         spec=choice.spec.model_dump(mode="json"), plan=plan,
                         memory_summary=initial_summary(plan) if plan is not None else None,
                         event_data={"reason": downshift.DOWNSHIFT_REASON, "submission_id": sid,
                                     "attempt": attempt, "downshift": n})
            if moved is not None:
                add_event(s, job_id, message, level="warn", attempt=attempt,
                          dedupe_key=f"{downshift.DOWNSHIFT_EVENT}:{n}", data=data)
        self._watch.pop(job_id, None)

    def _fail_oom(self, job_id: str, attempt: int, error: dict, why: str, tried: list | None = None) -> None:
        """Fail the job with the worker's out-of-memory post-mortem, saying why it was not downshifted."""
        details = {**(error.get("details") or {}), "downshift": {"why": why, **({"tried": tried} if tried else {})}}
        ended = {**error, "message": f"{error.get('message', 'out of memory')} — not downshifted: {why}"[:8000],
                 "details": details}
        metrics.SCHEDULER_FAILURES.labels("out_of_memory").inc()  # /metrics
        self._finish(job_id, attempt, JobStatus.failed, error=ended, lease_owner=None)

    def _lost_runs(self, job_id: str) -> int:
        return self._requeues(job_id, LOST_REASONS)

    def _requeues(self, job_id: str, reasons: frozenset[str]) -> int:
        """How often the job was requeued (running → queued) for one of ``reasons``."""
        with self.sessions() as s:
            data = s.scalars(select(JobEvent.data).where(
                JobEvent.job_id == job_id, JobEvent.type == "message",
                JobEvent.message == EVENT_MESSAGES[JobStatus.queued])).all()
        return sum(1 for d in data if (d or {}).get("reason") in reasons)

    def _replay_spool(self, job_id: str, attempt: int) -> str | None:
        """Store what the attempt's spool holds past its delivered offset, through service.jobs.ingest —
        the API's own storage code, so the fencing is the same (records of another attempt, or for a
        job that no longer accepts records, are refused) and nothing is stored twice. Call it only
        once the run has ended (its sink no longer delivers), or is believed lost. Returns the job's status afterwards
        (None when the job is gone)."""
        path = spool_path(self.settings, job_id, attempt)
        offset = spool.delivered_offset(path)
        # Up to what the spool holds now: a run believed lost may in fact still be writing to it
        # (elsewhere), and following it would hold this tick for as long as that run lives.
        until = spool.size(path)
        pending = until - offset
        note = True
        while pending > 0 and offset < until:
            try:
                records, end = spool.read(path, offset)
            except OSError as exc:
                log.warning("cannot read the spool %s: %s", path, exc)
                break
            if end == offset:
                break  # only a torn last line is left
            if records:
                with self.sessions() as s:
                    if note:  # in the transaction of the first batch: stored with it, or not at all
                        add_event(s, job_id, f"Storing {pending} bytes of records from the run's spool that the "
                                  f"API had not confirmed ({path.name})", level="warn", attempt=attempt,
                                  data={"spool": path.name, "from_byte": offset, "bytes": pending,
                                        "attempt": attempt},
                                  dedupe_key=f"replay:{attempt}:{offset}")
                    try:
                        result = ingest.replay(s, self.settings, job_id, records)
                    except (StaleAttempt, ingest.JobNotAccepting, JobNotFound) as exc:
                        log.info("replay of %s stopped: %s", path, exc)
                        break
                note = False
                if result.status not in ingest.ACCEPTING:  # its result or failure ended the job
                    spool.mark_delivered(path, end)
                    break
            spool.mark_delivered(path, end)
            offset = end
        with self.sessions() as s:
            return s.scalar(select(Job.status).where(Job.id == job_id))

    def _stop_stray(self, job_id: str, attempt: int, status: str, stop: bool = True) -> None:
        sid = submission_id(job_id, attempt)
        st = self.ray.status(sid)
        if st is not None and st.status in RAY_ACTIVE:
            if not stop:
                return
            self.ray.stop(sid)
            st = self.ray.status(sid)
        new = "GONE" if st is None else st.status
        with self.sessions.begin() as s:
            s.execute(update(Job).where(Job.id == job_id, Job.attempt == attempt)
                      .values(ray_status=new if new != "GONE" else "STOPPED", lease_owner=None)
                      .execution_options(synchronize_session=False))
            if stop and st is not None and new in RAY_ACTIVE | {"STOPPED"}:
                add_event(s, job_id, f"Stopping Ray job {sid} (job is {status})",
                          data={"submission_id": sid, "ray_status": new}, attempt=attempt,
                          dedupe_key=f"stop:{attempt}:{new}")

    def _set_ray_status(self, job_id: str, attempt: int, ray_status: str) -> None:
        with self.sessions.begin() as s:
            result = s.execute(update(Job).where(Job.id == job_id, Job.attempt == attempt, Job.lease_owner == self.owner)
                               .values(ray_status=ray_status).execution_options(synchronize_session=False))
            if result.rowcount != 1:
                return  # not ours any more (adopted by another scheduler) or moved on
            # insert-or-ignore: two schedulers (or a retried tick) may report the same status.
            add_event(s, job_id, f"Ray job {submission_id(job_id, attempt)} is {ray_status}",
                      data={"ray_status": ray_status, "attempt": attempt}, attempt=attempt,
                      dedupe_key=f"ray:{attempt}:{ray_status}")

    def _finish(self, job_id: str, attempt: int, to: JobStatus, **fields: Any) -> None:
        with self.sessions.begin() as s:
            # Fenced on the lease too: a scheduler that lost the job to another changes nothing.
            _try(transition, s, job_id, to, expected_attempt=attempt, expected_owner=self.owner, **fields)
        self._watch.pop(job_id, None)

    def _fail(self, job_id: str, attempt: int, code: str, message: str, details: dict | None = None) -> None:
        error = ErrorInfo(code=code, message=message, details=details or {}).model_dump(mode="json")
        metrics.SCHEDULER_FAILURES.labels(code).inc()  # /metrics
        self._finish(job_id, attempt, JobStatus.failed, error=error, lease_owner=None)


def _retry_detail(following: list[str]) -> tuple[str | None, str | None]:
    """The source and error count Ray Train's failure policy logs under its "[FailurePolicy] RETRY"
    line (ray/train/v2/_internal/execution/failure_handling/default.py): ("worker group", "1 (max
    allowed: 2)"), or Nones where those lines are not (yet) in what was read."""
    source = count = None
    for line in following:  # an actor's lines reach the driver log prefixed "(TrainController pid=…)"
        if "  Source: " in line:
            source = line.split("  Source: ", 1)[1].strip()
        elif "  Error count: " in line:
            count = line.split("  Error count: ", 1)[1].strip()
    return source, count


def _link_tree(src: Path, dst: Path) -> None:
    """Copy a folder as hard links (a copy where the file system refuses links). Regular files only:
    a symlink in it (which a link would carry over, pointing wherever it points) is left out."""
    for dirpath, _, filenames in os.walk(src):  # never into a symlinked folder
        target = dst / Path(dirpath).relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        for name in filenames:
            if not stat.S_ISREG(os.lstat(Path(dirpath) / name).st_mode):
                continue
            try:
                os.link(Path(dirpath) / name, target / name)
            except OSError:
                shutil.copy2(Path(dirpath) / name, target / name)


def _try(fn: Callable, *args, **kwargs):
    """A fenced write that lost its race (another scheduler, a terminal job) is not an error here."""
    try:
        return fn(*args, **kwargs)
    except (StaleAttempt, InvalidTransition, JobNotFound) as exc:
        log.info("skipped: %s", exc)
        return None


# --- running it ---------------------------------------------------------------------------------


_WAKERS: set[threading.Event] = set()


def wake() -> None:
    """Run every scheduler loop of this process now rather than at the end of its poll interval: a
    job was just created (or resumed) here — `memfit serve` and `memfit run` call this after such a
    POST, so a new job is validated, claimed and submitted without waiting up to ``poll_seconds``."""
    for woken in list(_WAKERS):
        woken.set()


def _wait(stop: threading.Event, woken: threading.Event, timeout_s: float) -> None:
    """Until ``timeout_s`` has passed, the loop is woken, or it is stopped (checked every 0.25 s)."""
    deadline = time.monotonic() + timeout_s
    while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
        if woken.wait(min(left, 0.25)):
            return


def start_in_thread(scheduler: Scheduler) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    thread = threading.Thread(target=scheduler.run, args=(stop,), name="memfit-scheduler", daemon=True)
    thread.start()
    return thread, stop
