"""/v1/files: multipart upload (streamed, size-limited), list, get, content, delete."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, Response, StreamingResponse
from starlette.formparsers import MultiPartException, MultiPartParser

from api.deps import PrincipalDep, ReadSessionDep, SessionDep, SettingsDep
from api.errors import AUTHED, BY_ID, problems
from api.schemas import (
    FileDeletedPublic,
    FilePublic,
    ListPublic,
    file_public,
    page_public,
)
from service.domain.errors import BadRequest, PayloadTooLarge
from service.domain.storage import Download
from service.jobs import files

router = APIRouter(prefix="/v1/files", tags=["files"])

# Room for the multipart boundaries and the small `purpose` field around the file itself.
MULTIPART_OVERHEAD_BYTES = 64 * 1024

_UPLOAD_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary", "description": "JSONL dataset"},
                        "purpose": {"type": "string", "enum": ["fine-tune"]},
                    },
                }
            }
        },
    }
}


@router.post("", response_model=FilePublic, openapi_extra=_UPLOAD_SCHEMA, responses=problems(400, 401, 413, 422, 429, 503, 507))
async def upload_file(request: Request, session: SessionDep, principal: PrincipalDep, settings: SettingsDep):
    limit = settings.max_upload_bytes + MULTIPART_OVERHEAD_BYTES
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"file is larger than the limit of {settings.max_upload_bytes} bytes", param="file")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise BadRequest("Upload the file as multipart/form-data with fields 'file' and 'purpose'", param="file")

    async def limited():
        seen = 0
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > limit:  # stop reading: an oversized body never reaches the disk
                raise PayloadTooLarge(f"file is larger than the limit of {settings.max_upload_bytes} bytes", param="file")
            yield chunk

    parser = MultiPartParser(request.headers, limited(), max_files=1, max_fields=8)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise BadRequest(f"Malformed multipart body: {exc.message}", param="file") from None
    try:
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise BadRequest("Missing the 'file' part of the multipart body", param="file")
        row = await run_in_threadpool(_store, session, principal, settings, upload, form.get("purpose"))
    finally:
        await form.close()
    return file_public(row)


def _store(session, principal, settings, upload, purpose):
    row = files.create_file(
        session, principal, settings, filename=upload.filename, purpose=purpose, fileobj=upload.file
    )
    session.commit()
    return row


@router.get("", response_model=ListPublic[FilePublic], responses=problems(*AUTHED))
def list_files(
    session: ReadSessionDep,
    principal: PrincipalDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    purpose: str | None = None,
):
    page = files.list_files(session, principal, after=after, limit=limit, purpose=purpose)
    return page_public([file_public(f) for f in page], page.has_more)


@router.get("/{file_id}", response_model=FilePublic, responses=problems(*BY_ID))
def get_file(file_id: str, session: ReadSessionDep, principal: PrincipalDep):
    return file_public(files.get_file(session, principal, file_id))


@router.get("/{file_id}/content", response_class=FileResponse, responses=problems(*BY_ID))
def file_content(file_id: str, session: ReadSessionDep, principal: PrincipalDep, settings: SettingsDep):
    row = files.get_file(session, principal, file_id)
    media = {".csv": "text/csv", ".json": "application/json"}.get(Path(row.filename).suffix, "application/jsonl")
    return download_response(files.file_content(settings, row), filename=row.filename, media_type=media)


def download_response(target: Path | Download, *, filename: str, media_type: str) -> Response:
    """A file on the volume (FileResponse: ranges, ETag) or an object streamed from the bucket."""
    if isinstance(target, Download):
        return StreamingResponse(target.chunks(), media_type=media_type, headers={
            "Content-Length": str(target.size),
            "Content-Disposition": f"attachment; filename*=utf-8''{quote(filename)}"})
    return FileResponse(target, media_type=media_type, filename=filename)


@router.delete("/{file_id}", response_model=FileDeletedPublic, responses=problems(*BY_ID))
def delete_file(file_id: str, session: SessionDep, principal: PrincipalDep, settings: SettingsDep):
    files.delete_file(session, principal, file_id, settings)
    session.commit()
    return FileDeletedPublic(id=file_id)
