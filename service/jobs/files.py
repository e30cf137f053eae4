"""Uploaded files: stored under ``settings.storage_dir/files/<tenant>/`` (or the same key in the bucket of
MEMFIT_STORAGE_URL, service/domain/storage.py), validated line by line.

The size limit is enforced while copying (the API also stops reading the request body once it is
over), so an oversized upload never fills the disk; a file that is not valid JSONL for one of the
three dataset formats is refused with the offending line number and never stored. A storage volume
that fills up mid-copy (ENOSPC) is StorageFull (507 ``storage_full``): the partial file is removed and
no row is recorded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.domain.datafmt import DataError, validate_jsonl
from service.domain.errors import (
    FileNotFound,
    InvalidFile,
    PayloadTooLarge,
    StorageFull,
    StorageUnavailable,
    UnprocessableEntity,
    is_storage_full,
)
from service.domain.storage import Download, cache_path, is_remote, object_store, store_for
from service.jobs import quotas
from service.settings import Settings
from service.store.auth import Principal
from service.store.db import Page, newest_first_page
from service.store.models import File, new_id

PURPOSES = ("fine-tune",)
CHUNK = 1024 * 1024


def _tenant_dir(settings: Settings, tenant_id: str) -> Path:
    return settings.storage_dir / "files" / tenant_id


def create_file(
    session: Session,
    principal: Principal,
    settings: Settings,
    *,
    filename: str | None,
    purpose: str | None,
    fileobj: BinaryIO,
) -> File:
    """Copy ``fileobj`` into storage (≤ settings.max_upload_bytes), validate it, record it. Caller commits."""
    if purpose not in PURPOSES:
        raise UnprocessableEntity(
            f"purpose must be 'fine-tune', got {purpose!r}", param="purpose", code="invalid_purpose"
        )
    name = os.path.basename(filename or "") or "upload.jsonl"
    file_id = new_id("file-")
    store = object_store(settings)
    # On object storage the upload is still received and validated in a local file (the volume's
    # files/ folder), then put into the bucket under the same key.
    directory = _tenant_dir(settings, principal.tenant_id)
    final = directory / f"{file_id}.jsonl"
    partial = directory / f".{file_id}.part"
    size = 0
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with partial.open("wb") as out:
            while chunk := fileobj.read(CHUNK):
                size += len(chunk)
                if size > settings.max_upload_bytes:
                    raise PayloadTooLarge(
                        f"file is larger than the limit of {settings.max_upload_bytes} bytes", param="file"
                    )
                out.write(chunk)
        try:
            summary = validate_jsonl(partial)
        except DataError as exc:
            raise InvalidFile(f"Invalid JSONL in {name!r}: {exc}", param="file") from None
        # Last, so the tenant's quota lock is held only from here to the caller's commit.
        quotas.check_storage(session, principal.tenant_id, settings, adding_bytes=size)  # 429 past quota_storage_bytes
        if store is not None:  # into the bucket; the validated local copy becomes its cache (domain/storage.py: localize)
            key = store.key_for(settings.storage_dir, final)
            try:
                store.put_file(partial, key)
            except OSError as exc:
                raise StorageUnavailable(f"the object store did not take {name!r}: {exc}; nothing was stored") from None
            uri = store.uri(key)
            cached = Path(cache_path(uri, settings.storage_dir / "cache"))
            cached.parent.mkdir(parents=True, exist_ok=True)
            os.replace(partial, cached)
            final = uri
        else:
            os.replace(partial, final)
    except OSError as exc:
        if is_storage_full(exc):
            raise StorageFull(f"no space left in the file storage for {name!r} ({size} bytes received); "
                              "nothing was stored", param="file") from None
        raise
    finally:
        partial.unlink(missing_ok=True)
    row = File(
        id=file_id,
        tenant_id=principal.tenant_id,
        filename=name[:512],
        purpose=purpose,
        bytes=size,
        path=str(final),
        format=summary.format,
        rows=summary.rows,
        status="processed",
    )
    session.add(row)
    session.flush()
    return row


def get_file(session: Session, principal: Principal, file_id: str, *, param: str | None = None) -> File:
    """The tenant's file, or FileNotFound (also for another tenant's id, and for an id no database
    can hold: Postgres refuses a NUL byte in text, which would be a 500)."""
    row = None if "\x00" in file_id else session.get(File, file_id)
    if row is None or row.tenant_id != principal.tenant_id:
        raise FileNotFound(file_id, param=param)
    return row


def list_files(
    session: Session, principal: Principal, *, after: str | None = None, limit: int = 20, purpose: str | None = None
) -> Page:
    """Newest first; ``after`` is the last id of the previous page."""
    q = select(File).where(File.tenant_id == principal.tenant_id)
    if purpose:
        q = q.where(File.purpose == purpose)
    return newest_first_page(session, q, File, tenant_id=principal.tenant_id, after=after, limit=limit)


def delete_file(session: Session, principal: Principal, file_id: str, settings: Settings) -> None:
    row = get_file(session, principal, file_id)
    session.delete(row)
    session.flush()
    if is_remote(row.path):
        store = store_for(row.path, object_store(settings))
        store.delete(store.key_of(row.path))
        Path(cache_path(row.path, settings.storage_dir / "cache")).unlink(missing_ok=True)
    else:
        Path(row.path).unlink(missing_ok=True)


def file_content(settings: Settings, row: File) -> Path | Download:
    """Where a file's content is read: its path on the volume, or a Download streamed from the bucket."""
    if not is_remote(row.path):
        return Path(row.path)
    store = store_for(row.path, object_store(settings))
    key = store.key_of(row.path)
    size = store.size(key)
    if size is None:
        raise FileNotFound(row.id)
    return Download(store, key, size)
