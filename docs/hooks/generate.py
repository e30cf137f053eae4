"""MkDocs hook: the reference pages read from the code at build time, so they cannot go stale.

- ``spec.md``: every field of ``service.domain.spec.JobSpec``, walked recursively (dotted name,
  default, type and bounds, description), after the hand-written ``partials/spec-intro.md``.
- ``api.md``: every operation of the app's OpenAPI document (method, path, summary and description,
  parameters, request body, response statuses), between ``partials/api-intro.md`` and
  ``partials/api-errors.md``.
- ``settings.md``: every ``MEMFIT_*`` field of ``service.settings.Settings``.

Torch-free: importing ``api`` and ``service`` does not import torch (tests/test_layering.py).
"""

from __future__ import annotations

import enum
import itertools
import sys
import tempfile
import types
import typing
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pydantic import BaseModel  # noqa: E402

from service.domain.units import human_bytes  # noqa: E402

METHOD_ORDER = ["get", "post", "put", "patch", "delete"]
BOUNDS = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "min_length": "length ≥", "max_length": "length ≤"}


def on_files(files, config):
    """MkDocs calls this once the docs folder is read: add the generated pages to it."""
    partials = Path(config["docs_dir"]) / "partials"
    pages = {"spec.md": spec_page(partials), "api.md": api_page(partials), "settings.md": settings_page()}
    for name, content in pages.items():
        files.append(File.generated(config, name, content=content))
    return files


# --- pydantic fields -------------------------------------------------------------------------


