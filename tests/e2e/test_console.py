"""The Recovery Console in a real browser, against the embedded stack.

Debian's chromium and the `playwright` pip package are used as installed; nothing
is installed at test time and `playwright install` is never run:

    apt-get install -y --no-install-recommends chromium
    .venv/bin/pip install playwright

The browser test skips, naming what is missing, without them. Screenshots go to
$TRAINMEDIC_TEST_ARTIFACTS (when set) or the test's tmp_path.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import orjson
import pytest
from fastapi import FastAPI

from bus.publish import Publisher
from schemas.events import Incident
from schemas.topics import INCIDENTS
from sinks.backends.simulated import SimulatedScheduler
from tests.conftest import wait_for
from tests.integration.scenario import NODES, publish_cascade, wait_incident
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.runtime import Stack, StackConfig
from trainmedic.web.api import load_or_create_token
from trainmedic.web.console import LiveFeed, console_router
from trainmedic.web.console.live import LiveEvent

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
OTHER_JOB_NODES = ["gpu05", "gpu06", "gpu07", "gpu08"]


def _browser_missing() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing: apt-get install -y --no-install-recommends chromium"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright pip package is missing: .venv/bin/pip install playwright (no `playwright install`)"
    return None


def _artifacts(tmp_path: Path) -> Path:
    out = Path(os.environ.get("TRAINMEDIC_TEST_ARTIFACTS") or tmp_path) / "console"
    out.mkdir(parents=True, exist_ok=True)
    return out


def _incident(n: int, produced_at: float | None = None) -> Incident:
    extra: dict[str, Any] = {} if produced_at is None else {"produced_at": produced_at}
    return Incident(
        event_id=f"inc-test{n}",
        event_time=time.time(),
        incident_id=f"inc-test{n}",
        job_id=str(4000 + n),
        partition="gpu",
        category="gpu_hardware",
        severity="critical",
        culprit_node="gpu02",
        confidence=0.9,
        isolate=True,
        explanation="test",
        evidence=[],
        anomaly_ids=[],
        first_signal_time=time.time(),
        **extra,
    )


# --- the live feed on its own -----------------------------------------------------------------------


def test_slow_client_is_dropped_and_never_blocks_the_feed() -> None:
    feed = LiveFeed("127.0.0.1:1", client_queue=3, replay=5)  # never started: events are fed by hand

    async def scenario() -> None:
        fast, missed, _ = feed.subscribe()
        slow, _, _ = feed.subscribe()
        assert missed == [] and feed.clients == 2
        got: list[LiveEvent] = []

        def producer() -> None:  # the consumer thread's side: publish never waits for a client
            for i in range(10):
                feed.publish("incident", "incidents", orjson.dumps({"n": i}))
                fast_ready.wait()  # only so that the fast client takes one at a time
                fast_ready.clear()

        fast_ready = threading.Event()
        t = threading.Thread(target=producer)
        t.start()
        while len(got) < 10:
            await fast.wake.wait()
            got.extend(fast.take())
            fast_ready.set()
        t.join()
        assert [orjson.loads(e.data)["n"] for e in got] == list(range(10))
        assert slow.dropped and feed.dropped_clients == 1 and feed.clients == 1
        # A reconnect inside the replay ring gets what it missed; older ids get a reset.
        again, missed, at = feed.subscribe(last_id=7)
        assert missed is not None and [e.seq for e in missed] == [8, 9, 10] and at == 10
        _, missed, _ = feed.subscribe(last_id=2)
        assert missed is None
        # The stream of a dropped client ends with an `event: dropped` line.
        feed.client_queue = 1
        stream = feed.stream(None, lambda: asyncio.sleep(0, result=False))
        lines = [await anext(stream), await anext(stream)]
        assert lines[0].startswith(b"retry:") and lines[1].startswith(b"id: 10\nevent: hello")
        feed.publish("incident", "incidents", b"{}")
        feed.publish("incident", "incidents", b"{}")
        tail = [chunk async for chunk in stream]
        assert tail == [b'event: dropped\ndata: {"reason": "the client fell behind"}\n\n']
        again.close()

    asyncio.run(scenario())


def test_feed_starts_at_its_start_time_not_at_the_beginning(broker: EmbeddedBroker) -> None:
    pub = Publisher(broker.bootstrap, "test")
    pub.publish(INCIDENTS, _incident(1))
    assert pub.flush(10) == 0
    time.sleep(0.05)  # the old record's broker timestamp must fall before the feed's start
    feed = LiveFeed(broker.bootstrap).start()
    try:

        async def scenario() -> list[dict[str, Any]]:
            sub, _, _ = feed.subscribe()
            pub.publish(INCIDENTS, _incident(2))
            assert pub.flush(10) == 0
            seen: list[dict[str, Any]] = []
            while not any(e.get("incident_id") == "inc-test2" for e in seen):
                await asyncio.wait_for(sub.wake.wait(), timeout=60)
                seen.extend(orjson.loads(e.data) for e in sub.take() if e.kind == "incident")
            return seen

        seen = asyncio.run(scenario())
        # The two records sit on different partitions: the old one may be read after the new one.
        wait_for("the feed to read and skip the record from before its start", lambda: feed.skipped_old >= 1)
        assert [e["incident_id"] for e in seen] == ["inc-test2"]
        assert feed.ready.is_set() and feed.skipped_old == 1 and feed.last_seq == 2  # `feed` ready + inc-test2
    finally:
        feed.stop()
    assert not feed.alive


# --- the console through the whole stack ----------------------------------------------------------------


def _attach_console(stack: Stack) -> tuple[LiveFeed | None, str]:
    """The console on the stack's API; attached here until api.py/runtime.py wire it themselves."""
    assert stack.api is not None and stack.store is not None
    token = load_or_create_token(stack.config.token_file)
    app = cast(FastAPI, stack.api._server.config.app)
    if any(getattr(r, "path", None) == "/api/events" for r in app.routes):
        return None, token  # wired by create_api already
    feed = LiveFeed(stack.bootstrap, group_prefix=f"trainmedic-console{stack.config.group_suffix}").start()
    app.include_router(console_router(stack.store, token, feed))
    return feed, token


