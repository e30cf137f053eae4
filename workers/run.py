"""The Ray job entrypoint: ``python -m workers.run REQUEST.json``.

1. validates the RunRequest (pydantic) and the spec's cross-field rules;
2. validates the data files — a bad row fails here, naming file and line, before any worker starts —
   and the model (workers/models.py: check_model): one that cannot be loaded fails the job here with
   ``model_unavailable``, once, instead of failing every worker group Ray Train would start;
3. runs ``TorchTrainer.fit()`` with RunConfig(name=job_id, storage_path=<output_dir>/ray, or
   <output_uri>/ray in the bucket of MEMFIT_STORAGE_URL) and the metrics callback. ``output_dir`` is the
   attempt's own folder (service/scheduler/paths.py: attempt_dir); a worker group Ray Train restarts within the attempt resumes from the run's latest
   checkpoint, the first one of a new attempt from ``resume_from`` (an earlier attempt's checkpoint);
4. exits 0, or non-zero with one line of JSON on stderr: {"error": {"code", "message", ...}} —
   RUN_LOST_EXIT_CODE, reporting nothing, when Ray lost the run under it (the scheduler resubmits).

Connects with ``ray.init(address="auto")`` when RAY_ADDRESS is set (a Ray job always has it) and
starts a private local instance otherwise (``address="local"``: never attach to a stranger's cluster).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from service.domain.datafmt import DataError, read_jsonl
from service.domain.errors import RUN_LOST_EXIT_CODE, find_storage_full
from service.domain.spec import RunRequest, SpecError, check_rules
from workers.models import ModelSourceError, check_model
from workers.sink import RecordCallback, _ingest_wait_s, failure_records, make_sinks

HEALTH_CHECK_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1"}
# Ray Train V2 starts a preemption watcher per worker group: an actor (a process that imports Ray, about
# 1.8 CPU-seconds measured) polling node drain state so that a training function may ask
# ray.train.get_preemption_info(). memfit's loop never asks; a node that goes away is handled by
# max_failures and the scheduler. The driver sets this before the trainer is built and Ray Train carries it
# to the controller, which reads it (a value set by the operator is kept).
TRAIN_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
FAILURE_FIELDS = ("code", "message", "param", "rank", "step", "phase")  # service/domain/records.py: FailureRecord


class RunLost(RuntimeError):
    """Ray lost the run under it (the head, a raylet or the GCS went away): nothing about the
    training failed, so no failure is reported — the driver exits RUN_LOST_EXIT_CODE and the
    scheduler resubmits the job as a new attempt that resumes from the latest checkpoint."""


class RunFailed(RuntimeError):
    def __init__(self, error: dict):
        self.error = error
        super().__init__(error.get("message", "run failed"))


def train_loop_per_worker(config: dict) -> None:
    """What every Ray Train worker runs: the spec again (validated), flat args, one strategy."""
    from workers.args import train_args
    from workers.steps import WorkerEnv
    from workers.strategies import train

    from workers.steps import OOM_ERRORS

    from workers.elastic import ElasticRefused, apply_world_size
    from workers.peft_setup import leave_out_unused_backends

    req = on_this_node(RunRequest.model_validate(config["request"]))
    env = WorkerEnv.from_ray()
    try:
        # resources.min_workers: the world size Ray Train gave this group, re-planned (workers/elastic.py)
        req, elastic_events = apply_world_size(req, env.world_size)
    except ElasticRefused as exc:
        _write_rank_failure(req.output_dir, env.rank, exc.error)
        raise
    args = train_args(req, fail_at=config.get("fail_at"))
    leave_out_unused_backends(args.peft_method, args.qat_enabled, args.model_path or args.model)
    if env.rank == 0:
        args.extra["events"] = elastic_events
    env.resume_dir = req.resume_from
    if req.spec.training.on_oom == "downshift" and _ran_out_of_memory(req.output_dir):
        # Ray Train restarts a failed worker group with the same configuration, which would run out of
        # memory again at the same step: end this attempt now; the scheduler downshifts the job.
        raise RuntimeError("a worker group of this attempt ran out of memory and training.on_oom is downshift: "
                           "not retrying the same configuration")
    try:
        train(args, env)
    except DataError as exc:  # a row the model's tokenizer cannot encode (a chat template that ignores its tools)
        _write_rank_failure(req.output_dir, env.rank, {"code": "data_error", "message": str(exc)[:8000],
                                                      "param": "training_file", "phase": "load_data"})
        raise
    except ModelSourceError as exc:
        # The driver's check passed, yet this worker cannot load the model (a corrupt weight file, a
        # node whose cache differs): the job's error says so, not "worker_error".
        _write_rank_failure(req.output_dir, env.rank, _model_error(exc))
        raise
    except OOM_ERRORS as exc:
        # Out of memory outside the step the strategies guard (eval at a checkpoint, the checkpoint's own
        # gathers, the export): still out_of_memory, so that on_oom applies; the step's own failure
        # (with its post-mortem) was written by the strategy and is kept.
        if not Path(req.output_dir, f"failure-rank{env.rank}.json").is_file():
            _write_rank_failure(req.output_dir, env.rank, {
                "code": "out_of_memory", "message": f"{type(exc).__name__}: {exc}"[:8000],
                "phase": "outside the training step"})
        raise


def _ran_out_of_memory(output_dir: str) -> bool:
    """Whether a rank of this attempt (``output_dir`` is the attempt's own folder) wrote an out-of-memory failure."""
    for path in Path(output_dir).glob("failure-rank*.json"):
        try:
            if json.loads(path.read_text()).get("code") == "out_of_memory":
                return True
        except (OSError, ValueError):
            continue
    return False


def _model_error(exc: ModelSourceError) -> dict:
    return {"code": "model_unavailable", "message": str(exc), "param": "model", "phase": "load_model"}


def _write_rank_failure(output_dir: str, rank: int, error: dict) -> None:
    """A structured failure beside the outputs, where fit() looks (workers/sink.py: failure_records)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"failure-rank{rank}.json").write_text(json.dumps({"kind": "failure", **error, "rank": rank}))


def on_this_node(req: RunRequest) -> RunRequest:
    """The request as this process reads it: on object storage (RunRequest.object_store) the store
    attached (workers/storage.py: exports published there) and the data files copied to a local cache
    once per node; on the volume, as it is."""
    import tempfile

    from workers.storage import attach, localize

    attach(req.output_dir, req.object_store, req.output_uri)
    if req.object_store is None:
        return req
    cache = Path(tempfile.gettempdir()) / "memfit-cache"
    return req.model_copy(update={
        "training_path": localize(req.training_path, req.object_store, cache),
        "validation_path": localize(req.validation_path, req.object_store, cache) if req.validation_path else None})


def validate(req: RunRequest) -> None:
    problems = check_rules(req.spec)
    if problems:
        raise SpecError(problems)
    for path in (req.training_path, req.validation_path):
        if path is None:
            continue
        if not Path(path).exists():
            raise DataError(0, "file not found", path)
        read_jsonl(path)
    check_model(req.spec.model, req.model_path)


def _fail_at_from_env() -> str | None:
    """Fault injection for tests: MEMFIT_FAIL_AT_STEP (or MEMFIT_WORKER_FAIL_AT_STEP, which the
    scheduler forwards into Ray jobs) = "<step>[:<rank>]"."""
    return os.environ.get("MEMFIT_FAIL_AT_STEP") or os.environ.get("MEMFIT_WORKER_FAIL_AT_STEP")


def trainer_class():
    """TorchTrainer without Ray Data's dataset manager. Ray Train V2 starts a DatasetManager actor for
    every worker group even when no Ray dataset is passed (another process importing Ray and Ray Data,
    1.5–2 CPU-seconds measured); memfit passes none (each rank reads its JSONL file), so it leaves that
    callback out. Pinned to Ray 2.60's private ``_create_default_callbacks``: tests/test_workers_ray.py
    fails if a run starts the actor again or the hook goes away."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    class Trainer(TorchTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            return [c for c in callbacks if not isinstance(c, DatasetsCallback)]

    return Trainer


def build_trainer(req: RunRequest, fail_at: str | None = None):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    for name, value in TRAIN_ENV.items():
        os.environ.setdefault(name, value)
    t = req.spec.training
    res = t.resources
    use_gpu = res.gpus_per_worker > 0
    per_worker = {"CPU": res.cpus_per_worker}
    if use_gpu:
        per_worker["GPU"] = res.gpus_per_worker
    callback = RecordCallback(attempt=req.attempt, metrics_path=req.metrics_path, ingest_url=req.ingest_url,
                              ingest_token=req.ingest_token, job_id=req.job_id, output_dir=req.output_dir,
                              integrations=[i.model_dump(mode="json") for i in req.spec.integrations or []],
                              config=req.spec.model_dump(mode="json", exclude={"integrations"}),
                              remote=(req.output_dir, req.object_store, req.output_uri) if req.object_store else None)
    return trainer_class()(
        train_loop_per_worker,
        # The workers never post records (the controller's callback does): they do not get the token.
        train_loop_config={"request": req.model_dump(mode="json", exclude={"ingest_token"}),
                           "fail_at": fail_at if fail_at is not None else _fail_at_from_env()},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo",
                                 timeout_s=int(os.environ.get("MEMFIT_DIST_TIMEOUT_S", "1800"))),
        # resources.min_workers: Ray Train V2's elastic group, started with as many workers as there is room for
        scaling_config=ScalingConfig(num_workers=_worker_range(res), use_gpu=use_gpu, resources_per_worker=per_worker),
        run_config=RunConfig(
            name=req.job_id,
            **_run_storage(req),
            failure_config=FailureConfig(max_failures=t.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            callbacks=[callback],
        ),
    )


def _run_storage(req: RunRequest) -> dict:
    """Ray Train's run storage: ``<output_dir>/ray`` on the volume, or ``<output_uri>/ray`` in the
    bucket through the store's ``pyarrow.fs`` filesystem (Ray Train uploads and downloads checkpoints)."""
    if req.object_store is None or not req.output_uri:
        return {"storage_path": str(Path(req.output_dir).resolve() / "ray")}
    store = req.object_store
    return {"storage_path": store.fs_path(store.key_of(req.output_uri) + "/ray"), "storage_filesystem": store.filesystem}


def _worker_range(res) -> int | tuple[int, int]:
    if res.min_workers is None or res.min_workers >= res.num_workers:
        return res.num_workers
    return (res.min_workers, res.num_workers)


def fit(req: RunRequest, fail_at: str | None = None):
    """Validate, train, return Ray's Result. Ray must be initialized. Raises RunFailed with a
    structured error (and writes it to the sinks) when training fails."""
    started = time.time()
    try:
        validate(on_this_node(req))  # the trainer gets the request as it is: each worker localises it
    except (DataError, SpecError, ModelSourceError) as exc:
        if isinstance(exc, DataError):
            error = {"code": "data_error", "message": str(exc), "file": exc.path, "line": exc.line}
        elif isinstance(exc, ModelSourceError):
            error = {k: v for k, v in _model_error(exc).items() if k != "phase"}
        else:
            error = {"code": "invalid_spec", "message": str(exc), "errors": [p.model_dump() for p in exc.problems]}
        _emit_failure(req, error)
        raise RunFailed(error) from None
    trainer = build_trainer(req, fail_at)
    try:
        return trainer.fit()
    except Exception as exc:  # noqa: BLE001 - every training failure becomes one structured error
        if infrastructure_lost(exc):
            raise RunLost(f"{type(exc).__name__}: {exc}"[:2000]) from exc
        failures = failure_records(req.output_dir, req.attempt, since=started)
        if failures:
            error = {k: failures[0].get(k) for k in FAILURE_FIELDS}
        else:
            error = _storage_full_error(exc) or {"code": "worker_error",
                                                 "message": f"{type(exc).__name__}: {exc}"[:2000]}
            failures = [_failure(req, error)]
        _deliver_failures(req, failures)
        raise RunFailed(error) from exc


def infrastructure_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is Ray losing contact with its own processes — an actor
    unavailable, a raylet or node gone, an RPC to the GCS failing — rather than the training failing.
    A worker that died (ActorDiedError: the OOM killer, a segfault) is the training's failure."""
    import ray.exceptions as rex

    lost = (rex.ActorUnavailableError, rex.LocalRayletDiedError, rex.NodeDiedError, rex.RaySystemError, rex.RpcError)
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, lost):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _storage_full_error(exc: BaseException) -> dict | None:
    """``storage_full`` when an out-of-space error is anywhere in what fit() raised: in a rank's
    exception (Ray Train's WorkerGroupError.worker_failures, each a wrapped original), the
    controller's, or their causes. A worker cannot write a failure file on a full disk, so the error
    is read from the exception itself. The message names what was being written, and where."""
    ranks = getattr(exc, "worker_failures", None) or {}
    found, rank = None, None
    for r in sorted(ranks):
        found, rank = find_storage_full(ranks[r]), r
        if found is not None:
            break
    if found is None:
        found, rank = find_storage_full(exc), None
    if found is None:
        return None
    if isinstance(found, OSError) and found.errno is not None and found.strerror:
        what = found.strerror if found.strerror.startswith("no space left") else (
            f"no space left on the storage volume: {found.strerror}"
            + (f": {found.filename}" if found.filename else ""))
    else:  # only a text says so (a traceback a wrapper carries): its line that does
        lines = [line.strip() for line in str(found).splitlines() if "space left" in line or "quota" in line]
        what = f"no space left on the storage volume: {lines[-1] if lines else ' '.join(str(found).split())}"
    # The tenant's quota (workers/checkpoint.py: StorageQuotaError, checked before the write), not a full volume.
    code = "storage_quota_exceeded" if "MEMFIT_QUOTA_STORAGE_BYTES" in str(found) else "storage_full"
    if code == "storage_quota_exceeded":
        what = (found.strerror if isinstance(found, OSError) and found.strerror else str(found)).strip()
    return {"code": code, "message": what[:2000], "rank": rank, "phase": getattr(found, "phase", None)}


