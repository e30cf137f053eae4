"""Object storage: where memfit keeps uploads, checkpoints and exported models when
``MEMFIT_STORAGE_URL=s3://bucket/prefix`` — an S3-compatible bucket (AWS S3, MinIO, Ceph RGW, R2 …)
instead of the POSIX volume ``MEMFIT_STORAGE_DIR``, which stays the default. No database, no torch.

**The bucket mirrors the volume's layout.** The object under the key ``K`` (relative to the URL's
prefix) is what ``<MEMFIT_STORAGE_DIR>/K`` would be: ``files/<tenant>/<id>.jsonl``,
``jobs/<id>/attempts/<n>/ray/…`` (Ray Train's checkpoints), ``jobs/<id>/attempts/<n>/model/…``,
``jobs/<id>/results.json``. So every path memfit already computes (service/scheduler/paths.py) and
stores (a job's ``output_dir``, a checkpoint's path relative to its attempt) still names the place;
:meth:`ObjectStore.key_for` turns such a path into its key, refusing one outside the volume.
What only the run's own processes read — run requests (they carry the ingest token), the record
spool, failure records, markers — stays on ``MEMFIT_STORAGE_DIR``: kilobytes per job.

The API is small on purpose (the serving code reads artefacts through it too):

- :func:`object_store` — the store of these settings, or None on the POSIX volume;
- ``uri(key)``/``key_of(uri)`` — an ``s3://`` URI stored in the database (``File.path``,
  ``RunRequest.resume_from``) and back, refused outside the store's prefix;
- ``put_bytes``, ``put_file``, ``get_bytes``, ``iter_bytes``, ``size``, ``exists``, ``list``,
  ``bytes_under``, ``delete``, ``delete_tree`` — objects and ``/``-separated prefixes;
- ``upload_tree``, ``download_tree``, ``copy_tree`` (server-side), ``publish_tree`` (a folder uploaded
  under the hidden prefix ``.<name>.part/``, then copied into place whole: never half a folder under
  a name the artefact routes serve);
- :func:`localize` — a local copy of a stored file (a path on the volume is returned as it is);
- ``filesystem``/``fs_path(key)`` — the ``pyarrow.fs`` filesystem and path, as Ray Train's
  ``RunConfig(storage_path=…, storage_filesystem=…)`` takes them.

Every key is checked (:func:`clean_key`): no absolute path, no ``.``/``..`` or empty segment, no
backslash or control character — :class:`StorageEscape` otherwise. Credentials are never settings:
pyarrow reads ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (or a web identity, an instance
role) in every process that touches the bucket: the API, the scheduler and every Ray node.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shutil
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

if TYPE_CHECKING:
    import pyarrow.fs

    from service.settings import Settings

SCHEMES = ("s3://",)
CHUNK = 1024 * 1024


class StorageEscape(ValueError):
    """A key (or a path, or a URI) that does not name a place inside the store's root."""


def is_remote(path: str | os.PathLike | None) -> bool:
    """Whether a stored path is an object-storage URI (``s3://…``) rather than a local path."""
    return path is not None and str(path).startswith(SCHEMES)


def clean_key(key: str) -> str:
    """``key`` as a relative ``/``-separated key, or StorageEscape: absolute keys, ``.``/``..``/empty
    segments, backslashes, NUL and control characters are refused, never normalised away."""
    if not isinstance(key, str) or not key or key.startswith("/") or "\\" in key or any(ord(c) < 0x20 for c in key):
        raise StorageEscape(f"not a key inside the store: {key!r}")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise StorageEscape(f"not a key inside the store: {key!r}")
    return key


def join(*keys: str) -> str:
    """Keys joined with ``/``, each checked."""
    return "/".join(clean_key(k) for k in keys)