@pytest.fixture
def console_stack(broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    sched = SimulatedScheduler([*NODES, *OTHER_JOB_NODES, "gpu09"], requeue_delay_s=0.2)
    job = sched.submit("train", 4)
    other = sched.submit("train-2", 4)
    assert sched.job_state(other).nodes == tuple(OTHER_JOB_NODES)
    stack = Stack(
        StackConfig(
            data_dir=tmp_path / "data",
            bootstrap=broker.bootstrap,
            clickhouse=chdb_url,
            database=database,
            mode="monitor",
            api_port=0,
            settle_s=1.0,
            supervise=True,
        ),
        sched,
    ).start()
    feed: LiveFeed | None = None
    try:
        feed, token = _attach_console(stack)
        assert stack.api is not None
        yield {"stack": stack, "sched": sched, "job": job, "other": other, "token": token, "url": stack.api.url}
    finally:
        if feed is not None:
            feed.stop()
        stack.stop()


def test_console_requires_the_token_and_refuses_unknown_ids(console_stack: dict[str, Any]) -> None:
    url, token, sched = console_stack["url"], console_stack["token"], console_stack["sched"]
    with httpx.Client(base_url=url, timeout=30) as http:
        page = http.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["referrer-policy"] == "no-referrer"
        assert http.get("/static/console.js").status_code == 200
        assert http.get("/static/../api.py").status_code == 404
        for path in (
            "/api/events",
            "/api/incidents",
            "/api/charts",
            "/api/goodput",
            "/api/jobs/1001/timeline",
            "/api/console/status",
            "/api/incidents/inc-1/bundle",
        ):
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers={"Authorization": "Bearer wrong-token-1234567890"}).status_code == 401, path
        assert http.get("/api/events", params={"token": "wrong-token-1234567890"}).status_code == 401
        assert http.get("/api/incidents", params={"token": token}).status_code == 401  # ?token= on /api/events only
        body = {"operator": "alice"}
        assert http.post("/api/recommendations/dec-doesnotexist/approve", json=body).status_code == 401
        unknown = http.post(
            "/api/recommendations/dec-doesnotexist/approve", json=body, headers={"Authorization": f"Bearer {token}"}
        )
        assert unknown.status_code == 404
        ok = http.get("/api/incidents", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and ok.json() == []
        with http.stream("GET", "/api/events", params={"token": token}) as stream:
            assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
            first = next(stream.iter_lines())
            assert first.startswith("retry:")
    assert sched.calls == []


@pytest.mark.skipif(_browser_missing() is not None, reason=_browser_missing() or "")
def test_console_shows_a_fault_live_and_approves_it(console_stack: dict[str, Any], tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    stack: Stack = console_stack["stack"]
    sched: SimulatedScheduler = console_stack["sched"]
    job, other = console_stack["job"], console_stack["other"]
    artifacts = _artifacts(tmp_path)
    assert stack.store is not None
    expect.set_options(timeout=90_000)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            console_errors: list[str] = []
            # Script errors only: chromium also logs refused requests (the wrong token's 401, an approve
            # retried while the audit has not recorded a decision seen live yet: 404) as errors.
            page.on(
                "console",
                lambda m: (
                    console_errors.append(m.text)
                    if m.type == "error" and not m.text.startswith("Failed to load resource")
                    else None
                ),
            )
            page.on("pageerror", lambda e: console_errors.append(str(e)))
            page.goto(console_stack["url"] + "/")

            page.get_by_label("Operator token").fill("wrong-token-1234567890")
            page.get_by_label("Your name").fill("alice")
            page.get_by_role("button", name="Sign in").click()
            expect(page.get_by_role("alert").filter(has_text="token was refused")).to_be_visible()
            expect(page.get_by_role("main")).to_be_hidden()
            page.get_by_label("Operator token").fill(console_stack["token"])
            page.get_by_role("button", name="Sign in").click()
            expect(page.locator("#conn")).to_have_text("Live")
            expect(page.get_by_role("main")).to_be_visible()
            expect(page.locator("#modes tbody")).to_contain_text("monitor")
            expect(page.locator("#nodes-summary")).to_have_text("9 nodes, 0 drained")
            # A mark that a reload would erase: everything below must arrive without one.
            page.evaluate("window.__noReload = true")

            publish_cascade(stack.bootstrap, tmp_path / "fault1", job, NODES, culprit="gpu02")
            publish_cascade(stack.bootstrap, tmp_path / "fault2", other, OTHER_JOB_NODES, culprit="gpu06")

            approve = page.get_by_role("button", name=re.compile(rf"^Approve drain_and_requeue gpu02 for job {job} "))
            reject = page.get_by_role("button", name=re.compile(rf"^Reject drain_and_requeue gpu06 for job {other} "))
            expect(approve).to_be_visible()
            expect(reject).to_be_visible()
            row = page.locator("#incidents tbody tr", has=approve)
            expect(row).to_contain_text("gpu_hardware")
            expect(row).to_contain_text("Awaiting approval")
            log = page.get_by_role("log", name="Live activity, newest first")
            expect(log).to_contain_text(f"New incident on job {job}: gpu_hardware, culprit gpu02")
            expect(log).to_contain_text(f"New incident on job {other}: gpu_hardware, culprit gpu06")
            assert page.evaluate("window.__noReload") is True
            assert sched.calls == []  # monitor mode: nothing until an operator says so
            page.screenshot(path=str(artifacts / "console-awaiting-1280x800.png"))

            approve.click()
            results = page.locator("#results tbody")
            expect(results).to_contain_text("drain_and_requeue gpu02")
            expect(results).to_contain_text("Done")
            expect(results).to_contain_text("drain gpu02: verified DRAIN")
            expect(page.locator("#nodes tbody tr.drained")).to_contain_text("gpu02")
            expect(page.locator("#nodes-summary")).to_have_text("9 nodes, 1 drained")
            expect(log).to_contain_text(f"Approved drain_and_requeue for job {job} by alice")
            expect(log).to_contain_text(f"Action done: drain_and_requeue gpu02 for job {job}")

            reject.click()
            dialog = page.get_by_role("dialog", name="Reject recommendation")
            expect(dialog).to_be_visible()
            reasons = dialog.get_by_label("Reason").locator("option").evaluate_all("os => os.map(o => o.value)")
            assert reasons == ["", "wrong_node", "wrong_category", "not_a_fault", "not_worth_acting", "other"]
            dialog.get_by_label("Reason").select_option("wrong_node")
            dialog.get_by_label("Comment (optional)").fill("gpu06 was fine")
            dialog.get_by_role("button", name="Reject", exact=True).click()
            expect(log).to_contain_text(f"Rejected drain_and_requeue for job {other} by alice (wrong_node)")

            page.get_by_role("checkbox", name="Open only").uncheck()
            expect(page.locator("#incidents tbody")).to_contain_text("Rejected")
            # The timeline is read from the audit when it opens (and again on the job's next live event):
            # on a loaded machine the audit sink may still be writing the result the live feed showed.
            wait_for(
                f"the result of job {job}'s action in the audit",
                lambda: (
                    stack.store is not None
                    and stack.store.query(
                        "SELECT count() AS n FROM {db}.action_results FINAL WHERE job_id = {j:String} AND status = 'done'",
                        {"j": job},
                    )[0]["n"]
                ),
                timeout=90,
            )
            page.get_by_role("button", name=f"Show the timeline of job {job}").click()
            timeline = page.locator("#timeline tbody")
            expect(timeline).to_contain_text("approved drain_and_requeue by alice")
            expect(timeline).to_contain_text("done: drain_and_requeue")
            expect(page.locator("#latency-chart svg[role=img]")).to_be_visible()
            expect(page.locator("#categories-chart")).to_contain_text("gpu_hardware")
            # Readiness follows the verdicts live: 1 approved + 1 rejected of 2 recommendations.
            readiness_row = page.locator("#readiness tbody tr", has_text="gpu_hardware")
            expect(readiness_row).to_contain_text("2 of 2")
            expect(readiness_row).to_contain_text("50%")
            expect(readiness_row).to_contain_text("not yet")
            assert page.evaluate("window.__noReload") is True

            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(artifacts / "console-1280x800.png"))
            page.screenshot(path=str(artifacts / "console-full.png"), full_page=True)
            print(f"\n[console] screenshots in {artifacts}")

            # A dead streams worker means no new incidents while the feed itself looks live: the
            # console says which part of trainmedic is down until the supervisor has it back.
            banner = page.get_by_role("alert").filter(has_text="trainmedic degraded")
            expect(banner).to_be_hidden()
            worker = stack.worker(0)
            assert worker is not None
            os.kill(worker.pid, signal.SIGKILL)
            expect(banner).to_contain_text("streams-worker")
            expect(banner).to_contain_text("SIGKILL")
            page.screenshot(path=str(artifacts / "console-degraded-1280x800.png"))
            expect(banner).to_be_hidden()  # restarted with backoff
            assert console_errors == []
        finally:
            browser.close()

    assert sched.calls == ["drain gpu02", f"requeue {job} exclude=gpu02"]
    inc = wait_incident(stack.store, job)
    act = wait_for(
        "the approved action in the audit",
        lambda: stack.store.query(  # type: ignore[union-attr]
            "SELECT requested_by FROM {db}.actions FINAL WHERE incident_id = {i:String}", {"i": inc["incident_id"]}
        ),
    )
    assert act[0]["requested_by"] == "operator:alice"
    verdicts = wait_for(
        "the rejection in the audit",
        lambda: stack.store.query(  # type: ignore[union-attr]
            "SELECT verdict, reason, comment FROM {db}.approvals FINAL WHERE job_id = {j:String}", {"j": other}
        ),
    )
    assert verdicts == [{"verdict": "rejected", "reason": "wrong_node", "comment": "gpu06 was fine"}]


# --- goodput, attempts and the evidence bundle, on a recorded audit ---------------------------------


@pytest.fixture
def goodput_console(broker: EmbeddedBroker, chdb_url: str, database: str) -> Iterator[dict[str, Any]]:
    """The console router alone (as the API mounts it) on an audit holding tests/integration/test_goodput.py's
    jobs: three attempts of job 9001, its incidents, a job that never ran again. The live feed runs on the
    broker (the page loads its snapshot once the feed says hello); the operator API's nodes, modes and
    readiness are answered empty here."""
    from sinks.audit import AuditStore
    from tests.integration.test_audit import insert_events
    from tests.integration.test_goodput import goodput_events
    from trainmedic.stack.broker import free_port
    from trainmedic.web.api import ApiServer

    store = AuditStore(chdb_url, database)
    store.migrate()
    insert_events(store, goodput_events())
    token = "goodput-console-token-0123456789"
    feed = LiveFeed(broker.bootstrap, group_prefix="trainmedic-console-goodput").start()
    app = FastAPI()
    app.include_router(console_router(store, token, feed, bootstrap=broker.bootstrap))
    app.add_api_route("/api/nodes", lambda: [])
    app.add_api_route("/api/modes", lambda: {"mode": "monitor", "categories": {}, "partitions": {}})
    app.add_api_route("/api/readiness", lambda: [])
    server = ApiServer(app, "127.0.0.1", free_port()).start()
    try:
        yield {"url": server.url, "token": token, "store": store}
    finally:
        server.stop()
        feed.stop()
        store.close()


@pytest.mark.skipif(_browser_missing() is not None, reason=_browser_missing() or "")
def test_console_shows_attempts_goodput_and_downloads_the_bundle(
    goodput_console: dict[str, Any], tmp_path: Path
) -> None:
    import io
    import tarfile

    from playwright.sync_api import expect, sync_playwright

    artifacts = _artifacts(tmp_path)
    expect.set_options(timeout=60_000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800}, accept_downloads=True)
            console_errors: list[str] = []
            page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: console_errors.append(str(e)))
            page.goto(goodput_console["url"] + "/")
            page.get_by_label("Operator token").fill(goodput_console["token"])
            page.get_by_label("Your name").fill("alice")
            page.get_by_role("button", name="Sign in").click()
            expect(page.locator("#conn")).to_have_text("Live")

            # The goodput panel: fleet totals and the worst jobs (9001: 8 + 4 GPU-hours, ratio 3600/9000).
            expect(page.locator("#goodput-summary")).to_contain_text("4 incident(s): 16.0 GPU-hours lost")
            expect(page.locator("#goodput-summary")).to_contain_text("1 not running again (not counted)")
            worst = page.locator("#goodput-jobs tbody tr").first
            expect(worst).to_contain_text("9001")
            expect(worst).to_contain_text("12.00")
            expect(worst).to_contain_text("40.0%")
            recover = page.locator("#goodput-times tbody tr", has_text="Recover")
            expect(recover).to_contain_text("900.0")  # p50 of 900, 450 and 1800 s

            # The attempts of job 9001 in its timeline, opened from the goodput panel.
            page.get_by_role("button", name="Show the timeline and attempts of job 9001").click()
            attempts = page.locator("#attempts tbody tr")
            expect(attempts).to_have_count(3)
            expect(attempts.nth(0)).to_contain_text("inc-9001-0")
            expect(attempts.nth(0)).to_contain_text("Made progress")
            expect(attempts.nth(1)).to_contain_text("No progress")
            expect(attempts.nth(1)).to_contain_text("gpu11")
            expect(attempts.nth(2)).to_contain_text("completed")
            expect(attempts.nth(2)).to_contain_text("gpu11, gpu12")
            expect(page.locator("#timeline-summary")).to_contain_text("3 attempt(s)")

            # The evidence bundle: fetched with the token, handed over as a download.
            page.get_by_role("checkbox", name="Open only").uncheck()
            button = page.get_by_role("button", name="Download the evidence bundle of incident inc-9001-0")
            expect(button).to_be_visible()
            expect(page.locator("#incidents tbody tr", has=button)).to_contain_text("9001")
            with page.expect_download() as info:
                button.click()
            download = info.value
            assert download.suggested_filename == "inc-9001-0.tar.gz"
            saved = artifacts / download.suggested_filename
            download.save_as(saved)
            with tarfile.open(fileobj=io.BytesIO(saved.read_bytes()), mode="r:gz") as tar:
                manifest = tar.extractfile("manifest.json")
                assert manifest is not None
                assert orjson.loads(manifest.read())["incident_id"] == "inc-9001-0"
            expect(
                page.get_by_role("status").filter(has_text="Evidence bundle of inc-9001-0 downloaded")
            ).to_be_visible()
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(artifacts / "console-goodput-full.png"), full_page=True)
            assert console_errors == []
        finally:
            browser.close()


