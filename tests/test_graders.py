"""OpenAI's graders (service/domain/graders.py) and the python grader's sandbox (service/domain/sandbox.py):
scores, templates, refusals, and code that tries to leave the sandbox. Fast, no Ray, no torch."""

from __future__ import annotations

import time

import pytest
from pydantic import TypeAdapter, ValidationError

from service.domain.graders import (
    Grader,
    GraderError,
    bleu,
    check_row,
    gleu,
    grade_batch,
    item_fields,
    render,
    rouge_l,
    rouge_n,
)
from service.domain.sandbox import Limits, network_isolation, run_python_grader

GRADER = TypeAdapter(Grader)


def grader(**body):
    return GRADER.validate_python(body)


def scores(g, pairs, **kw):
    return [s.value for s in grade_batch(g, pairs, python=run_python_grader, **kw)]


def test_string_check_operations():
    row = {"label": "Paris"}
    for op, outputs in {"eq": {"Paris": 1, "paris": 0}, "ne": {"Paris": 0, "Rome": 1},
                        "like": {"It is Paris.": 1, "Rome": 0}, "ilike": {"it is PARIS": 1, "Rome": 0}}.items():
        g = grader(type="string_check", name="s", input="{{sample.output_text}}", reference="{{item.label}}",
                   operation=op)
        assert scores(g, [(row, text) for text in outputs]) == [float(v) for v in outputs.values()], op


def test_templates_read_nested_fields_and_name_missing_ones():
    assert render("{{ item.a.b }}-{{item.n}}-{{sample.output_json.x}}", {"a": {"b": "B"}, "n": 3},
                  {"output_text": "", "output_json": {"x": [1]}}) == "B-3-[1]"
    g = grader(type="string_check", name="s", input="{{sample.output_text}}", reference="{{item.answer}}",
               operation="eq")
    assert item_fields(g) == {"answer"}
    with pytest.raises(GraderError, match=r"reads \{\{item.answer\}\}, which the row lacks"):
        check_row(g, {"messages": []})
    [s] = grade_batch(g, [({}, "x")])
    assert s.value == 0.0 and "no field 'answer'" in s.error


def test_text_similarity_metrics():
    assert bleu("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert 0 < bleu("the cat sat on a mat", "the cat sat on the mat") < 1
    assert gleu("a b c", "a b c") == 1.0 and gleu("x", "a b") == 0.0
    assert rouge_n("a b c d", "a b x d", 1) == pytest.approx(0.75)
    assert rouge_n("a b c d", "a b x d", 2) == pytest.approx(1 / 3)
    assert rouge_l("a b c d", "a x c d") == pytest.approx(0.75)
    g = grader(type="text_similarity", name="t", input="{{sample.output_text}}", reference="{{item.r}}",
               evaluation_metric="fuzzy_match")
    assert scores(g, [({"r": "abcd"}, "abcd"), ({"r": "abcd"}, "abxd")]) == [1.0, 0.75]


@pytest.mark.parametrize("metric", ["cosine", "meteor"])
def test_metrics_that_need_models_are_refused_clearly(metric):
    with pytest.raises(ValidationError, match=f"evaluation_metric '{metric}' is not supported"):
        grader(type="text_similarity", name="t", input="a", reference="b", evaluation_metric=metric)


def test_multi_grader_calculates_output_over_named_graders():
    g = grader(type="multi", name="m", calculate_output="0.5 * exact + 0.5 * max(sim, 0)", graders={
        "exact": {"type": "string_check", "name": "e", "input": "{{sample.output_text}}",
                  "reference": "{{item.r}}", "operation": "eq"},
        "sim": {"type": "text_similarity", "name": "f", "input": "{{sample.output_text}}",
                "reference": "{{item.r}}", "evaluation_metric": "fuzzy_match"}})
    [a, b] = grade_batch(g, [({"r": "abcd"}, "abcd"), ({"r": "abcd"}, "abxd")])
    assert a.value == 1.0 and a.parts == {"exact": 1.0, "sim": 1.0}
    assert b.value == pytest.approx(0.375)
    with pytest.raises(ValidationError, match="calculate_output reads nope, which name no grader"):
        grader(type="multi", name="m", calculate_output="nope", graders=g.graders)
    with pytest.raises(ValidationError, match="calculate_output may call only"):
        grader(type="multi", name="m", calculate_output="__import__('os')", graders=g.graders)


def test_score_model_reads_the_first_number_clipped_to_its_range():
    g = grader(type="score_model", name="judge", model="preset:tiny-llama", range=[0, 10],
               input=[{"role": "user", "content": "Reference {{item.r}}; answer {{sample.output_text}}. Score:"}])
    asked = []

    def model(gr, prompts):
        asked.extend(prompts)
        return ["7.5 points", "no idea", "42"]

    out = grade_batch(g, [({"r": "x"}, "a"), ({"r": "y"}, "b"), ({"r": "z"}, "c")], model=model)
    assert [s.value for s in out] == [7.5, 0.0, 10.0]
    assert asked[0] == "Reference x; answer a. Score:" and "holds no number" in out[1].error
    with pytest.raises(ValidationError, match="only input_text and output_text"):
        grader(type="score_model", name="j", model="m",
               input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}])


