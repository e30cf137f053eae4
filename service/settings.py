"""Service settings: one pydantic-settings class, read from MEMFIT_* variables, refusing unsafe values.

:func:`get_settings` is how every command reads them: a value memfit cannot use raises
:class:`SettingsInvalid`, one line per variable naming it, the value given and what it expects
(``service/cli/main.py: main`` prints those lines and exits 2).
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

ENV_PREFIX = "MEMFIT_"
DIRS_FORM = f"directories separated by ',' or {os.pathsep!r}, or a JSON list of them"


class ClusterNode(BaseModel):
    """One kind of Ray node, as MEMFIT_CLUSTER_NODES describes it (service/memory/nodes.py)."""

    model_config = ConfigDict(extra="forbid")

    memory_bytes: int = Field(..., ge=1, description="RAM the node's workers may use.")
    cpus: float = Field(0, ge=0, description="The node's CPUs (Ray's CPU resource).")
    gpus: float = Field(0, ge=0, description="The node's GPUs.")
    count: int = Field(1, ge=1, le=100_000, description="How many such nodes.")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    database_url: str = Field(
        "sqlite:///./.memfit/memfit.db",
        description="SQLAlchemy URL. postgresql+psycopg://… in production; SQLite is the embedded default.",
    )
    storage_dir: Path = Field(Path("./.memfit/storage"), description="Uploaded files, checkpoints and models.")
    storage_url: str | None = Field(
        None, description="s3://bucket/prefix: uploads, checkpoints and exported models in an S3-compatible bucket "
                          "(service/domain/storage.py), laid out as under storage_dir; unset: all on storage_dir. "
                          "Keys come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a role) in every process.")
    storage_endpoint: str | None = Field(
        None, description="The S3-compatible server's URL (http://minio:9000, https://…); unset: AWS S3.")
    storage_region: str | None = Field(None, description="The bucket's region; unset: the AWS SDK's default.")
    # NoDecode: pydantic-settings would JSON-decode a list from the environment before any validator
    # runs, so the documented `MEMFIT_MODEL_DIRS=/models,/srv/models` would never reach `_split`.
    model_dirs: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description=f"The only local directories a job's `model` path may point into: {DIRS_FORM}.",
    )
    max_upload_bytes: int = Field(512 * 1024 * 1024, ge=1024, le=64 * 1024**3)
    api_url: str = Field("http://127.0.0.1:8000", description="Where workers post metrics (the API's own URL).")
    ray_address: str | None = Field(
        None, description="Ray cluster to submit to (e.g. http://head:8265); None starts a local head."
    )
    ray_auth_mode: str = Field("disabled", description="RAY_AUTH_MODE given to Ray and its clients.")
    scheduler_enabled: bool = Field(True, description="Run the scheduler loop inside `memfit serve`.")
    db_connect_timeout_s: float = Field(5.0, ge=1, le=300, description="Postgres: how long establishing a connection may take.")
    db_statement_timeout_s: float = Field(
        30.0, ge=1, le=3600, description="Postgres: one statement's limit (the server's statement_timeout); a "
                                         "server that does not answer at all is given up 1 s later and the request answers 503.")
    db_keepalive_idle_s: float = Field(10.0, ge=1, le=3600,
                                       description="Postgres: TCP keepalives after this long idle (3 probes a third of it apart).")
    lease_seconds: float = Field(30.0, ge=2, le=3600, description="Scheduler lease; renewed by heartbeat.")
    poll_seconds: float = Field(0.5, gt=0, le=60)
    memory_safety_margin: float = Field(0.10, ge=0, le=0.9, description="Headroom kept free on each GPU.")
    cluster_nodes: list[ClusterNode] | None = Field(
        None, description="The Ray nodes for the host-memory check at admission, as JSON "
                          "([{\"memory_bytes\": …, \"cpus\": 96, \"gpus\": 8, \"count\": 4}]); None asks Ray's dashboard.")

    # Limits (OWASP API4, README "Limits"). A quota or rate of 0 turns that limit off.
    max_json_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, le=1024**3,
                                     description="Largest request body outside /v1/files (uploads: max_upload_bytes).")
    max_json_depth: int = Field(64, ge=8, le=512, description="Deepest nesting of arrays/objects in a JSON body.")
    max_header_bytes: int = Field(8 * 1024, ge=1024, le=1024**2,
                                  description="Total size of a request's headers (uvicorn's h11 refuses a head over 16 KiB itself).")
    max_header_count: int = Field(100, ge=8, le=1000, description="How many headers a request may send.")
    rate_limit_enabled: bool = Field(True, description="Answer 429 with Retry-After above the rates below.")
    rate_limit_storage_uri: str = Field(
        "memory://", description="Where the rate limits are counted: memory:// (this process only: N API processes "
                                 "admit N× the rate) or redis://host:6379/0 (one count shared by every API replica).")
    forwarded_allow_ips: str = Field(
        "127.0.0.1", description="Proxies whose X-Forwarded-For/-Proto uvicorn believes (comma-separated addresses "
                                 "or networks, * for any): the client address the rate limits key on, and https for "
                                 "the Secure cookie. Set it to your Ingress controller's pod range.")
    rate_limit_key_per_s: float = Field(50.0, ge=0, le=100_000, description="Requests per second per API key.")
    rate_limit_key_burst: int = Field(500, ge=1, le=1_000_000, description="Requests an idle API key may send at once.")
    rate_limit_ip_per_s: float = Field(20.0, ge=0, le=100_000,
                                       description="Requests per second per client IP without an API key.")
    rate_limit_ip_burst: int = Field(200, ge=1, le=1_000_000, description="Burst per client IP without an API key.")
    # The workers' ingest (POST /v1/internal/jobs/{id}/ingest): a run's sink posts batches of at most
    # 200 records (workers/sink_http.py) every 0.25 s, faster only while it catches up after an outage.
    rate_limit_ingest_per_s: float = Field(20.0, ge=0, le=100_000,
                                           description="Ingest posts per second per job attempt (its own limit, keyed by the attempt).")
    rate_limit_ingest_burst: int = Field(200, ge=1, le=1_000_000, description="Ingest posts an attempt may send at once.")
    max_ingest_body_bytes: int = Field(2 * 1024 * 1024, ge=64 * 1024, le=1024**3,
                                       description="Largest ingest body: what one batch of a run legitimately is (200 records of "
                                                   "≤ 10 KiB); the sink splits a batch that is refused as too large.")
    quota_queued_jobs: int = Field(256, ge=0, le=1_000_000,
                                   description="A tenant's jobs waiting (validating_files, queued, paused).")
    quota_running_jobs: int = Field(32, ge=0, le=100_000,
                                    description="A tenant's jobs running at once; the scheduler leaves the rest queued.")
    quota_storage_bytes: int = Field(
        50 * 1024**3, ge=0, le=1024**5,
        description="Bytes a tenant may keep on the shared volume: uploads, and its jobs' checkpoints and exports "
                    "(checked before an upload is stored and before a checkpoint or export is written).")
    max_model_bytes: int = Field(
        160 * 1024**3, ge=0, le=1024**5,
        description="Largest model admitted, by its weights at 2 bytes a parameter (a hub model of unknown size is "
                    "refused while this is set); 0: no cap.")

    # Serving (/v1/models, /v1/chat/completions, /v1/completions on Ray Serve: docs/serving.md).
    serve_ray_address: str | None = Field(
        None, description="The Ray dashboard whose Serve runs the models (e.g. http://head:8265); default MEMFIT_RAY_ADDRESS, "
                          "or the local head `memfit serve` starts.")
    serve_engine: str = Field("transformers",
                              description="transformers (+peft) on CPU; vllm (enable_lora) on GPU nodes; auto: vllm where usable.")
    serve_min_replicas: int = Field(0, ge=0, le=1000, description="Replicas per model kept when idle (0: scale to zero).")
    serve_max_replicas: int = Field(1, ge=1, le=1000, description="Replicas per model Serve may scale up to.")
    serve_replica_cpus: float = Field(1.0, ge=0, le=1024, description="CPUs (Ray's resource) a replica reserves.")
    serve_replica_gpus: float = Field(0.0, ge=0, le=64, description="GPUs a replica reserves (vLLM: 1).")
    serve_max_batch: int = Field(8, ge=1, le=4096, description="Sequences a replica generates at once.")
    serve_max_adapters: int = Field(8, ge=1, le=10_000, description="Adapters a replica keeps loaded (LRU beyond).")
    serve_max_tokens: int = Field(1024, ge=1, le=1_000_000, description="The largest max_tokens a request may ask for.")
    serve_request_timeout_s: float = Field(120.0, gt=0, le=3600, description="A generation's limit, the model's start excluded.")
    serve_start_timeout_s: float = Field(300.0, gt=0, le=3600, description="How long a model's application may take to start.")
    serve_concurrent_per_tenant: int = Field(8, ge=0, le=100_000, description="A tenant's generations at once (0: no limit).")
    serve_tokens_per_minute: int = Field(200_000, ge=0, le=10**9,
                                         description="Tokens (prompt + max_tokens × n) a tenant may ask for per minute (0: no limit).")
    serve_replica_memory_bytes: int = Field(8 * 1024**3, ge=0, le=1024**5,
                                            description="Memory a replica may use: a model predicted over it is refused (0: no check).")

    @field_validator("model_dirs", mode="before")
    @classmethod
    def _split(cls, v):
        if not isinstance(v, str):
            return v
        text = v.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                raise ValueError(f"expected {DIRS_FORM} (this starts like a JSON list but is not one)") from None
        return [p.strip() for p in re.split(f"[,{re.escape(os.pathsep)}]", text) if p.strip()]

    @field_validator("model_dirs")
    @classmethod
    def _resolve_dirs(cls, v: list[Path]) -> list[Path]:
        out = []
        for p in v:
            rp = Path(p).expanduser().resolve()
            if rp == Path("/"):
                raise ValueError("must not include the filesystem root")
            out.append(rp)
        return out

    @field_validator("storage_dir")
    @classmethod
    def _storage(cls, v: Path) -> Path:
        v = Path(v).expanduser().resolve()
        if v == Path("/"):
            raise ValueError("expected a directory other than the filesystem root")
        return v

    @field_validator("storage_url")
    @classmethod
    def _storage_url(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None  # unset: the POSIX volume
        v = v.strip().rstrip("/")
        bucket = v[len("s3://"):].split("/", 1)[0]
        if not v.startswith("s3://") or not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
            raise ValueError("expected s3://bucket or s3://bucket/prefix (a bucket name of 3 to 63 lower-case "
                             "letters, digits, '.' and '-'; keys go in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)")
        if "?" in v or "@" in v or any(p in ("", ".", "..") for p in v[len("s3://"):].split("/")):
            raise ValueError("expected s3://bucket/prefix without a query, credentials or '.'/'..'/empty segments")
        return v

    @field_validator("storage_endpoint")
    @classmethod
    def _storage_endpoint(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        if not v.startswith(("http://", "https://")) or "@" in v:
            raise ValueError("expected the server's URL, http://host:port or https://host, without credentials")
        return v.strip().rstrip("/")

    @field_validator("storage_region")
    @classmethod
    def _storage_region(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", v.strip()):
            raise ValueError("expected a region name such as us-east-1")
        return v.strip()

    @field_validator("database_url")
    @classmethod
    def _db(cls, v: str) -> str:
        if not v.startswith(("sqlite", "postgresql")):
            raise ValueError("expected a sqlite:/// or postgresql+psycopg:// URL")
        if v.startswith("postgresql://"):
            v = "postgresql+psycopg://" + v[len("postgresql://"):]
        return v

    @field_validator("api_url")
    @classmethod
    def _api_url(cls, v: str) -> str:
        if not v.strip():
            return cls.model_fields["api_url"].default
        if not v.startswith(("http://", "https://")):
            raise ValueError("expected an http:// or https:// URL (where workers reach the API)")
        return v

    @field_validator("ray_address", "serve_ray_address")
    @classmethod
    def _ray_address(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None  # unset: a local head
        if "://" in v and not v.startswith(("http://", "https://")):
            raise ValueError("expected the Ray Jobs API's URL, e.g. http://ray-head:8265")
        return v

    @field_validator("rate_limit_storage_uri")
    @classmethod
    def _limits_uri(cls, v: str) -> str:
        v = v.strip() or "memory://"
        if not v.startswith(("memory://", "redis://", "rediss://", "redis+sentinel://", "redis+cluster://")):
            raise ValueError("expected memory:// or a redis:// URL (redis://host:6379/0)")
        return v

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _forwarded(cls, v: str) -> str:
        import ipaddress

        items = [i.strip() for i in v.split(",") if i.strip()]
        for item in items:
            if item == "*":
                continue
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"expected addresses or networks separated by ',' (or *); {item!r} is neither") from None
        return ",".join(items) or "127.0.0.1"

    @field_validator("serve_engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        if v not in ("transformers", "vllm", "auto"):
            raise ValueError("expected 'transformers', 'vllm' or 'auto'")
        return v

    @field_validator("ray_auth_mode")
    @classmethod
    def _auth(cls, v: str) -> str:
        if v not in ("disabled", "token"):
            raise ValueError("expected 'disabled' or 'token'")
        return v

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")


class SettingsInvalid(Exception):
    """Settings memfit refuses to start with; ``lines`` holds one line per bad variable."""

    def __init__(self, lines: list[str]):
        self.lines = lines
        super().__init__("\n".join(lines))


def load_settings(**values: Any) -> Settings:
    """Settings from the environment (``values`` override it); SettingsInvalid when one is unusable."""
    try:
        return Settings(**values)
    except ValidationError as exc:
        raise SettingsInvalid(_lines(exc.errors(), values)) from None
    except SettingsError as exc:  # a source could not even parse a value (before validation)
        field = re.search(r'field "(\w+)"', str(exc))
        name = field.group(1) if field else None
        if name not in Settings.model_fields:
            raise SettingsInvalid([f"settings: {exc}"]) from None
        raise SettingsInvalid([_line(name, _given(name, values, None), None)]) from None


@lru_cache
def get_settings() -> Settings:
    return load_settings()


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def expects(field: str) -> str:
    """What a setting accepts, in words, from its type and bounds (``lease_seconds``: "a number
    from 2 to 3600")."""
    info = Settings.model_fields[field]
    if field == "model_dirs":
        return DIRS_FORM
    if field == "cluster_nodes":
        return 'a JSON list of nodes: [{"memory_bytes": <int>, "cpus": <number>, "gpus": <number>, "count": <int>}]'
    kinds = {int: "an integer", float: "a number", bool: "true or false (or 1/0, yes/no, on/off)", Path: "a path"}
    kind = kinds.get(info.annotation, "a string")
    bounds = {k: getattr(m, k) for m in info.metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)}
    if "ge" in bounds and "le" in bounds:
        return f"{kind} from {bounds['ge']} to {bounds['le']}"
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return " ".join([kind, " and ".join(f"{words[k]} {v}" for k, v in bounds.items())]).strip()


