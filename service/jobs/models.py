"""The models a tenant can call (``/v1/models``, chat and text completions): the base models memfit serves,
and each of the tenant's succeeded jobs' fine-tuned model and checkpoint models — found by the names
service/domain/model_names.py gives them, and where their weights lie.

A fine-tuned model is served as its adapter on top of its base (the base's application holds every tenant's
adapters: workers/serving.py) when the job trained one (``adapter/``), else as its merged or full model
(``merged/``, ``model/``), an application of its own. A checkpoint model is served from its checkpoint's
folder when that holds an adapter in peft's format, or a DDP checkpoint's adapter state (converted by the
replica, with the job's final adapter's config).

Deleting a model removes its artefacts from storage; the job stays, with an event saying what was deleted
and when (``model-deleted:<id>``: that event is also what keeps the name out of the list afterwards).
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.domain.errors import DomainError, NotFound
from service.domain.model_names import ModelNameError, parse_model_name
from service.domain.model_ref import ModelRefError, resolve_model
from service.domain.presets import PRESET_PREFIX, PRESETS
from service.domain.states import JobStatus
from service.jobs.artifacts import output_root
from service.jobs.claimed_paths import located
from service.jobs.crud import add_event
from service.jobs.tinker_checkpoints import checkpoint_folder, find_checkpoint, tenant_checkpoints
from service.settings import Settings
from service.store.auth import Principal
from service.store.models import Checkpoint, Job, JobEvent, Tenant

OWNER = "memfit"  # owned_by of the base models
DELETED_KEY = "model-deleted:"


class ModelNotFound(NotFound):
    code, title = "model_not_found", "Model not found"

    def __init__(self, model: str):
        super().__init__(f"The model {model!r} does not exist or you do not have access to it.", param="model")


class ModelNotDeletable(DomainError):
    status, code, title, openai_type = 403, "model_not_deletable", "Forbidden", "permission_error"


@dataclass(frozen=True)
class ServedModel:
    """Where a callable model's weights are, and how it is served."""

    id: str
    kind: str  # base | adapter | merged | checkpoint
    base: str  # the base model (what the base application builds)
    base_path: str | None  # a local base's folder (None for presets and hub ids)
    created: int
    owned_by: str
    adapter_path: str | None = None  # adapter / checkpoint models: the folder the replica loads
    merged_path: str | None = None  # merged / full models: their own application's folder
    adapter_config_from: str | None = None  # checkpoint models: the job's adapter, whose config their state takes
    job_id: str | None = None

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": self.owned_by}


def _ts(dt) -> int:
    return int(dt.timestamp()) if dt is not None else 0


def base_models() -> list[ServedModel]:
    return [ServedModel(id=PRESET_PREFIX + name, kind="base", base=PRESET_PREFIX + name, base_path=None, created=0,
                        owned_by=OWNER) for name in PRESETS]


def _digest(model_id: str) -> str:
    return hashlib.sha256(model_id.encode()).hexdigest()[:40]  # a model id may be longer than a dedupe key


def _deleted(session: Session, job_ids: list[str]) -> set[str]:
    if not job_ids:
        return set()
    rows = session.scalars(select(JobEvent.dedupe_key).where(JobEvent.job_id.in_(job_ids),
                                                             JobEvent.dedupe_key.like(DELETED_KEY + "%")))
    return {k[len(DELETED_KEY):] for k in rows if k}


def _base_path(job: Job, settings: Settings) -> str | None:
    try:
        ref = resolve_model(job.model, settings.model_dirs)
    except ModelRefError:
        return None
    return ref.local_dir if ref.kind == "local" else None


def _job_models(session: Session, job: Job, settings: Settings, owner: str, deleted: set[str]) -> list[ServedModel]:
    out: list[ServedModel] = []
    if not job.fine_tuned_model:
        return out
    root = output_root(job, settings)
    base_path = _base_path(job, settings)
    adapter = root / "adapter"
    if _digest(job.fine_tuned_model) not in deleted:
        if (adapter / "adapter_config.json").is_file():
            out.append(ServedModel(job.fine_tuned_model, "adapter", job.model, base_path, _ts(job.finished_at), owner,
                                   adapter_path=str(adapter), job_id=job.id))
        else:
            for name in ("merged", "model"):
                if (root / name / "config.json").is_file():
                    out.append(ServedModel(job.fine_tuned_model, "merged", job.model, base_path, _ts(job.finished_at),
                                           owner, merged_path=str(root / name), job_id=job.id))
                    break
    try:
        name = parse_model_name(job.fine_tuned_model)
    except ModelNameError:
        return out
    for c in session.scalars(select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step)):
        model_id = str(type(name)(base=name.base, suffix=name.suffix, job_id=name.job_id, step=c.step))
        if _digest(model_id) in deleted:
            continue
        folder = located(root.parent / str(c.attempt), c.path) if job.output_dir else located(root, c.path)
        if folder.is_dir():
            out.append(ServedModel(model_id, "checkpoint", job.model, base_path, _ts(c.created_at), owner,
                                   adapter_path=str(folder), job_id=job.id, adapter_config_from=str(adapter)))
    return out