class ObjectStore(BaseModel):
    """An S3-compatible bucket and key prefix (``s3://bucket/prefix``), as plain data: it travels in a
    RunRequest to the Ray job (no credentials in it) and opens its ``pyarrow.fs`` filesystem lazily."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field(..., description="s3://bucket[/prefix]")
    endpoint: str | None = Field(None, description="An S3-compatible server's URL (http://minio:9000); None: AWS.")
    region: str | None = Field(None, description="The bucket's region; None: the AWS SDK's default.")
    _fs: Any = PrivateAttr(None)

    # --- where --------------------------------------------------------------------------------

    @property
    def root(self) -> str:
        """``bucket/prefix``: the filesystem path of key ''."""
        return self.url[len("s3://"):].strip("/")

    def fs_path(self, key: str = "") -> str:
        return f"{self.root}/{clean_key(key)}" if key else self.root

    def uri(self, key: str = "") -> str:
        return "s3://" + self.fs_path(key)

    def key_of(self, uri: str) -> str:
        """The key of ``uri`` (``s3://bucket/prefix/key`` or the filesystem path ``bucket/prefix/key``),
        or StorageEscape when it is not inside this store's prefix."""
        text = str(uri)
        path = text[len("s3://"):] if text.startswith("s3://") else text
        if not path.startswith(self.root + "/"):
            raise StorageEscape(f"{uri!r} is not inside {self.url}")
        return clean_key(path[len(self.root) + 1:])

    def key_for(self, storage_dir: Path, local: str | os.PathLike) -> str:
        """The key mirroring ``local``, a path under ``storage_dir`` (the volume's layout); StorageEscape
        for a path outside it. Lexical: the bucket has no symlinks, and ``..`` is refused, not folded."""
        text = str(local)
        root = str(storage_dir).rstrip("/")
        if not text.startswith(root + "/"):
            raise StorageEscape(f"{text!r} is not inside {root}")
        return clean_key(text[len(root) + 1:])

    @property
    def filesystem(self) -> "pyarrow.fs.S3FileSystem":
        if self._fs is None:
            import pyarrow.fs

            kw: dict[str, Any] = {"region": self.region} if self.region else {}
            if self.endpoint:
                scheme, _, host = self.endpoint.partition("://")
                kw.update(scheme=scheme, endpoint_override=host.rstrip("/"))
            self._fs = pyarrow.fs.S3FileSystem(connect_timeout=10, request_timeout=60, **kw)
        return self._fs

    # --- objects -------------------------------------------------------------------------------

    def _info(self, key: str):
        return self.filesystem.get_file_info(self.fs_path(key))

    def size(self, key: str) -> int | None:
        """The object's bytes, None when there is no object ``key``."""
        import pyarrow.fs

        info = self._info(key)
        return info.size if info.type == pyarrow.fs.FileType.File else None

    def exists(self, key: str) -> bool:
        """Whether ``key`` is an object or a prefix with objects under it."""
        import pyarrow.fs

        return self._info(key).type != pyarrow.fs.FileType.NotFound

    def put_bytes(self, key: str, data: bytes) -> None:
        with self.filesystem.open_output_stream(self.fs_path(key)) as out:
            out.write(data)

    def put_file(self, local: str | os.PathLike, key: str) -> None:
        with open(local, "rb") as src, self.filesystem.open_output_stream(self.fs_path(key)) as out:
            while chunk := src.read(CHUNK):
                out.write(chunk)

    def get_bytes(self, key: str) -> bytes:
        with self.filesystem.open_input_stream(self.fs_path(key)) as src:
            return src.read()

    def iter_bytes(self, key: str, chunk: int = CHUNK) -> Iterator[bytes]:
        """The object in chunks (a download streamed to an HTTP client without a local copy)."""
        with self.filesystem.open_input_stream(self.fs_path(key)) as src:
            while data := src.read(chunk):
                yield data

    def download(self, key: str, local: str | os.PathLike) -> None:
        """The object ``key`` into the file ``local``, written under a temporary name then renamed."""
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        part = local.with_name(f".{local.name}.{os.getpid()}.part")
        try:
            with self.filesystem.open_input_stream(self.fs_path(key)) as src, part.open("wb") as out:
                while data := src.read(CHUNK):
                    out.write(data)
            os.replace(part, local)
        finally:
            part.unlink(missing_ok=True)

    def list(self, prefix: str) -> list[tuple[str, int]]:
        """The objects under ``prefix`` as (key relative to it, bytes), sorted; none when it is absent."""
        import pyarrow.fs

        base = self.fs_path(prefix)
        infos = self.filesystem.get_file_info(pyarrow.fs.FileSelector(base, recursive=True, allow_not_found=True))
        return sorted((i.path[len(base) + 1:], i.size) for i in infos if i.type == pyarrow.fs.FileType.File)

    def bytes_under(self, prefix: str, skip: tuple[str, ...] = ()) -> int:
        """Bytes of the objects under ``prefix``; ``skip``: names right under it left out (as
        service/domain/disk.py: folder_bytes counts a folder)."""
        return sum(size for rel, size in self.list(prefix) if rel.split("/", 1)[0] not in skip)

    def delete(self, key: str) -> None:
        """Remove the object ``key``; none there is no error."""
        import pyarrow.fs

        if self._info(key).type == pyarrow.fs.FileType.File:
            self.filesystem.delete_file(self.fs_path(key))

    def delete_tree(self, prefix: str) -> None:
        """Remove every object under ``prefix``; none there is no error."""
        for rel, _ in self.list(prefix):
            self.filesystem.delete_file(self.fs_path(join(prefix, rel)))

    # --- folders ---------------------------------------------------------------------------------

    def upload_tree(self, local: str | os.PathLike, prefix: str) -> int:
        """Every regular file under the folder ``local`` to ``prefix/<its relative path>`` (symlinks are
        neither followed nor uploaded); returns the bytes uploaded."""
        total = 0
        for dirpath, dirnames, filenames in os.walk(local):
            dirnames.sort()
            rel = Path(dirpath).relative_to(local).as_posix()
            for name in sorted(filenames):
                path = Path(dirpath, name)
                if path.is_symlink() or not path.is_file():
                    continue
                self.put_file(path, join(prefix, *(() if rel == "." else (rel,)), name))
                total += path.stat().st_size
        return total

    def download_tree(self, prefix: str, local: str | os.PathLike) -> Path:
        """Every object under ``prefix`` into the folder ``local`` (created), keeping relative paths."""
        local = Path(local)
        local.mkdir(parents=True, exist_ok=True)
        for rel, _ in self.list(prefix):
            clean_key(rel)
            self.download(join(prefix, rel), local / rel)
        return local

    def copy_tree(self, src: str, dst: str, last: str | None = None) -> int:
        """Every object under ``src`` copied to ``dst`` inside the bucket (S3 CopyObject: no bytes
        pass through this process), the one named ``last`` (relative to ``src``) after all others;
        returns how many."""
        items = sorted(self.list(src), key=lambda item: item[0] == last)
        for rel, _ in items:
            self.filesystem.copy_file(self.fs_path(join(src, rel)), self.fs_path(join(dst, rel)))
        return len(items)

    def publish_tree(self, local: str | os.PathLike, prefix: str) -> int:
        """The folder ``local`` as ``prefix`` whole: uploaded under ``<parent>/.<name>.part/`` (hidden from
        the artefact routes), an earlier ``prefix`` removed, then copied into place; the partial
        upload is removed whatever happens. Returns the bytes published."""
        parent, _, name = clean_key(prefix).rpartition("/")
        partial = join(parent, f".{name}.part") if parent else f".{name}.part"
        self.delete_tree(partial)
        try:
            total = self.upload_tree(local, partial)
            self.delete_tree(prefix)
            self.copy_tree(partial, prefix)
        finally:
            self.delete_tree(partial)
        return total


def object_store(settings: "Settings") -> ObjectStore | None:
    """The object store these settings name (MEMFIT_STORAGE_URL), or None: the POSIX volume. One per
    URL, endpoint and region in a process (its filesystem, with its connections, is reused)."""
    if not settings.storage_url:
        return None
    return _store(settings.storage_url, settings.storage_endpoint, settings.storage_region)


@lru_cache(maxsize=8)
def _store(url: str, endpoint: str | None, region: str | None) -> ObjectStore:
    return ObjectStore(url=url, endpoint=endpoint, region=region)


def local_path(settings: "Settings", path: str) -> str:
    """:func:`localize` for the API and the scheduler: stored files copied under ``<storage_dir>/cache``."""
    return localize(path, object_store(settings), settings.storage_dir / "cache")


def store_for(uri: str, store: ObjectStore | None) -> ObjectStore:
    """The store that holds ``uri``; StorageEscape when none configured does (a URI stored under an
    earlier MEMFIT_STORAGE_URL, or a forged one)."""
    if store is None:
        raise StorageEscape(f"{uri!r} is in object storage, but MEMFIT_STORAGE_URL is not set")
    store.key_of(uri)
    return store


def cache_path(uri: str, cache_dir: Path) -> str:
    """Where :func:`localize` keeps its copy of ``uri`` (named by a hash of the URI: an upload's key never
    names other content)."""
    return str(Path(cache_dir) / hashlib.sha256(uri.encode()).hexdigest()[:32] / posixpath.basename(uri))


def localize(path: str, store: ObjectStore | None, cache_dir: Path) -> str:
    """A local path to read ``path`` from: a local path as it is; an object (``s3://…``) downloaded once
    into ``cache_dir``."""
    if not is_remote(path):
        return path
    store = store_for(path, store)
    key = store.key_of(path)
    local = Path(cache_path(path, cache_dir))
    if not local.is_file():
        store.download(key, local)
    return str(local)


class Download:
    """An object to stream to an HTTP client (the API's file and artefact downloads): ``store``, ``key``,
    ``size`` in bytes, ``name`` its last segment, ``chunks()`` its bytes."""

    def __init__(self, store: ObjectStore, key: str, size: int):
        self.store, self.key, self.size = store, key, size
        self.name = posixpath.basename(key)

    def chunks(self) -> Iterator[bytes]:
        return self.store.iter_bytes(self.key)


def drop_local(folder: Path) -> None:
    """Remove a local copy once it is published to the store."""
    shutil.rmtree(folder, ignore_errors=True)