# --- first contact: the sign-in link and the times shown -------------------------------------------------


@pytest.mark.skipif(_browser_missing() is not None, reason=_browser_missing() or "")
def test_console_link_with_the_token_signs_in_and_leaves_the_address_bar(goodput_console: dict[str, Any]) -> None:
    from playwright.sync_api import expect, sync_playwright

    from schemas.events import Decision
    from tests.integration.test_audit import incident_events, insert_events
    from tests.integration.test_goodput import T0

    expect.set_options(timeout=60_000)
    url, token = goodput_console["url"], goodput_console["token"]
    # One recommendation awaiting an answer, so that an approval asks for the name the link did not give.
    anomaly, incident, decision = incident_events(0, T0 + 100, job="9009", node="gpu41")[:3]
    assert isinstance(decision, Decision)
    insert_events(
        goodput_console["store"],
        [anomaly, incident, decision.model_copy(update={"executed": False, "mode": "monitor"})],
    )
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            console_errors: list[str] = []
            page.on("pageerror", lambda e: console_errors.append(str(e)))
            page.goto(f"{url}/#token={token}")
            # Signed in without typing: the live view, no form; the name is asked when an approval needs it.
            expect(page.locator("#conn")).to_have_text("Live")
            expect(page.get_by_role("main")).to_be_visible()
            expect(page.locator("#login")).to_be_hidden()
            expect(page.locator("#who-name")).to_have_text("(name asked at the first approval)")
            expect(page.locator("#goodput-summary")).to_contain_text("5 incident(s)")  # the audit's 4 and 9009's
            # The token left the address bar (history, bookmarks, screenshots) and is kept as the form keeps it.
            assert "token" not in page.url and page.url == f"{url}/"
            assert page.evaluate("sessionStorage.getItem('trainmedic.token')") == token
            page.reload()
            expect(page.locator("#conn")).to_have_text("Live")
            expect(page.get_by_role("main")).to_be_visible()
            # An approval needs a name: the form asks for it alone, the token still filled in.
            page.get_by_role("button", name=re.compile(r"^Approve drain_and_requeue gpu41 for job 9009 ")).click()
            expect(page.locator("#login-error")).to_have_text("Enter your name: it is recorded with the approval.")
            expect(page.get_by_label("Your name")).to_be_focused()
            expect(page.get_by_label("Operator token")).to_have_value(token)
            page.get_by_label("Your name").fill("carol")
            page.get_by_role("button", name="Sign in").click()
            expect(page.locator("#who-name")).to_have_text("carol")
            expect(page.locator("#conn")).to_have_text("Live")

            # In a fresh tab: a link may name the operator too.
            named = browser.new_page()
            named.goto(f"{url}/#token={token}&operator=bob")
            expect(named.locator("#who-name")).to_have_text("bob")
            expect(named.locator("#conn")).to_have_text("Live")
            assert named.url == f"{url}/"

            # A link with a wrong token signs nobody in, says so, and leaves no token behind.
            wrong = browser.new_page()
            wrong.goto(f"{url}/#token=wrong-token-1234567890")
            expect(wrong.get_by_role("alert").filter(has_text="token was refused")).to_be_visible()
            expect(wrong.get_by_role("main")).to_be_hidden()
            assert wrong.url == f"{url}/"
            assert wrong.evaluate("sessionStorage.getItem('trainmedic.token')") is None
            assert console_errors == []
        finally:
            browser.close()


