"""/v1/files: upload validation (line numbers), size limit, tenancy, content and delete."""

from __future__ import annotations

import json

import pytest

from tests.conftest import CHAT_JSONL, TEST_MAX_UPLOAD_BYTES
from tests.test_api_jobs import assert_problem


@pytest.mark.parametrize(
    "content, fmt, rows",
    [
        (CHAT_JSONL, "chat", 2),
        ('{"prompt": "2+2=", "completion": "4"}\n\n{"prompt": "1+1=", "completion": "2"}\n', "prompt_completion", 2),
        ('{"text": "once upon a time"}', "text", 1),
    ],
)
def test_upload_each_format(client, upload_file, tenant, content, fmt, rows):
    r = upload_file(tenant, content, filename="data.jsonl")
    assert r.status_code == 200, r.text
    f = r.json()
    assert f["id"].startswith("file-") and f["object"] == "file" and f["purpose"] == "fine-tune"
    assert f["bytes"] == len(content.encode()) and f["filename"] == "data.jsonl" and f["status"] == "processed"
    assert f["format"] == fmt and f["rows"] == rows
    got = client.get(f"/v1/files/{f['id']}/content", headers=tenant.headers)
    assert got.status_code == 200 and got.text == content
    assert client.get(f"/v1/files/{f['id']}", headers=tenant.headers).json() == f


def test_bad_jsonl_names_the_line(upload_file, tenant):
    content = CHAT_JSONL + '{"messages": [{"role": "user", "content": "no answer"}]}\n'
    body = assert_problem(upload_file(tenant, content, filename="bad.jsonl"), 400, "invalid_file", "file")
    assert body["detail"] == ("Invalid JSONL in 'bad.jsonl': line 3: a chat example needs at least one "
                              "assistant message to train on")
    body = assert_problem(upload_file(tenant, CHAT_JSONL + "{not json\n"), 400, "invalid_file", "file")
    assert "line 3: invalid JSON" in body["detail"]
    body = assert_problem(upload_file(tenant, CHAT_JSONL + '{"text": "x"}\n'), 400, "invalid_file", "file")
    assert "line 3: expected the chat format of the first example, got text" in body["detail"]
    assert_problem(upload_file(tenant, ""), 400, "invalid_file", "file")


def test_oversized_upload_is_413_and_not_stored(client, upload_file, tenant, api_settings):
    line = json.dumps({"text": "x" * 1000}) + "\n"
    content = line * (TEST_MAX_UPLOAD_BYTES // len(line) + 1)
    body = assert_problem(upload_file(tenant, content), 413, "file_too_large", "file")
    assert str(TEST_MAX_UPLOAD_BYTES) in body["detail"]
    assert client.get("/v1/files", headers=tenant.headers).json()["data"] == []
    tenant_dir = api_settings.storage_dir / "files" / tenant.id
    assert not tenant_dir.exists() or list(tenant_dir.iterdir()) == []
    # Just under the limit is fine.
    fits = line * (TEST_MAX_UPLOAD_BYTES // len(line))
    assert upload_file(tenant, fits).status_code == 200


def test_oversized_upload_without_content_length_is_413(client, tenant):
    boundary = "b0undary"
    payload = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nfine-tune\r\n"
               f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n\r\n").encode()
    payload += b'{"text": "' + b"y" * (2 * TEST_MAX_UPLOAD_BYTES) + b'"}\n' + f"\r\n--{boundary}--\r\n".encode()

    def chunks():
        for i in range(0, len(payload), 8192):
            yield payload[i:i + 8192]

    r = client.post("/v1/files", content=chunks(),
                    headers={**tenant.headers, "content-type": f"multipart/form-data; boundary={boundary}"})
    assert_problem(r, 413, "file_too_large", "file")


def test_purpose_must_be_fine_tune(upload_file, tenant):
    assert_problem(upload_file(tenant, purpose="assistants"), 422, "invalid_purpose", "purpose")


def test_not_multipart_is_400(client, tenant):
    assert_problem(client.post("/v1/files", json={"file": "x"}, headers=tenant.headers), 400, "invalid_request", "file")


def test_files_are_per_tenant_list_and_delete(client, upload_file, tenant, make_tenant):
    ids = [upload_file(tenant).json()["id"] for _ in range(3)]
    other = make_tenant()
    for path in ("", "/content"):
        assert_problem(client.get(f"/v1/files/{ids[0]}{path}", headers=other.headers), 404, "file_not_found", None)
    assert_problem(client.delete(f"/v1/files/{ids[0]}", headers=other.headers), 404, "file_not_found", None)
    assert client.get("/v1/files", headers=other.headers).json()["data"] == []
    page = client.get("/v1/files", params={"limit": 2}, headers=tenant.headers).json()
    assert [f["id"] for f in page["data"]] == ids[::-1][:2] and page["has_more"]
    rest = client.get("/v1/files", params={"limit": 2, "after": page["last_id"]}, headers=tenant.headers).json()
    assert [f["id"] for f in rest["data"]] == [ids[0]] and not rest["has_more"]
    r = client.delete(f"/v1/files/{ids[0]}", headers=tenant.headers)
    assert r.status_code == 200 and r.json() == {"id": ids[0], "object": "file", "deleted": True}
    assert_problem(client.get(f"/v1/files/{ids[0]}", headers=tenant.headers), 404, "file_not_found", None)
