"""Where the Tinker API's checkpoints lie (service/scheduler/tinker.py writes them; service/jobs/models.py lists
them as models): ``<storage>/tinker/<tenant>/<model id>/{weights,sampler_weights}/<name>/``, each an adapter in
peft's format, with the training client's ``meta.json`` (base model, rank, targets) in its model id's folder.
The tenant is in the path, so a tenant's listing never sees another's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from service.domain import tinker as t
from service.settings import Settings


def storage_root(settings: Settings, tenant_id: str) -> Path:
    return Path(settings.storage_dir) / "tinker" / tenant_id


def checkpoint_folder(settings: Settings, tenant_id: str, path: t.CheckpointPath) -> Path:
    return storage_root(settings, tenant_id) / path.model_id / path.kind / path.name


def read_meta(settings: Settings, tenant_id: str, model_id: str) -> dict[str, Any] | None:
    try:
        return json.loads((storage_root(settings, tenant_id) / model_id / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def tenant_checkpoints(settings: Settings, tenant_id: str) -> list[tuple[t.CheckpointPath, dict[str, Any], float]]:
    """Every checkpoint the tenant's training clients saved: (its path, its client's meta, when), oldest first."""
    root = storage_root(settings, tenant_id)
    out = []
    for meta_file in sorted(root.glob("*/meta.json")) if root.is_dir() else []:
        meta = read_meta(settings, tenant_id, meta_file.parent.name)
        if meta is None:
            continue
        for kind in t.KINDS:
            for config in sorted((meta_file.parent / kind).glob("*/adapter_config.json")):
                path = t.CheckpointPath(meta_file.parent.name, kind, config.parent.name)  # type: ignore[arg-type]
                out.append((path, meta, config.stat().st_mtime))
    return sorted(out, key=lambda c: c[2])


def find_checkpoint(settings: Settings, tenant_id: str, model_id: str) -> tuple[t.CheckpointPath, dict[str, Any], Path] | None:
    """The tenant's checkpoint named ``model_id`` (a tinker:// path), or None."""
    try:
        path = t.parse_path(model_id)
    except t.TinkerError:
        return None
    folder = checkpoint_folder(settings, tenant_id, path)
    meta = read_meta(settings, tenant_id, path.model_id)
    if meta is None or not (folder / "adapter_config.json").is_file():
        return None
    return path, meta, folder