def model_in(annotation) -> tuple[type[BaseModel] | None, bool]:
    """The pydantic model a field holds (directly, optional, or as list items) and whether in a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    for arg in typing.get_args(annotation):
        model, in_list = model_in(arg)
        if model is not None:
            return model, in_list or typing.get_origin(annotation) is list
    return None, False


def leaf_fields(model: type[BaseModel], prefix: str = ""):
    """(dotted name, FieldInfo) of every field that holds a value rather than another spec object;
    ``a[].b`` is field ``b`` of each item of list ``a``."""
    for name, field in model.model_fields.items():
        inner, in_list = model_in(field.annotation)
        dotted = prefix + name
        if inner is None:
            yield dotted, field
        else:
            yield from leaf_fields(inner, dotted + ("[]." if in_list else "."))


def type_text(annotation) -> str:
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_text(a) for a in args)
    if origin is list:
        return f"list of {type_text(args[0])}"
    if origin is dict:
        return f"object of {type_text(args[1])}" if args else "object"
    if annotation is typing.Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def bounds_text(field) -> str:
    out = []
    for item in field.metadata:
        for attr, sign in BOUNDS.items():
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{sign} {value:,}" if isinstance(value, int) else f"{sign} {value}")
    return ", ".join(out)


def default_text(name: str, field) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, Path):
        return f"`{value}`"
    if name.endswith("_bytes") and isinstance(value, int) and value >= 1024:
        return f"`{value}` ({human_bytes(value)})"
    return f"`{value!r}`"


def cell(text: str | None) -> str:
    return " ".join((text or "—").split()).replace("|", "\\|")


def field_row(name: str, field) -> str:
    kind = type_text(field.annotation)
    bounds = bounds_text(field)
    return f"| `{name}` | {default_text(name.lower(), field)} | {kind}{f' ({bounds})' if bounds else ''} | {cell(field.description)} |"


def spec_page(partials: Path) -> str:
    from service.domain.spec import JobSpec

    groups: dict[str, list[str]] = {}  # the object each field sits in, in the model's order
    for name, field in leaf_fields(JobSpec):
        parent = name.rpartition(".")[0] or "top level"
        groups.setdefault(parent, []).append(field_row(name, field))
    lines = [(partials / "spec-intro.md").read_text().rstrip(), "", "## Every field", "",
             "Generated from `service.domain.spec.JobSpec` when the site is built. Bounds are pydantic's; "
             "`n_epochs` (1–100), `batch_size` (1–65,536) and `learning_rate_multiplier` (0–100] are "
             "checked by validators, and rules across fields by `check_rules` (above).", ""]
    for group, rows in groups.items():
        title = group if group == "top level" else f"`{group}`"
        lines += [f"### {title}", "", "| field | default | type / bounds | what it does |",
                  "|---|---|---|---|", *rows, ""]
    return "\n".join(lines)


def settings_page() -> str:
    from service.settings import ENV_PREFIX, Settings

    rows = []
    for name, field in Settings.model_fields.items():
        rows.append(field_row(ENV_PREFIX + name.upper(), field))
    return "\n".join([
        "# Settings", "",
        "Every setting of `service.settings.Settings`, generated when the site is built. Each is read from "
        "its `MEMFIT_*` environment variable; a value memfit cannot use stops any command (`serve`, "
        "`scheduler`, `run`, `keys`, `db`) with one line naming the variable, the value and what it "
        "expects, and exit status 2. See [Operations](operations.md) for what they are for and the "
        "variables read elsewhere.", "",
        "| variable | default | type / bounds | what it does |", "|---|---|---|---|", *rows, ""])


# --- OpenAPI ---------------------------------------------------------------------------------


def openapi() -> dict:
    from api.app import create_app
    from service.settings import Settings

    with tempfile.TemporaryDirectory() as tmp:
        app = create_app(Settings(database_url=f"sqlite:///{tmp}/x.db", storage_dir=Path(tmp) / "storage"))
        return app.openapi()


def schema_text(schema: dict) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        links = {"JobSpec": "spec.md", "Problem": "#errors"}
        return f"[`{name}`]({links[name]})" if name in links else f"`{name}`"
    if "anyOf" in schema:
        return " or ".join(schema_text(s) for s in schema["anyOf"])
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    kind = schema.get("type", "any")
    bounds = [f"{sign} {schema[k]}" for k, sign in (("minimum", "≥"), ("maximum", "≤")) if k in schema]
    return kind + (f" ({', '.join(bounds)})" if bounds else "")


SECTIONS = {"": "Health", "files": "Files", "fine_tuning": "Fine-tuning jobs", "memory": "Memory",
            "internal": "Internal: the workers' ingest"}


def section_of(path: str) -> str:
    """The key of SECTIONS a path belongs to: its segment after /v1, or "" outside /v1."""
    parts = path.strip("/").split("/")
    return parts[1] if parts[0] == "v1" and len(parts) > 1 else ""


def operation_lines(path: str, method: str, op: dict) -> list[str]:
    lines = [f"#### `{method.upper()} {path}`", "", f"**{op.get('summary', '')}**", ""]
    if op.get("description"):
        lines += [op["description"].strip(), ""]
    params = op.get("parameters", [])
    if params:
        lines += ["| parameter | in | type | required | default | description |", "|---|---|---|---|---|---|"]
        for p in params:
            schema = p.get("schema", {})
            default = f"`{schema['default']}`" if "default" in schema else "—"
            lines.append(f"| `{p['name']}` | {p['in']} | {schema_text(schema)} | {'yes' if p.get('required') else 'no'} "
                         f"| {default} | {cell(p.get('description') or schema.get('description'))} |")
        lines.append("")
    body = op.get("requestBody")
    if body:
        for media, content in body.get("content", {}).items():
            schema = content.get("schema", {})
            if schema.get("type") == "object" and "properties" in schema:
                fields = ", ".join(f"`{k}`" for k in schema["properties"])
                lines += [f"Request body (`{media}`): {fields}.", ""]
            else:
                note = f" — {schema['description']}" if schema.get("description") else ""
                lines += [f"Request body (`{media}`): {schema_text(schema)}{note}", ""]
    statuses = []
    for status, response in op.get("responses", {}).items():
        media = ", ".join(f"`{m}`" + (f": {schema_text(c['schema'])}" if "$ref" in c.get("schema", {}) else "")
                          for m, c in response.get("content", {}).items()) or "—"
        statuses.append(f"| {status} | {cell(response.get('description'))} | {media} |")
    lines += ["| status | when | content |", "|---|---|---|", *statuses, ""]
    return lines


def api_page(partials: Path) -> str:
    doc = openapi()
    order = list(SECTIONS)
    entries = sorted(((path, method, op) for path, ops in doc["paths"].items() for method, op in ops.items()),
                     key=lambda e: (order.index(section_of(e[0])) if section_of(e[0]) in order else len(order),
                                    e[0], METHOD_ORDER.index(e[1]) if e[1] in METHOD_ORDER else len(METHOD_ORDER)))
    lines = [(partials / "api-intro.md").read_text().rstrip(), "", "## Operations", "",
             f"Generated from the app's OpenAPI document (`{doc['info']['title']}` {doc['info']['version']}, "
             "`GET /openapi.json` on a running server) when the site is built. Every error status answers "
             "`application/problem+json` ([Errors](#errors)).", ""]
    for key, group in itertools.groupby(entries, key=lambda e: section_of(e[0])):
        lines += [f"### {SECTIONS.get(key, key)}", ""]  # a path prefix SECTIONS does not name yet: its own name
        for entry in group:
            lines += operation_lines(*entry)
    lines += [(partials / "api-errors.md").read_text().rstrip(), ""]
    return "\n".join(lines)
