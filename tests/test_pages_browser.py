"""The dashboard in a real browser (Debian's chromium, headless, driven by Playwright's Python package)
for a job that really ran: real Postgres, the real API on a port, the scheduler submitting to the
session's real Ray head, real training on CPU. ONE real job serves every page test.

Asserts on what the charts hold (window.memfitCharts), not only that pages load; live updates are
checked by ingesting records through the ingest endpoint while a job page is open. Each page's
screenshot is saved under the `artifacts_dir` fixture (test-artifacts/).

Without chromium the tests skip; with MEMFIT_REQUIRE_BROWSER=1 (CI) they fail instead.
"""

from __future__ import annotations

import os
import shutil
import time

import httpx
import pytest

from service.scheduler.loop import Scheduler
from service.scheduler.ray_jobs import RayJobs
from tests.factories import new_key
from tests.stack import Stack

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CHROMIUM = os.environ.get("MEMFIT_CHROMIUM", "/usr/bin/chromium")
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run"]
STEPS = 6  # the finished job's steps (tests/stack.py: TINY)


def _no_browser(reason: str):
    if os.environ.get("MEMFIT_REQUIRE_BROWSER") == "1":
        pytest.fail(f"a browser is required (MEMFIT_REQUIRE_BROWSER=1): {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        _no_browser(f"playwright is not installed: {exc}")
    path = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    if not path:
        _no_browser(f"no chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=path, args=LAUNCH_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def stack(shared_stack):
    """The session's stack: its finished job is the real job every page test reads."""
    return shared_stack


@pytest.fixture(scope="module")
def real_job(finished_job) -> dict:
    """The session's one finished fine-tune (DDP, 2 workers, LoRA, a validation file; tests/conftest.py)."""
    return finished_job


@pytest.fixture
def hand_stack(new_database, ray_head, tmp_path_factory):
    """A stack of its own with no scheduler: its job is claimed and fed through the ingest endpoint by hand."""
    with new_database() as url:
        s = Stack(url, tmp_path_factory.mktemp("pages-hand-storage"), ray_head)
        yield s
        s.close()


def login(context, base_url: str, key: str, screenshot=None):
    page = context.new_page()
    page.goto(f"{base_url}/ui/jobs")
    assert "/ui/login" in page.url  # no key yet: the login form
    if screenshot is not None:
        page.screenshot(path=str(screenshot))
    page.fill("#api_key", key)
    page.click("#login-submit")
    page.wait_for_url(f"{base_url}/ui/jobs")
    return page


def chart_state(page) -> dict:
    return page.evaluate("""() => {
      const c = window.memfitCharts;
      const ds = ch => ch.data.datasets.map(d => ({label: d.label, category: d.category, hidden: !!d.hidden,
                                                  stack: d.stack || null, data: d.data.slice()}));
      const memory = {};
      for (const [rank, ch] of Object.entries(c.memory)) {
        memory[rank] = {labels: ch.data.labels.slice(), datasets: ds(ch), stacked: !!ch.options.scales.y.stacked};
      }
      return {loss: {labels: c.loss.data.labels.slice(), datasets: ds(c.loss)},
              throughput: {labels: c.throughput.data.labels.slice(), datasets: ds(c.throughput)},
              memory, live: window.memfitLive};
    }""")


def test_job_page_of_a_real_job_shows_its_charts(browser, stack, real_job, artifacts_dir):
    job_id = real_job["id"]
    metrics_steps = stack.metrics_steps(job_id, 0)
    assert metrics_steps == list(range(1, STEPS + 1))
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        page = login(context, stack.server.url, stack.key, screenshot=artifacts_dir / "login-page.png")
        page.screenshot(path=str(artifacts_dir / "jobs-list.png"), full_page=True)
        assert page.locator(f"tr.job-row[data-job-id='{job_id}']").count() == 1

        page.goto(f"{stack.server.url}/ui/jobs/{job_id}")
        page.wait_for_function("() => window.memfitCharts && Object.keys(window.memfitCharts.memory).length > 0")
        state = chart_state(page)
        page.screenshot(path=str(artifacts_dir / "job-page.png"), full_page=True)
        # The README's picture (docs/job-page.png): the status, the memory charts and predicted vs measured.
        bottom = page.locator("#comparison").bounding_box()
        page.screenshot(path=str(artifacts_dir / "job-page-memory.png"), full_page=True,
                        clip={"x": 0, "y": 0, "width": 1400, "height": bottom["y"] + bottom["height"] + 12})

        # Loss: one point per rank-0 metrics step, the real losses; eval loss from the validation file.
        assert state["loss"]["labels"] == metrics_steps
        train_loss = state["loss"]["datasets"][0]["data"]
        assert len(train_loss) == len(metrics_steps) and all(isinstance(v, (int, float)) for v in train_loss)
        assert any(v is not None for v in state["loss"]["datasets"][1]["data"])
        assert all(v and v > 0 for v in state["throughput"]["datasets"][0]["data"])

        # Memory: a stacked chart for EACH rank, every category series present, measured bytes in it.
        assert sorted(state["memory"]) == ["0", "1"]
        for chart in state["memory"].values():
            assert chart["stacked"]
            cats = [d["category"] for d in chart["datasets"] if d["stack"] == "measured"]
            assert cats == ["parameters", "gradients", "optimizer_states", "activations", "other"]
            assert len(chart["labels"]) >= STEPS - 1
            series = {d["category"]: d["data"] for d in chart["datasets"]}
            assert all(len(v) == len(chart["labels"]) for v in series.values())
            assert all(v and v > 0 for v in series["parameters"])  # counted from the real tensors
            assert any(v and v > 0 for v in series["optimizer_states"])
            assert any(v and v > 0 for v in series["activations"])  # measured on traced steps

        # Predicted vs measured, per rank and category, side by side with the error.
        for rank in ("0", "1"):
            rows = page.locator(f"#pvm-rank-{rank} tr.pvm-row")
            cats = [rows.nth(i).get_attribute("data-category") for i in range(rows.count())]
            assert cats == ["parameters", "gradients", "optimizer_states", "activations", "temporary", "total"]
            measured = {c: rows.nth(i).get_attribute("data-measured") for i, c in enumerate(cats)}
            assert int(measured["parameters"]) > 0 and int(measured["total"]) > 0
            # The planner predicted this preset job: side by side, with the error.
            assert page.locator("#no-plan").count() == 0
            predicted = {c: rows.nth(i).get_attribute("data-predicted") for i, c in enumerate(cats)}
            assert int(predicted["parameters"]) > 0 and int(predicted["total"]) > 0
            assert rows.nth(0).locator("td").nth(3).inner_text().endswith("%")

        # Checkpoints and artifacts with working download links.
        assert page.locator("#checkpoints tbody tr").count() == 2
        links = page.locator("#artifacts a")
        assert links.count() > 0
        href = links.first.get_attribute("href")
        r = context.request.get(f"{stack.server.url}{href}")
        assert r.status == 200 and len(r.body()) > 0
        # Events of the run, newest first, ending with success.
        assert "successfully completed" in page.locator("#events tr").first.inner_text()
    finally:
        context.close()


def test_live_updates_arrive_without_reload(browser, hand_stack, artifacts_dir):
    """A job page open while records are ingested: loss, progress, events and the rank's stacked
    memory chart grow from the SSE stream, and the page is never reloaded."""
    stack = hand_stack  # this job is driven by hand: claimed, then fed through the ingest endpoint
    job_id = stack.create()
    sched = Scheduler(stack.app.state.sessions, stack.settings, RayJobs("http://127.0.0.1:9"))
    sched.validate_pending()
    token = {j: t for j, _, t in sched.claim(limit=10)}[job_id]
    ingest = f"/v1/internal/jobs/{job_id}/ingest"

    def post(records):
        r = stack.http.post(ingest, json={"records": records}, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200, r.text

    def step(n):
        now = time.time()
        return [{"kind": "metrics", "attempt": 1, "time": now, "rank": 0, "step": n, "total_steps": 10,
                 "loss": 4.0 / n, "tokens_per_s": 1000.0 + n, "step_time_s": 0.5},
                {"kind": "memory", "attempt": 1, "time": now, "rank": 0, "step": n,
                 "parameters_bytes": 4_000_000, "gradients_bytes": 4_000_000, "optimizer_bytes": 8_000_000,
                 "activations_bytes": 1_000_000 * n, "temporary_bytes": 500_000, "other_bytes": 0,
                 "peak_bytes": 17_500_000 + 1_000_000 * n}]

    post(step(1))
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        page = login(context, stack.server.url, stack.key)
        page.goto(f"{stack.server.url}/ui/jobs/{job_id}")
        page.evaluate("() => { window.__notReloaded = true; }")
        page.wait_for_function("() => window.memfitLive && window.memfitLive.connected")
        before = chart_state(page)
        assert before["loss"]["labels"] == [1]
        assert before["memory"]["0"]["labels"] == [1]

        post(step(2) + step(3))
        page.wait_for_function("() => window.memfitCharts.loss.data.labels.length === 3")
        page.wait_for_function("() => window.memfitCharts.memory[0].data.labels.length === 3")
        after = chart_state(page)
        assert after["loss"]["labels"] == [1, 2, 3]
        assert after["loss"]["datasets"][0]["data"] == pytest.approx([4.0, 2.0, 4.0 / 3])
        acts = next(d for d in after["memory"]["0"]["datasets"] if d["category"] == "activations")
        assert acts["data"] == [1_000_000, 2_000_000, 3_000_000]
        assert page.locator("#progress-text").inner_text() == "step 3/10"
        assert "Step 3/10" in page.locator("#events tr").first.inner_text()
        page.screenshot(path=str(artifacts_dir / "job-page-live.png"), full_page=True)

        # The run ends: the status badge turns and the stream closes, still without a reload.
        post([{"kind": "result", "attempt": 1, "time": time.time(), "fine_tuned_model": "ft:live", "artifacts": {}}])
        page.wait_for_function("() => window.memfitLive.ended")
        assert page.locator("#job-status").inner_text() == "succeeded"
        assert page.evaluate("() => window.__notReloaded") is True
    finally:
        context.close()


def test_jobs_list_filter_and_planner_page(browser, stack, real_job, artifacts_dir):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    try:
        page = login(context, stack.server.url, stack.key)
        page.goto(f"{stack.server.url}/ui/jobs?status=succeeded")
        statuses = page.locator("tr.job-row").evaluate_all("rows => rows.map(r => r.dataset.status)")
        assert statuses and set(statuses) == {"succeeded"}
        assert page.locator(f"tr.job-row[data-job-id='{real_job['id']}']").count() == 1
        page.goto(f"{stack.server.url}/ui/jobs?status=failed")
        assert page.locator(f"tr.job-row[data-job-id='{real_job['id']}']").count() == 0

        page.goto(f"{stack.server.url}/ui/planner")
        page.select_option("select[name=peft]", "lora")
        page.click("#plan-submit")
        page.wait_for_load_state()
        page.screenshot(path=str(artifacts_dir / "planner-page.png"), full_page=True)
        assert page.locator("#plan-unavailable").count() == 0  # the planner answers for a preset
        rows = page.locator("#plan-table tr.plan-row")
        assert rows.count() == 6
        total = page.locator("#plan-table tr.plan-row[data-category=total]").get_attribute("data-bytes")
        assert int(total) > 0
        assert "fits" in page.locator("#plan-result h2").inner_text()
        # Llama-2-7B, full fine-tune in fp32 on an A100-40GB: does not fit; the page lists what would.
        page.fill("input[name=model]", "meta-llama/Llama-2-7b-hf")
        page.select_option("select[name=peft]", "none")
        page.select_option("select[name=precision]", "fp32")
        page.fill("input[name=micro_batch_size]", "1")
        page.click("#plan-submit")
        page.wait_for_load_state()
        assert "does not fit" in page.locator("#plan-result h2").inner_text()
        assert page.locator("#suggestions li").count() > 0
        page.screenshot(path=str(artifacts_dir / "planner-does-not-fit.png"), full_page=True)
    finally:
        context.close()


def test_pages_leak_nothing_across_tenants(stack, real_job):
    job_id = real_job["id"]
    other = new_key(stack.app.state.sessions)
    with httpx.Client(base_url=stack.server.url, timeout=30, follow_redirects=False) as c:
        # Without a key: the pages send you to the login form, the data routes say 401.
        r = c.get(f"/ui/jobs/{job_id}")
        assert r.status_code == 303 and r.headers["location"].startswith("/ui/login")
        assert c.get(f"/ui/jobs/{job_id}/memory.json").status_code == 401
        # Log in as another tenant through the form: the cookie is HttpOnly and SameSite=Strict.
        r = c.post("/ui/login", data={"api_key": other, "next": "/ui/jobs"})
        assert r.status_code == 303
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        for path in (f"/ui/jobs/{job_id}", f"/ui/jobs/{job_id}/memory.json", f"/v1/fine_tuning/jobs/{job_id}/artifacts",
                     f"/v1/fine_tuning/jobs/{job_id}/artifacts/results.json", f"/v1/fine_tuning/jobs/{job_id}/events/stream"):
            r = c.get(path)
            assert r.status_code == 404, path
            assert real_job["model"] not in r.text or "ftjob" not in r.text.replace(job_id, "")
        listing = c.get("/ui/jobs")
        assert listing.status_code == 200 and job_id not in listing.text
        # A wrong key at the form: 401 and no cookie.
        r = c.post("/ui/login", data={"api_key": "mf_live_nope", "next": "/ui/jobs"})
        assert r.status_code == 401 and "set-cookie" not in r.headers
    # The owner can download, but never outside the job's output directory.
    with httpx.Client(base_url=stack.server.url, timeout=30, headers=stack.auth) as c:
        listing = c.get(f"/v1/fine_tuning/jobs/{job_id}/artifacts").json()["data"]
        assert listing and c.get(f"/v1/fine_tuning/jobs/{job_id}/artifacts/{listing[0]['path']}").status_code == 200
        # results.json is the job's result file: it is read through /v1/files, not as an artifact.
        assert c.get(f"/v1/fine_tuning/jobs/{job_id}/artifacts/results.json").status_code == 404
        assert c.get(f"/v1/files/{real_job['result_files'][0]}/content").status_code == 200
        for bad in ("../../etc/passwd", "..%2F..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd", "checkpoints/../../x"):
            assert c.get(f"/v1/fine_tuning/jobs/{job_id}/artifacts/{bad}").status_code == 404, bad