def test_python_grader_scores_in_the_sandbox():
    g = grader(type="python", name="p", source="import json\ndef grade(sample, item):\n"
                                                "    print('noise')\n    return float(sample['output_text'] == item['label'])")
    assert scores(g, [({"label": "a"}, "a"), ({"label": "a"}, "b")]) == [1.0, 0.0]
    with pytest.raises(ValidationError, match="must define grade"):
        grader(type="python", name="p", source="x = 1")


ESCAPES = {
    "read /etc/passwd": ("def grade(s, i):\n    return len(open('/etc/passwd').read())", "refuses to open '/etc/passwd'"),
    "read via os.open": ("import os\ndef grade(s, i):\n    return os.read(os.open('/proc/self/environ', 0), 10)",
                         "refuses to open"),
    "list /": ("import os\ndef grade(s, i):\n    return len(os.listdir('/'))", "refuses to list '/'"),
    "write outside": ("def grade(s, i):\n    open('/tmp/pwned', 'w').write('x'); return 1", "refuses to open '/tmp/pwned'"),
    "socket module": ("import socket\ndef grade(s, i):\n    return 1", "import of socket halted"),
    "raw _socket": ("import sys\ndel sys.modules['_socket']\ndef grade(s, i):\n    import _socket\n"
                    "    _socket.socket(); return 1", "No module named '_socket'|no network"),
    "ctypes": ("def grade(s, i):\n    import ctypes; return 1", "import of ctypes halted"),
    "os.system": ("import os\ndef grade(s, i):\n    return os.system('id')", "refuses os.system"),
    "fork bomb": ("import os\ndef grade(s, i):\n    while True: os.fork()", "refuses os.fork"),
    "exec": ("import os\ndef grade(s, i):\n    os.execv('/bin/sh', ['sh'])", "refuses os.exec"),
    "allocate 2 GiB": ("def grade(s, i):\n    return len(bytearray(2 * 2**30))", "MemoryError"),
    "environment": ("import os\ndef grade(s, i):\n    return float(len(os.environ) > 2)", None),
}


@pytest.mark.parametrize("name", list(ESCAPES))
def test_python_grader_escapes_are_stopped(name, tmp_path):
    source, reason = ESCAPES[name]
    [s] = run_python_grader(grader(type="python", name="p", source=source), [({}, {"output_text": ""})])
    assert s.value == 0.0
    if reason is None:
        assert s.error is None  # a scrubbed environment: PATH and LANG only
    else:
        assert s.error is not None and __import__("re").search(reason, s.error), s.error
    assert not __import__("os").path.exists("/tmp/pwned")


def test_python_grader_runaway_is_stopped_by_cpu_and_wall_clock():
    spin = grader(type="python", name="p", source="def grade(s, i):\n    while True: pass")
    t0 = time.monotonic()
    [s] = run_python_grader(spin, [({}, {"output_text": ""})], Limits(timeout_s=5, cpu_s=1))
    assert "CPU seconds" in s.error and time.monotonic() - t0 < 5
    sleep = grader(type="python", name="p", source="import time\ndef grade(s, i):\n    time.sleep(60)")
    t0 = time.monotonic()
    [s] = run_python_grader(sleep, [({}, {"output_text": ""})], Limits(timeout_s=1))
    assert "timeout" in s.error and time.monotonic() - t0 < 5


def test_python_grader_has_its_own_network_namespace_here():
    """The namespace alone (no audit hook) stops a connection to a port this host listens on (Postgres)."""
    import subprocess
    import sys

    from service.domain.sandbox import _netns_prefix

    assert network_isolation() == "netns"  # root on the developers' machine and in CI
    probe = "import socket; s = socket.create_connection(('127.0.0.1', 5432), timeout=2); print('connected')"
    inside = subprocess.run([*_netns_prefix(), sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert inside.returncode != 0 and "connected" not in inside.stdout
    assert "Network is unreachable" in inside.stderr or "Connection refused" in inside.stderr, inside.stderr