def tenant_models(session: Session, principal: Principal, settings: Settings) -> list[ServedModel]:
    """Every model the tenant may call: the bases, then its fine-tuned and checkpoint models, oldest first."""
    tenant = session.get(Tenant, principal.tenant_id)
    owner = tenant.name if tenant is not None else principal.tenant_id
    jobs = list(session.scalars(select(Job).where(Job.tenant_id == principal.tenant_id,
                                                  Job.status == JobStatus.succeeded.value,
                                                  Job.fine_tuned_model.is_not(None)).order_by(Job.created_at)))
    deleted = _deleted(session, [j.id for j in jobs])
    out = base_models()
    for job in jobs:
        out += _job_models(session, job, settings, owner, deleted)
    for path, meta, _ in tenant_checkpoints(settings, principal.tenant_id):
        out.append(_tinker_model(settings, str(path), meta["base_model"], checkpoint_folder(settings, principal.tenant_id, path), owner))
    return out


def _tinker_model(settings: Settings, model_id: str, base: str, folder: Path, owner: str) -> ServedModel:
    """A Tinker checkpoint (service/jobs/tinker_checkpoints.py): an adapter on its base, named by its tinker:// path."""
    try:
        ref = resolve_model(base, settings.model_dirs)
        base_path = ref.local_dir if ref.kind == "local" else None
    except ModelRefError:
        base_path = None
    when = int((folder / "adapter_config.json").stat().st_mtime)
    return ServedModel(model_id, "adapter", base, base_path, when, owner, adapter_path=str(folder))


def find_model(session: Session, principal: Principal, settings: Settings, model_id: str) -> ServedModel:
    """The tenant's model ``model_id``, or ModelNotFound (another tenant's too)."""
    if "\x00" in model_id:
        raise ModelNotFound(model_id)
    for m in base_models():
        if m.id == model_id:
            return m
    if model_id.startswith("tinker://"):
        found = find_checkpoint(settings, principal.tenant_id, model_id)
        if found is None:
            raise ModelNotFound(model_id)
        tenant = session.get(Tenant, principal.tenant_id)
        _, meta, folder = found
        return _tinker_model(settings, model_id, meta["base_model"], folder, tenant.name if tenant else principal.tenant_id)
    try:
        name = parse_model_name(model_id)
    except ModelNameError:
        raise ModelNotFound(model_id) from None
    job = session.get(Job, name.job_id)
    if job is None or job.tenant_id != principal.tenant_id or job.status != JobStatus.succeeded.value:
        raise ModelNotFound(model_id)
    tenant = session.get(Tenant, principal.tenant_id)
    for m in _job_models(session, job, settings, tenant.name if tenant else principal.tenant_id,
                         _deleted(session, [job.id])):
        if m.id == model_id:
            return m
    raise ModelNotFound(model_id)


def delete_model(session: Session, principal: Principal, settings: Settings, model_id: str) -> ServedModel:
    """Remove a fine-tuned or checkpoint model's artefacts; the job stays and gets an event saying so."""
    model = find_model(session, principal, settings, model_id)
    if model.kind == "base":
        raise ModelNotDeletable(f"{model_id!r} is a base model; only fine-tuned models can be deleted", param="model")
    folders = [model.adapter_path or model.merged_path]
    if model.job_id is None:  # a Tinker checkpoint: no job to tell
        shutil.rmtree(folders[0], ignore_errors=True)
        return model
    if model.kind != "checkpoint":  # the job's model is all its exported folders
        root = output_root(session.get(Job, model.job_id), settings)
        folders = [str(root / n) for n in ("adapter", "merged", "model")]
    for folder in folders:
        if folder and Path(folder).exists():
            shutil.rmtree(folder, ignore_errors=True)
    add_event(session, model.job_id, f"Model {model_id} deleted: its weights were removed from storage and serving",
              data={"model": model_id, "kind": model.kind}, dedupe_key=DELETED_KEY + _digest(model_id))
    session.commit()
    return model