@pytest.mark.skipif(_browser_missing() is not None, reason=_browser_missing() or "")
def test_console_times_carry_date_and_zone(goodput_console: dict[str, Any], tmp_path: Path) -> None:
    from datetime import UTC, datetime

    from playwright.sync_api import expect, sync_playwright

    from tests.integration.test_goodput import INCIDENTS, T0

    expect.set_options(timeout=60_000)
    shown = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} UTC$")
    detected = datetime.fromtimestamp(T0 + INCIDENTS["inc-9001-0"][3], UTC)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            # A browser far from UTC, at a half-hour offset: what it shows must not depend on it.
            context = browser.new_context(viewport={"width": 1280, "height": 800}, timezone_id="Asia/Kolkata")
            page = context.new_page()
            page.goto(f"{goodput_console['url']}/#token={goodput_console['token']}&operator=alice")
            expect(page.locator("#conn")).to_have_text("Live")
            page.get_by_role("checkbox", name="Open only").uncheck()
            bundle = page.get_by_role("button", name="Download the evidence bundle of incident inc-9001-0")
            cell = page.locator("#incidents tbody tr", has=bundle).locator("td").first.locator("time")
            expect(cell).to_have_text(detected.strftime("%Y-%m-%d %H:%M:%S UTC"))
            # The tooltip: the same instant in the browser's zone, its offset said (IST, +05:30, no DST).
            local = detected.astimezone(UTC).timestamp() + 5.5 * 3600
            expected_title = datetime.fromtimestamp(local, UTC).strftime("%Y-%m-%d %H:%M:%S +05:30")
            expect(cell).to_have_attribute("title", f"{expected_title} in this browser's time zone")
            expect(cell).to_have_attribute("datetime", re.compile(r"Z$"))

            page.get_by_role("button", name="Show the timeline and attempts of job 9001").click()
            expect(page.locator("#attempts tbody tr")).to_have_count(3)
            expect(page.locator("#timeline tbody tr").first).to_be_visible()
            texts = page.locator("main time").all_inner_texts()
            # Incidents, results, attempts (start and end) and the timeline: every one with date and zone.
            assert len(texts) >= 4 + 3 + 3 + 5, texts
            assert [t for t in texts if not shown.match(t)] == []
            page.screenshot(path=str(_artifacts(tmp_path) / "console-times-ist.png"), full_page=True)
        finally:
            browser.close()


