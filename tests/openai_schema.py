"""OpenAI's published schemas for the files and fine-tuning operations (tests/data/openai_openapi_subset.json,
vendored from github.com/openai/openai-openapi at the commit it names, by tests/data/vendor_openai_schemas.py),
and a JSON Schema validator of memfit's answers against them.

The document is OpenAPI 3.1, whose schemas are JSON Schema 2020-12 but for one older form OpenAI still
writes: ``"minimum": 0, "exclusiveMinimum": true`` (draft 4's boolean). :func:`_modernize` rewrites it to
2020-12's ``"exclusiveMinimum": 0``, which means the same; the schemas are otherwise used as published.

Where OpenAI's schema contradicts OpenAI's own API, memfit answers as the API does, and the validator is
told so explicitly (``KNOWN_DEPARTURES``), nowhere else:

- ``status: "paused"``: the job status enum lacks it, yet POST …/pause answers it (the document's own
  example for pauseFineTuningJob shows ``"status": "paused"``);
- an empty list of files: ``ListFilesResponse`` requires ``first_id`` and ``last_id`` as strings, which a
  page with no items has no value for; memfit answers null there.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SUBSET = Path(__file__).resolve().parent / "data" / "openai_openapi_subset.json"
BASE_URI = "https://openai.example/openapi.json"

KNOWN_DEPARTURES = (
    "status 'paused' (POST /fine_tuning/jobs/{id}/pause answers it; the FineTuningJob enum lacks it)",
    "first_id/last_id null on an empty page of files (ListFilesResponse requires strings)",
)


def _modernize(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _modernize(v) for k, v in node.items()}
        if out.get("exclusiveMinimum") is True:
            out["exclusiveMinimum"] = out.pop("minimum", 0)
        elif out.get("exclusiveMinimum") is False:
            out.pop("exclusiveMinimum")
        return out
    if isinstance(node, list):
        return [_modernize(v) for v in node]
    return node


@lru_cache(maxsize=1)
def document() -> dict[str, Any]:
    return json.loads(SUBSET.read_text())


@lru_cache(maxsize=1)
def _registry() -> Registry:
    doc = {"components": _modernize(document()["components"])}
    return Registry().with_resource(BASE_URI, Resource.from_contents(doc, default_specification=DRAFT202012))


def _validator(schema_name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"{BASE_URI}#/components/schemas/{schema_name}"},
                                           registry=_registry())


def schema_of(operation: str) -> str:
    """The schema name of an operation's 200 answer, e.g. ``GET /fine_tuning/jobs/{fine_tuning_job_id}``."""
    return document()["operations"][operation]


def problems(schema_name: str, body: Any) -> list[str]:
    """Every way ``body`` departs from OpenAI's ``schema_name``: 'path: message', empty when it conforms."""
    body = _allow_known_departures(schema_name, copy.deepcopy(body))
    errors = sorted(_validator(schema_name).iter_errors(body), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:300]}" for e in errors]


def assert_conforms(operation_or_schema: str, body: Any) -> None:
    """``body`` conforms to the schema of ``operation_or_schema`` (an operation such as
    ``POST /fine_tuning/jobs``, or a schema name such as ``ErrorResponse``)."""
    name = schema_of(operation_or_schema) if " " in operation_or_schema else operation_or_schema
    found = problems(name, body)
    assert not found, f"{operation_or_schema} ({name}) does not conform to OpenAI's schema:\n  " + "\n  ".join(found)


def _allow_known_departures(schema_name: str, body: Any) -> Any:
    def job(j: dict) -> None:
        if isinstance(j, dict) and j.get("status") == "paused":
            j["status"] = "queued"  # any listed value: only 'paused' itself is excused

    if schema_name == "FineTuningJob":
        job(body)
    elif schema_name == "ListPaginatedFineTuningJobsResponse" and isinstance(body, dict):
        for j in body.get("data") or []:
            job(j)
    elif schema_name == "ListFilesResponse" and isinstance(body, dict) and body.get("data") == []:
        for key in ("first_id", "last_id"):
            if body.get(key) is None:
                body[key] = ""
    return body
