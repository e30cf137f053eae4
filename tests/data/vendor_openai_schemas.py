"""Re-vendor the slice of OpenAI's published OpenAPI description that tests/test_openai_schema.py validates
memfit's answers against: the files and fine-tuning jobs operations' response schemas and what they
reference, plus the error object. Run from a checkout (or bare clone) of github.com/openai/openai-openapi:

    python tests/data/vendor_openai_schemas.py /path/to/openai-openapi [commit]

It writes tests/data/openai_openapi_subset.json: {"source", "commit", "operations", "components": {"schemas"}}.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# The operations memfit implements (path as OpenAI writes it → the 200 response's schema, read from the document).
OPERATIONS = [
    ("post", "/files"), ("get", "/files"), ("get", "/files/{file_id}"), ("delete", "/files/{file_id}"),
    ("post", "/fine_tuning/jobs"), ("get", "/fine_tuning/jobs"), ("get", "/fine_tuning/jobs/{fine_tuning_job_id}"),
    ("post", "/fine_tuning/jobs/{fine_tuning_job_id}/cancel"), ("post", "/fine_tuning/jobs/{fine_tuning_job_id}/pause"),
    ("post", "/fine_tuning/jobs/{fine_tuning_job_id}/resume"),
    ("get", "/fine_tuning/jobs/{fine_tuning_job_id}/events"),
    ("get", "/fine_tuning/jobs/{fine_tuning_job_id}/checkpoints"),
]
EXTRA = ["ErrorResponse"]  # every 4xx/5xx body carries OpenAI's `error` object


def _refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v.rsplit("/", 1)[-1]
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def main(repo: str, commit: str = "HEAD") -> None:
    git = ["git", "-C", repo]
    sha = subprocess.check_output([*git, "rev-parse", commit], text=True).strip()
    doc = json.loads(subprocess.check_output([*git, "show", f"{sha}:openapi.json"]))
    schemas = doc["components"]["schemas"]
    ops, todo = {}, list(EXTRA)
    for method, path in OPERATIONS:
        ref = doc["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        ops[f"{method.upper()} {path}"] = ref.rsplit("/", 1)[-1]
        todo.append(ops[f"{method.upper()} {path}"])
    keep: dict = {}
    while todo:
        name = todo.pop()
        if name not in keep:
            keep[name] = schemas[name]
            todo.extend(_refs(schemas[name]))
    out = {"source": "https://github.com/openai/openai-openapi (openapi.json)", "commit": sha,
           "openapi_version": doc["info"]["version"], "operations": ops,
           "components": {"schemas": dict(sorted(keep.items()))}}
    Path(__file__).with_name("openai_openapi_subset.json").write_text(json.dumps(out, indent=1, sort_keys=False) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