def _deliver_failures(req: RunRequest, failures: list[dict]) -> None:
    """Write the failure to the run's sinks. Their spool lives in the job's storage: when that volume
    is full the spool cannot take it, so it is posted from a spool in the temporary directory."""
    spooled = True
    for sink in make_sinks(req):
        try:
            sink.write(failures)
        except OSError:  # a JsonlSink on a full volume
            spooled = False
        spooled = spooled and not getattr(sink, "dropped", 0)
        sink.close()
    if spooled or not req.ingest_url:
        return
    from workers.sink_http import HttpSink

    try:
        sink = HttpSink(req.ingest_url, req.ingest_token, close_timeout_s=_ingest_wait_s())
    except OSError:
        return  # the temporary directory is full too: the driver's stderr line is all there is
    sink.write(failures)
    sink.close()


def _failure(req: RunRequest, error: dict) -> dict:
    details = {k: v for k, v in error.items() if k not in FAILURE_FIELDS}
    return {"kind": "failure", "attempt": req.attempt, "time": time.time(),
            **{k: error.get(k) for k in FAILURE_FIELDS}, "details": details}


def _emit_failure(req: RunRequest, error: dict) -> None:
    for sink in make_sinks(req):
        sink.write([_failure(req, error)])
        sink.close()


def abort_on_sigterm() -> None:
    """Ray Jobs' stop (memfit's cancel, pause, stall restart, fencing of an earlier attempt) sends this
    driver SIGTERM and SIGKILL ``RAY_JOB_STOP_WAIT_TIME_S`` later. Ended outright, the driver takes Ray
    Train's controller with it before the controller cancels its request with Ray's autoscaling
    coordinator (ray/train/v2/_internal/execution/scaling_policy/scaling_policy.py:
    ``before_controller_abort``), and that request keeps its CPUs reserved there for
    ``AUTOSCALING_REQUESTS_EXPIRE_TIME_S`` (180 s, autoscaling_coordinator_client.py): an elastic job
    (``resources.min_workers``), which starts with the workers the coordinator can reserve, waits for them.
    So SIGTERM is handled as Ray Train handles Ctrl-C during ``fit()`` (data_parallel_trainer.py:
    ``_register_sigint_handler``): the controller aborts, cancelling its request and stopping the workers,
    and the driver exits; nothing is reported, since the scheduler stopped the run and knows why. Outside
    ``fit()`` (no controller yet) the driver exits as SIGTERM would end it."""
    def on_sigterm(signum, frame):
        during_fit = signal.getsignal(signal.SIGINT)
        if callable(during_fit) and during_fit is not signal.default_int_handler:
            during_fit(signal.SIGINT, frame)  # Ray Train's: controller.abort(), then sys.exit(0)
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