def _given(field: str, values: dict, error_input: Any) -> Any:
    """The value as the user gave it: the environment variable's text (matched case-insensitively,
    as pydantic-settings does), else what was passed in."""
    if field in values:
        return values[field]
    env = env_name(field)
    for key, value in os.environ.items():
        if key.upper() == env:
            return value
    return error_input


def _line(field: str, given: Any, error: dict | None) -> str:
    expected = f"expected {expects(field)}"
    if error is not None and error.get("type") == "value_error":  # our validators say what is wrong
        reason = str(error["ctx"]["error"])
        expected = reason if reason.startswith("expected") else f"{reason}; {expected}"
    return f"{env_name(field)}={given!r}: {expected}"


def _lines(errors: list[dict], values: dict) -> list[str]:
    """One line per variable (a list field may fail on several items; the first one says enough)."""
    lines: dict[str, str] = {}
    for error in errors:
        loc = error.get("loc") or ()
        if not loc or loc[0] not in Settings.model_fields:
            lines.setdefault(str(loc), f"settings: {error.get('msg')}")
            continue
        field = str(loc[0])
        lines.setdefault(field, _line(field, _given(field, values, error.get("input")), error))
    return list(lines.values())


def ensure_dirs(settings: Settings) -> None:
    settings.storage_dir.mkdir(parents=True, exist_ok=True)
    if settings.is_sqlite and ":///" in settings.database_url:
        path = settings.database_url.split(":///", 1)[1]
        if path and path != ":memory:":
            Path(os.path.dirname(path) or ".").mkdir(parents=True, exist_ok=True)
