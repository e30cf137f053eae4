"""A real S3-compatible server on this machine for the object-storage tests: moto's standalone server
(``python -m moto.server``, the dev extra's ``moto[server]``), started on a free port, with one bucket.

The tests point memfit at it with ``MEMFIT_STORAGE_URL=s3://<bucket>/<prefix>`` and
``MEMFIT_STORAGE_ENDPOINT=http://127.0.0.1:<port>``; the keys are moto's (any pair is accepted) in
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, as a deployment gives them to every process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from service.ports import free_port

BUCKET = "memfit-test"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "memfit-test", "AWS_SECRET_ACCESS_KEY": "memfit-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


class S3Server:
    def __init__(self, log: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> "S3Server":
        out = self.log.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **CREDENTIALS})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto's server exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            self.stop()
            raise RuntimeError(f"moto's server did not listen on {self.port} within {timeout} s")
        self.filesystem().create_dir(BUCKET)
        return self

    def filesystem(self):
        import pyarrow.fs

        return pyarrow.fs.S3FileSystem(access_key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                       secret_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"], region="us-east-1",
                                       scheme="http", endpoint_override=f"127.0.0.1:{self.port}",
                                       allow_bucket_creation=True)

    def settings(self, prefix: str) -> dict:
        """The memfit settings that put storage in this server's bucket under ``prefix``."""
        return {"storage_url": f"s3://{BUCKET}/{prefix}", "storage_endpoint": self.endpoint,
                "storage_region": "us-east-1"}

    def keys(self, prefix: str) -> list[str]:
        """Every object key under ``prefix`` of the bucket, sorted."""
        import pyarrow.fs

        infos = self.filesystem().get_file_info(pyarrow.fs.FileSelector(f"{BUCKET}/{prefix}", recursive=True,
                                                                        allow_not_found=True))
        return sorted(i.path[len(BUCKET) + 1:] for i in infos if i.type == pyarrow.fs.FileType.File)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
