"""The sandbox python graders run in (service/domain/graders.py PythonGrader): one child process per batch of
samples, each sample one ``grade(sample, item)`` call. Layers, each enough for what it stops on its own where
the host allows it:

- **no network**: the child starts in a network namespace of its own (util-linux ``unshare --net``, where this
  host lets the service make one: as root with CAP_SYS_ADMIN, checked once) — no interface but a down
  loopback; and the interpreter refuses to create a socket (an audit hook, below), which is all there is
  where no namespace can be made (``network_isolation()`` says which);
- **no files outside its folder**: an audit hook (PEP 578, installed before the grader's code is compiled, and
  which Python code cannot remove) refuses every ``open`` outside the temporary folder it runs in and the
  standard library's own directory, and refuses ``ctypes`` (which could call libc past the hook);
- **no processes**: the same hook refuses ``os.system``, ``subprocess``, ``os.fork``, ``os.exec*``,
  ``os.posix_spawn``; as root the child also drops to user ``nobody`` (with ``RLIMIT_NPROC`` 0) before the
  grader's code runs, after importing the standard-library modules a grader may use (RUNNER's list: an
  interpreter under a private home is unreadable to nobody);
- **limits**: ``RLIMIT_AS`` (memory), ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, no
  core files — set by the child's first lines, before it reads the grader (no ``preexec_fn``: the graders run
  inside the multi-threaded training worker, where forking into Python code can deadlock) — and a wall-clock
  timeout after which the child's whole process group is killed;
- **nothing inherited**: an empty environment (PATH only), ``python -I -S -B`` (no site-packages, no user
  paths, no PYTHON* variables), a fresh temporary working directory removed afterwards, stdin closed.

A sample whose ``grade`` raises, returns a non-number or breaks a rule scores 0 with the reason; a batch that
exceeds its time or memory scores 0 for every sample not yet graded, with the reason.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from service.domain.graders import PythonGrader, Score



@dataclass(frozen=True)
class Limits:
    timeout_s: float = 30.0  # wall clock, the whole batch
    cpu_s: int = 20  # CPU seconds, the whole batch
    memory_bytes: int = 512 * 2**20  # address space
    file_bytes: int = 1 * 2**20  # largest file it may write (in its folder)
    open_files: int = 32
    max_output_bytes: int = 4 * 2**20


# What runs in the child: read the batch, lock the interpreter down, then compile and call the grader.
RUNNER = r'''
import json, math, sys, os, resource
# the limits first (sys.argv[1:6]: address space, CPU seconds, file size, open files), then everything else
for _limit, _value in zip((resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE, resource.RLIMIT_NOFILE),
                          sys.argv[1:5]):
    resource.setrlimit(_limit, (int(_value), int(_value)))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
_out = sys.stdout
_batch = json.load(open("batch.json"))
_source = open("grader.py").read()
_here = os.path.realpath(os.getcwd())
_stdlib = [os.path.realpath(p) for p in sys.argv[5:]]
# The standard library modules a grader may import, imported now: as root the child drops to nobody next,
# who cannot read an interpreter installed under a private home.
for _m in ("math", "json", "re", "statistics", "collections", "itertools", "functools", "string", "difflib",
           "random", "decimal", "fractions", "unicodedata", "datetime", "io", "operator", "heapq", "bisect",
           "typing", "dataclasses", "textwrap", "ast", "copy", "numbers", "enum", "time", "hashlib", "base64"):
    __import__(_m)
if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))

def _hook(event, args):
    if event == "open":
        path = args[0]
        if isinstance(path, int):
            return
        real = os.path.realpath(os.fsdecode(path))
        if real == _here or real.startswith(_here + os.sep):
            return
        mode = args[1] if len(args) > 1 and isinstance(args[1], str) else "r"
        if any(real.startswith(p + os.sep) for p in _stdlib) and not any(c in mode for c in "wax+"):
            return
        raise PermissionError(f"the grader sandbox refuses to open {real!r}")
    if event in ("os.listdir", "os.scandir") and args and args[0] is not None:
        real = os.path.realpath(os.fsdecode(args[0]) if not isinstance(args[0], int) else _here)
        if real != _here and not real.startswith(_here + os.sep):
            raise PermissionError(f"the grader sandbox refuses to list {real!r}")
    if event in ("socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo", "socket.sendto"):
        raise PermissionError("the grader sandbox has no network")
    if (event in ("os.system", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.kill",
                  "os.killpg", "subprocess.Popen", "pty.spawn", "os.startfile", "os.chdir", "sys.addaudithook")
            or event.startswith(("ctypes.", "_posixsubprocess", "mmap.", "shutil.", "winreg."))):
        raise PermissionError(f"the grader sandbox refuses {event}")

sys.addaudithook(_hook)
for _name in ("ctypes", "_ctypes", "socket", "_socket", "subprocess", "_posixsubprocess", "multiprocessing"):
    sys.modules[_name] = None
del _name
_results = []
try:
    _ns = {"__name__": "grader"}
    exec(compile(_source, "grader.py", "exec"), _ns)
    _grade = _ns["grade"]
except BaseException as exc:
    _err = f"the grader's source failed: {type(exc).__name__}: {exc}"
    for _ in _batch:
        _out.write(json.dumps({"error": _err}) + "\n")
else:
    import io
    for _sample, _item in _batch:
        sys.stdout = io.StringIO()
        try:
            _v = _grade(_sample, _item)
            if isinstance(_v, bool) or not isinstance(_v, (int, float)) or not math.isfinite(_v):
                _results.append({"error": f"grade returned {type(_v).__name__} {str(_v)[:40]}, not a finite number"})
            else:
                _results.append({"value": float(_v)})
        except BaseException as exc:
            _results.append({"error": f"{type(exc).__name__}: {str(exc)[:400]}"})
        finally:
            sys.stdout = _out
        _out.write(json.dumps(_results[-1]) + "\n")
        _out.flush()
'''


def _stdlib_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    return sorted({os.path.realpath(paths["stdlib"]), os.path.realpath(paths["platstdlib"])})


def network_isolation() -> str:
    """How the child is cut off from the network here: 'netns' (a network namespace of its own) or 'audit-hook'."""
    return "netns" if _netns_prefix() else "audit-hook"


@functools.lru_cache(maxsize=1)
def _netns_prefix() -> tuple[str, ...]:
    """``unshare --net --`` where it works on this host (tried once), else nothing."""
    tool = shutil.which("unshare")
    if tool is None or os.geteuid() != 0:
        return ()
    try:
        ok = subprocess.run([tool, "--net", "--", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (tool, "--net", "--") if ok else ()


def run_python_grader(grader: PythonGrader, samples: list[tuple[dict, dict]], limits: Limits | None = None) -> list[Score]:
    """Score each (item, sample) with ``grader.source``'s ``grade(sample, item)`` in the sandbox."""
    limits = limits or Limits()
    if not samples:
        return []
    with tempfile.TemporaryDirectory(prefix="memfit-grader-") as workdir:
        Path(workdir, "batch.json").write_text(json.dumps([[sample, item] for item, sample in samples]))
        Path(workdir, "grader.py").write_text(grader.source)
        Path(workdir, "runner.py").write_text(RUNNER)
        os.chmod(workdir, 0o755)
        for name in ("batch.json", "grader.py", "runner.py"):
            os.chmod(Path(workdir, name), 0o644)
        limit_args = [str(v) for v in (limits.memory_bytes, limits.cpu_s, limits.file_bytes, limits.open_files)]
        proc = subprocess.Popen(
            [*_netns_prefix(), sys.executable, "-I", "-S", "-B", "runner.py", *limit_args, *_stdlib_dirs()],
            cwd=workdir, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        reason = None
        try:
            out, err = proc.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            reason = f"the python grader ran past its {limits.timeout_s:g} s timeout and was stopped"
        _kill_group(proc)  # anything it left behind in its group
    results = []
    for line in out[:limits.max_output_bytes].decode("utf-8", "replace").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        results.append(Score(value=0.0, error=r["error"]) if "error" in r else Score(value=r["value"]))
    if len(results) < len(samples):
        if reason is None:
            reason = _why(proc.returncode, err.decode("utf-8", "replace"), limits)
        results += [Score(value=0.0, error=reason)] * (len(samples) - len(results))
    return results[:len(samples)]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _why(returncode: int, stderr: str, limits: Limits) -> str:
    if returncode == -signal.SIGXCPU or returncode == -signal.SIGKILL and "MemoryError" not in stderr:
        return f"the python grader used up its {limits.cpu_s} CPU seconds and was stopped"
    if "MemoryError" in stderr:
        return f"the python grader ran out of its {limits.memory_bytes // 2**20} MiB memory limit and was stopped"
    tail = stderr.strip().splitlines()[-1:] or [f"exit status {returncode}"]
    return f"the python grader's process ended early: {tail[0][:400]}"