def supervisor_temp_dir() -> str | None:
    """The temp dir of the Ray node whose job supervisor started this driver, or None.

    A driver attaches to a raylet of its host, and where a host runs several Ray nodes Ray picks the head's
    (ray._private.services.get_node_to_connect_for_driver) unless told the node's temp dir. Ray Train pins
    its controller to the driver's node: a driver running on a worker node but attached to the head would
    have its controller on the head, and a head restart would take the run with it although the driver's
    node lives on. The supervisor is an ancestor of this process (a Ray worker, RAY_RAYLET_PID in its
    environment, which Ray strips from the driver's), and its raylet's command line names the temp dir.
    One node per host, as on Kubernetes, gives the same node either way."""
    pid = os.getppid()
    try:
        for _ in range(4):  # the supervisor, or the shell it ran the entrypoint in, and so on
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            raylet = next((e.split(b"=", 1)[1] for e in env if e.startswith(b"RAY_RAYLET_PID=")), None)
            if raylet is not None:
                args = Path(f"/proc/{int(raylet)}/cmdline").read_bytes().split(b"\0")
                return next((a.split(b"=", 1)[1].decode() for a in args if a.startswith(b"--temp_dir=")), None)
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if pid <= 1:
                return None
    except (OSError, ValueError):  # not Linux, another user's process, a process gone meanwhile
        return None
    return None