# --- a pending migration (a predicted failure), and its cancel -------------------------------------------


@pytest.fixture
def migration_console(broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The operator API (console included) on an audit holding one predicted incident of job 7001 and its
    pending migration off gpu03, which the simulated scheduler has drained for it."""
    from schemas.events import Evidence, Migration
    from sinks.audit import AuditStore
    from streams.policy import DEFAULT_POLICY
    from tests.integration.test_audit import insert_events
    from trainmedic.stack.broker import free_port
    from trainmedic.web.api import ApiServer, create_api

    now = time.time()
    incident = _incident(1).model_copy(
        update={
            "incident_id": "inc-pred1",
            "event_id": "inc-pred1",
            "job_id": "7001",
            "culprit_node": "gpu03",
            "culprit_gpu": 2,
            "severity": "warning",
            "kind": "predicted",
            "evidence": [
                Evidence(
                    source="gpu", provenance="gpu", signature="prefailure_row_remap_pending", node="gpu03",
                    time=now, line="remapped_rows_pending=true", role="root", gpu=2,
                )
            ],
        }
    )  # fmt: skip
    waiting = Migration(
        event_id="migst-1",
        event_time=now,
        migration_id="mig-1",
        incident_id="inc-pred1",
        decision_id="dec-pred1",
        job_id="7001",
        node="gpu03",
        gpu=2,
        rule="row_remap_pending",
        state="waiting",
        decided_at=now,
        deadline=now + 3600,
        checkpoint_before=400,
        requested_by="policy",
        detail="gpu03 drained; waiting for a checkpoint beyond 400",
    )
    store = AuditStore(chdb_url, database)
    store.migrate()
    insert_events(store, [incident, waiting])
    sched = SimulatedScheduler(["gpu01", "gpu02", "gpu03", "gpu04"])
    sched.drain_node("gpu03", "trainmedic inc-pred1: gpu_hardware")
    token = "migration-console-token-0123456789"
    feed = LiveFeed(broker.bootstrap, group_prefix="trainmedic-console-migration").start()
    publisher = Publisher(broker.bootstrap, "test-console-api")
    api = create_api(store, publisher, token, sched, DEFAULT_POLICY, tmp_path / "modes.yaml", feed=feed)
    server = ApiServer(api, "127.0.0.1", free_port()).start()
    try:
        yield {"url": server.url, "token": token, "store": store, "sched": sched, "bootstrap": broker.bootstrap}
    finally:
        server.stop()
        feed.stop()
        publisher.close()
        store.close()


@pytest.mark.skipif(_browser_missing() is not None, reason=_browser_missing() or "")
def test_console_shows_a_pending_migration_and_cancels_it(migration_console: dict[str, Any], tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    from schemas.codec import decode
    from schemas.events import Migration
    from schemas.topics import MIGRATIONS
    from tests.conftest import read_topic

    artifacts = _artifacts(tmp_path)
    expect.set_options(timeout=60_000)
    sched = migration_console["sched"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            console_errors: list[str] = []
            page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: console_errors.append(str(e)))
            page.goto(migration_console["url"] + "/")
            page.get_by_label("Operator token").fill(migration_console["token"])
            page.get_by_label("Your name").fill("alice")
            page.get_by_role("button", name="Sign in").click()
            expect(page.locator("#conn")).to_have_text("Live")
            page.get_by_label("Job id").fill("7001")
            page.get_by_role("button", name="Show timeline").click()
            row = page.locator("#migrations tbody tr")
            expect(row).to_have_count(1)
            expect(row).to_contain_text("gpu03 GPU 2")
            expect(row).to_contain_text("Pending: node drained")
            expect(row).to_contain_text("checkpoint 401 or later")
            page.screenshot(path=str(artifacts / "console-migration-pending.png"), full_page=True)
            page.get_by_role("button", name="Cancel the migration of job 7001 off gpu03 and resume the node").click()
            expect(
                page.get_by_role("status").filter(has_text="Cancelled mig-1 of job 7001: gpu03 resumed")
            ).to_be_visible()
            assert not sched.node_state("gpu03").drained
            records = [decode(Migration, v) for v in read_topic(migration_console["bootstrap"], MIGRATIONS.name, 1.0)]
            assert [(m.migration_id, m.state, m.requested_by) for m in records] == [("mig-1", "cancelled", "alice")]
            assert console_errors == []
        finally:
            browser.close()


def test_the_cli_shows_the_pending_migration_and_cancels_it(migration_console: dict[str, Any]) -> None:
    """`trainmedic audit job`'s line for the pending migration; `trainmedic migrations cancel` (through the
    operator API) resumes the node, and a cancel repeated before the audit saw the first resumes nothing."""
    from typer.testing import CliRunner

    from sinks.audit_queries import job_migrations
    from trainmedic.cli.audit import migration_line
    from trainmedic.cli.main import app

    (pending,) = job_migrations(migration_console["store"], "7001")
    line = migration_line(pending)
    assert line.startswith(
        "migration mig-1: PENDING - gpu03 GPU 2 (row_remap_pending) drained, waiting for checkpoint 401"
    )
    env = {"TRAINMEDIC_TOKEN": migration_console["token"]}
    args = ["migrations", "cancel", "7001", "--operator", "bob", "--api", migration_console["url"]]
    result = CliRunner().invoke(app, [*args, "--comment", "false alarm"], env=env)
    assert result.exit_code == 0, result.output
    assert "cancelled mig-1 of job 7001: gpu03 resumed" in result.output
    sched = migration_console["sched"]
    assert not sched.node_state("gpu03").drained
    again = CliRunner().invoke(app, args, env=env)
    assert again.exit_code == 0, again.output
    assert "gpu03 is not drained for inc-pred1" in again.output and "left as it is" in again.output
    assert [c for c in sched.calls if c.startswith("resume")] == ["resume gpu03"]