def init_ray() -> None:
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto", log_to_driver=True, _temp_dir=supervisor_temp_dir())
    else:
        ray.init(address="local", include_dashboard=False, runtime_env={"env_vars": HEALTH_CHECK_ENV})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m workers.run REQUEST.json", file=sys.stderr)
        return 2
    try:
        req = RunRequest.model_validate_json(Path(argv[0]).read_text())
    except OSError as exc:
        print(json.dumps({"error": {"code": "invalid_request", "message": str(exc)}}), file=sys.stderr)
        return 2
    except ValueError as exc:
        errors = getattr(exc, "errors", lambda: [])()
        print(json.dumps({"error": {"code": "invalid_request", "message": str(exc).splitlines()[0],
                                    "errors": [{"param": ".".join(map(str, e["loc"])), "message": e["msg"]} for e in errors]}},
                         default=str), file=sys.stderr)
        return 2
    try:
        init_ray()
        abort_on_sigterm()  # after ray.init, whose core worker installs a SIGTERM handler of its own
        fit(req)
    except RunLost as exc:
        print(json.dumps({"error": {"code": "ray_run_lost", "message": str(exc)}}), file=sys.stderr)
        return RUN_LOST_EXIT_CODE
    except RunFailed as exc:
        print(json.dumps({"error": exc.error}, default=str), file=sys.stderr)
        return 1
    print(json.dumps({"status": "succeeded", "job_id": req.job_id, "output_dir": req.output_dir}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
