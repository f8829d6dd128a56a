/* trainmedic Recovery Console.
 *
 * The page loads a snapshot from the audit (incidents, charts) and the scheduler
 * (nodes), then applies live events from /api/events (Server-Sent Events fed by
 * Kafka). It never polls: a read happens at load, when the operator asks (job
 * timeline), or when a live event says something changed.
 *
 * The token is kept in sessionStorage (this tab only) and sent as a bearer header;
 * EventSource cannot send headers, so /api/events alone gets it as ?token=.
 * Every text from the server goes in with textContent, never as HTML.
 */
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const TOKEN_KEY = "trainmedic.token";
  const OPERATOR_KEY = "trainmedic.operator";
  const STATUS_TEXT = {
    pending_decision: "Deciding",
    awaiting_approval: "Awaiting approval",
    acting: "Acting",
    done: "Done",
    failed: "Failed",
    skipped: "Skipped",
    rejected: "Rejected",
    no_action: "No action",
  };
  const OPEN = new Set(["pending_decision", "awaiting_approval", "acting"]);
  // A decision seen live may reach the audit (which approve reads) a moment later.
  const AUDIT_LAG_RETRY_MS = 500;
  const AUDIT_LAG_RETRIES = 20;

  let token = sessionStorage.getItem(TOKEN_KEY) || "";
  let operator = sessionStorage.getItem(OPERATOR_KEY) || "";
  let es = null;
  let lastEventId = null;
  let snapshotLoaded = false;
  let reconnectTimer = null;
  const incidents = new Map(); // incident_id -> record
  const rows = new Map(); // incident_id -> <tr>
  const announced = new Set(); // incident ids whose incident event was announced
  const seenLive = new Map(); // decision_id -> Date.now() when its decision event arrived
  let nodes = [];
  let modes = null;
  let timelineJob = null;
  const timers = {};

  // --- helpers ----------------------------------------------------------------------

  function debounce(name, ms, fn) {
    clearTimeout(timers[name]);
    timers[name] = setTimeout(fn, ms);
  }

  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

  function toSeconds(v) {
    if (v === null || v === undefined) return null;
    if (typeof v === "number") return v;
    const t = Date.parse(v);
    return Number.isNaN(t) ? null : t / 1000;
  }

  const pad = (n) => String(n).padStart(2, "0");

  // Every time is shown in UTC with its date and the zone said: operators hold it against logs, the
  // `trainmedic audit` CLI and attribution's explanations (UTC), and against colleagues elsewhere.
  // A browser's locale and zone would give each of them another text for the same instant.
  function utcText(d) {
    const day = `${d.getUTCFullYear()}-${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())}`;
    return `${day} ${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}:${pad(d.getUTCSeconds())} UTC`;
  }

  // The same instant in this browser's zone, with its offset (as ISO 8601 writes one), for the tooltip.
  function localText(d) {
    const offset = -d.getTimezoneOffset();
    const abs = Math.abs(offset);
    const zone = `${offset < 0 ? "-" : "+"}${pad(Math.floor(abs / 60))}:${pad(abs % 60)}`;
    const day = `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}`;
    return `${day} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())} ${zone}`;
  }

  function timeEl(seconds) {
    const el = document.createElement("time");
    if (seconds === null) {
      el.textContent = "?";
      return el;
    }
    const d = new Date(seconds * 1000);
    el.dateTime = d.toISOString();
    el.textContent = utcText(d);
    el.title = `${localText(d)} in this browser's time zone`;
    return el;
  }

  function text(tag, value, cls) {
    const el = document.createElement(tag);
    el.textContent = value === null || value === undefined || value === "" ? "\u2014" : String(value);
    if (cls) el.className = cls;
    return el;
  }

  function badge(status) {
    const el = text("span", STATUS_TEXT[status] || status, `badge ${status}`);
    return el;
  }

  function notice(msg) {
    $("notice").textContent = msg;
    $("error").textContent = "";
  }

  function error(msg) {
    $("error").textContent = msg;
  }

  function setConn(state, label) {
    const c = $("conn");
    c.dataset.state = state;
    c.textContent = label;
  }

  // The live feed can be fine while a part of trainmedic is not (a dead streams worker means no
  // new incidents): poll the supervisor's view and say which part is down, and why. `degraded`
  // (a policy file that failed to load: the last good policy stays in force) is said too.
  let stackTimer = null;
  async function pollStack() {
    clearTimeout(stackTimer);
    if (!token) return;
    const r = await api("/api/console/status");
    const el = $("stack");
    const stack = r.status === 200 && r.body ? r.body.stack : null;
    const parts = (entries) => Object.entries(entries || {}).map(([name, why]) => `${name} (${why})`);
    const down = stack ? parts(stack.down) : [];
    const degraded = stack ? parts(stack.degraded) : [];
    if (stack && (stack.ok === false || degraded.length)) {
      const why = [...down, ...degraded].join("; ") || "a component is down";
      el.textContent = `trainmedic degraded: ${why}`;  // textContent: the file's text is never markup
      el.className = stack.ok === false ? "stack-down" : "stack-degraded";
      el.hidden = false;
    } else {
      el.textContent = "";
      el.hidden = true;
    }
    stackTimer = setTimeout(pollStack, 3000);
  }

  async function api(path, opts) {
    const init = { method: (opts && opts.method) || "GET", headers: { Authorization: `Bearer ${token}` } };
    if (opts && opts.body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(opts.body);
    }
    let res;
    try {
      res = await fetch(path, init);
    } catch (exc) {
      return { status: 0, body: { detail: `the console server does not answer (${exc})` } };
    }
    let body = null;
    try {
      body = await res.json();
    } catch (_) {
      body = null;
    }
    if (res.status === 401) signOut("The token was refused: sign in again.");
    return { status: res.status, body };
  }

  const detail = (r) => (r.body && r.body.detail ? (typeof r.body.detail === "string" ? r.body.detail : JSON.stringify(r.body.detail)) : `HTTP ${r.status}`);

  // --- sign in / out --------------------------------------------------------------------

  function showLogin(msg) {
    $("main").hidden = true;
    $("who").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = msg || "";
    $("login-operator").value = operator;
    $("login-token").focus();
  }

  // Signed in by a link without a name: ask for the name alone, the token kept in the form.
  function askName(msg) {
    showLogin(msg);
    $("login-token").value = token;
    $("login-operator").focus();
  }

  function signOut(msg) {
    token = "";
    sessionStorage.removeItem(TOKEN_KEY);
    if (es) es.close();
    es = null;
    clearTimeout(reconnectTimer);
    setConn("offline", "Not connected");
    showLogin(msg);
  }

  async function signIn(newToken, newOperator) {
    token = newToken;
    operator = newOperator;
    const probe = await api("/api/console/status");
    if (probe.status !== 200) {
      if (probe.status !== 401) {
        showLogin(`Cannot sign in: ${detail(probe)}`);
        $("login-token").value = newToken; // a link's token is off the address bar now: keep it for a retry
      }
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, token);
    sessionStorage.setItem(OPERATOR_KEY, operator);
    $("login").hidden = true;
    $("main").hidden = false;
    $("who").hidden = false;
    $("who-name").textContent = operator || "(name asked at the first approval)";
    snapshotLoaded = false;
    connect();
    pollStack();
  }

  // --- live events --------------------------------------------------------------------------

  function connect() {
    if (es) es.close();
    clearTimeout(reconnectTimer);
    setConn("connecting", "Connecting\u2026");
    let url = `/api/events?token=${encodeURIComponent(token)}`;
    if (lastEventId !== null) url += `&last_id=${encodeURIComponent(lastEventId)}`;
    es = new EventSource(url);
    const on = (name, fn) =>
      es.addEventListener(name, (e) => {
        if (e.lastEventId) lastEventId = e.lastEventId;
        let data = {};
        try {
          data = JSON.parse(e.data);
        } catch (_) {
          return;
        }
        fn(data);
      });
    on("hello", (h) => {
      setConn(h.ready ? "live" : "connecting", h.ready ? "Live" : "Live feed starting\u2026");
      if (!snapshotLoaded) loadSnapshot();
    });
    on("feed", (f) => {
      if (f.ready) setConn("live", "Live");
    });
    on("reset", () => loadSnapshot());
    on("dropped", () => setConn("connecting", "Reconnecting (fell behind)\u2026"));
    on("incident", onIncident);
    on("decision", onDecision);
    on("approval", onApproval);
    on("action_result", onResult);
    on("guardrail_trip", onTrip);
    on("mode_change", onModeChange);
    on("node_return", onNodeReturn);
    es.onerror = async () => {
      if (!es || es.readyState !== EventSource.CLOSED) {
        setConn("connecting", "Reconnecting\u2026");
        return;
      }
      // The server refused the stream (wrong token, feed down): find out which, then retry.
      setConn("offline", "Disconnected");
      const probe = await api("/api/console/status");
      if (probe.status !== 401 && token) reconnectTimer = setTimeout(connect, 3000);
    };
  }

  function activity(message, seconds) {
    const list = $("activity");
    const li = document.createElement("li");
    li.append(timeEl(seconds ?? Date.now() / 1000), document.createTextNode(message));
    list.prepend(li);
    while (list.children.length > 100) list.lastElementChild.remove();
  }

  function upsert(id, fields) {
    const isNew = !incidents.has(id);
    const rec = incidents.get(id) || { incident_id: id };
    for (const [k, v] of Object.entries(fields)) {
      if (v !== undefined && v !== null) rec[k] = v;
      else if (!(k in rec)) rec[k] = null;
    }
    incidents.set(id, rec);
    renderIncident(rec, isNew);
    return { rec, isNew };
  }

  function onIncident(ev) {
    // Topics are not ordered with each other: the decision may have come first and made the row.
    const isNew = !announced.has(ev.incident_id);
    announced.add(ev.incident_id);
    upsert(ev.incident_id, {
      detected_t: ev.event_time,
      job_id: ev.job_id,
      partition: ev.partition,
      category: ev.category,
      severity: ev.severity,
      culprit_node: ev.culprit_node,
      confidence: ev.confidence,
      explanation: ev.explanation,
      provenance: ev.provenance,
    });
    if (isNew) {
      activity(
        `New incident on job ${ev.job_id ?? "?"}: ${ev.category}, culprit ${ev.culprit_node ?? "unknown"}, ` +
          `confidence ${Number(ev.confidence).toFixed(2)}`,
        ev.event_time,
      );
    }
    refreshCharts();
    touchTimeline(ev.job_id);
  }

  function onDecision(ev) {
    seenLive.set(ev.decision_id, Date.now());
    const existing = incidents.get(ev.incident_id);
    const { rec } = upsert(ev.incident_id, {
      decision_id: ev.decision_id,
      decision_kind: ev.executed ? "action" : "recommendation",
      decision_action: ev.action,
      decision_mode: ev.mode,
      decision_reason: ev.reason,
      job_id: ev.job_id,
      partition: ev.partition,
      category: ev.category,
      culprit_node: ev.culprit_node,
      detected_t: existing && existing.detected_t ? undefined : ev.incident_time,
    });
    const what = `${ev.action}${ev.culprit_node ? " " + ev.culprit_node : ""} for job ${ev.job_id ?? "?"}`;
    activity(
      ev.executed
        ? `Policy acts: ${what} (mode ${ev.mode})`
        : `Recommendation: ${what} (mode ${ev.mode})${statusOf(rec) === "awaiting_approval" ? ", awaiting approval" : ""}`,
      ev.event_time,
    );
    touchTimeline(ev.job_id);
  }

  function onApproval(ev) {
    upsert(ev.incident_id, { verdict: ev.verdict, reject_reason: ev.reason, operator: ev.operator });
    activity(
      `${{ approved: "Approved", rejected: "Rejected", confirmed: "Confirmed" }[ev.verdict] || ev.verdict} ` +
        `${ev.action} for job ${ev.job_id ?? "?"} by ${ev.operator}` +
        (ev.reason ? ` (${ev.reason})` : ""),
      ev.event_time,
    );
    touchTimeline(ev.job_id);
    debounce("readiness", 500, loadReadiness);
  }

  function onResult(ev) {
    upsert(ev.incident_id, {
      result_status: ev.status,
      result_action: ev.action,
      result_steps: (ev.steps || []).join("; "),
      result_error: ev.error,
    });
    addResult({
      t: ev.event_time,
      job_id: ev.job_id,
      action: ev.action,
      node: ev.node,
      status: ev.status,
      steps: (ev.steps || []).join("; "),
      error: ev.error,
      incident_id: ev.incident_id,
    }, true);
    activity(`Action ${ev.status}: ${ev.action}${ev.node ? " " + ev.node : ""} for job ${ev.job_id ?? "?"}`, ev.event_time);
    debounce("nodes", 200, loadNodes);
    refreshCharts();
    touchTimeline(ev.job_id);
  }

  function onTrip(ev) {
    const rec = incidents.get(ev.incident_id);
    upsert(ev.incident_id, { guardrail_trips: ((rec && rec.guardrail_trips) || 0) + 1 });
    activity(`Guardrail ${ev.guardrail} stopped ${ev.action}${ev.node ? " " + ev.node : ""}: ${ev.detail}`, ev.event_time);
    touchTimeline(ev.job_id);
  }

  function onModeChange(ev) {
    const refused = ev.outcome === "refused" ? ` REFUSED (${ev.readiness})` : ev.forced ? " (forced)" : "";
    activity(
      `Mode ${ev.old_mode ?? "?"} \u2192 ${ev.new_mode} for partition ${ev.partition ?? "(all)"}` +
        `${ev.category ? ", category " + ev.category : ""} by ${ev.operator}${refused}`,
      ev.event_time,
    );
    debounce("modes", 200, loadModes);
  }

  function onNodeReturn(ev) {
    if (ev.outcome === "refused") {
      activity(`Node ${ev.node} stays drained (resume by ${ev.operator} refused): ${ev.detail}`, ev.event_time);
    } else if (ev.outcome === "recommended") {
      // The automatic path judged it fit but did not act (monitor mode, kill switch): still drained.
      activity(`Node ${ev.node} may return to service (${ev.operator}, not resumed): ${ev.detail}`, ev.event_time);
    } else {
      activity(`Node ${ev.node} returned to service by ${ev.operator}`, ev.event_time);
    }
    debounce("nodes", 200, loadNodes);
  }

  function refreshCharts() {
    // The audit sink inserts in batches: read once soon, and once more when it has surely caught up.
    debounce("charts", 1500, loadCharts);
    debounce("charts-late", 5000, loadCharts);
    debounce("goodput", 1500, loadGoodput);
    debounce("goodput-late", 5000, loadGoodput);
  }

  function touchTimeline(jobId) {
    if (timelineJob !== null && jobId === timelineJob) debounce("timeline", 1500, () => loadTimeline(timelineJob, false));
  }

  // --- incidents table ---------------------------------------------------------------------

  function statusOf(r) {
    // The same rules as routes.py incident_status.
    if (r.result_status) return r.result_status;
    if (r.verdict === "rejected") return "rejected";
    if (r.verdict === "approved") return "acting";
    if (!r.decision_id) return "pending_decision";
    if (r.decision_action === "none") return "no_action";
    if (r.decision_kind === "action") return "acting";
    return "awaiting_approval";
  }

  function flashRow(tr) {
    // Removed on a timer, not on animationend: a row hidden meanwhile (Open only) never ends
    // its animation and would replay it when shown again.
    tr.classList.add("new");
    setTimeout(() => tr.classList.remove("new"), 2100);
  }

  function renderIncident(rec, flash) {
    const status = statusOf(rec);
    let tr = rows.get(rec.incident_id);
    const tbody = $("incidents").tBodies[0];
    if (!tr) {
      tr = document.createElement("tr");
      tr.dataset.incident = rec.incident_id;
      for (let i = 0; i < 9; i++) tr.appendChild(document.createElement("td"));
      rows.set(rec.incident_id, tr);
      // newest first
      const t = rec.detected_t ?? 0;
      const after = [...tbody.rows].find((r) => (incidents.get(r.dataset.incident).detected_t ?? 0) < t);
      tbody.insertBefore(tr, after || null);
      if (flash) flashRow(tr);
    }
    tr.dataset.status = status;
    const c = tr.cells;
    c[0].replaceChildren(timeEl(rec.detected_t ?? null));
    const jobBtn = document.createElement("button");
    jobBtn.type = "button";
    jobBtn.className = "quiet";
    jobBtn.textContent = rec.job_id ?? "\u2014";
    jobBtn.setAttribute("aria-label", `Show the timeline of job ${rec.job_id}`);
    jobBtn.disabled = !rec.job_id;
    jobBtn.addEventListener("click", () => loadTimeline(rec.job_id, true));
    if (!c[1].firstChild || c[1].firstChild.textContent !== jobBtn.textContent) c[1].replaceChildren(jobBtn);
    c[2].replaceChildren(text("span", rec.category), text("span", rec.severity, "why"));
    c[3].textContent = rec.culprit_node ?? "\u2014";
    c[4].className = "num";
    c[4].textContent = rec.confidence === null || rec.confidence === undefined ? "\u2014" : Number(rec.confidence).toFixed(2);
    // Policy alone chooses the action: none is shown until its decision arrives.
    const action = rec.decision_action || "\u2014";
    const rec5 = [text("span", action)];
    if (rec.decision_mode) rec5.push(text("span", `mode ${rec.decision_mode}`, "why"));
    // Who could have written the deciding evidence (kernel, kernel_file, gpu, net, scheduler, service, job).
    if (rec.provenance) rec5.push(text("span", `evidence from ${rec.provenance}`, "why"));
    if (rec.explanation) rec5.push(text("span", rec.explanation, "why"));
    c[5].replaceChildren(...rec5);
    const st = [badge(status)];
    if (rec.verdict && rec.operator) st.push(text("span", `${rec.verdict} by ${rec.operator}${rec.reject_reason ? " (" + rec.reject_reason + ")" : ""}`, "why"));
    if (rec.result_steps) st.push(text("span", rec.result_steps, "why"));
    if (rec.result_error) st.push(text("span", rec.result_error, "why"));
    if (rec.guardrail_trips) st.push(text("span", `guardrail trips: ${rec.guardrail_trips}`, "why"));
    c[6].replaceChildren(...st);
    renderDecide(c[7], rec, status);
    if (!c[8].firstChild) c[8].appendChild(bundleButton(rec.incident_id));
    tr.hidden = $("open-only").checked && !OPEN.has(status);
    updateEmpty();
  }

  function renderDecide(cell, rec, status) {
    const want = status === "awaiting_approval" ? "buttons" : "none";
    if (cell.dataset.kind === want && cell.dataset.decision === (rec.decision_id || "")) return; // keep focus
    cell.dataset.kind = want;
    cell.dataset.decision = rec.decision_id || "";
    if (want === "none") {
      const hadFocus = cell.contains(document.activeElement);
      cell.replaceChildren(text("span", "\u2014"));
      if (hadFocus) {
        const statusCell = cell.closest("tr").cells[6];
        statusCell.tabIndex = -1;
        statusCell.focus();
      }
      return;
    }
    const what = `${rec.decision_action}${rec.culprit_node ? " " + rec.culprit_node : ""} for job ${rec.job_id ?? "?"} (incident ${rec.incident_id})`;
    const wrap = document.createElement("div");
    wrap.className = "actions";
    const ok = document.createElement("button");
    ok.type = "button";
    ok.className = "approve";
    ok.textContent = "Approve";
    ok.setAttribute("aria-label", `Approve ${what}`);
    ok.addEventListener("click", () => approve(rec, wrap));
    const no = document.createElement("button");
    no.type = "button";
    no.className = "reject";
    no.textContent = "Reject";
    no.setAttribute("aria-label", `Reject ${what}`);
    no.addEventListener("click", () => openReject(rec, wrap, what));
    wrap.append(ok, no);
    cell.replaceChildren(wrap);
  }

  // --- evidence bundle ------------------------------------------------------------------------
  // The bundle route wants the bearer token, which a plain link cannot send: fetch it, then hand
  // the browser the bytes as a download.

  function bundleButton(incidentId) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "quiet";
    b.textContent = "Bundle";
    b.setAttribute("aria-label", `Download the evidence bundle of incident ${incidentId}`);
    b.title = "Evidence bundle (.tar.gz) for the repair hand-off";
    b.addEventListener("click", () => downloadBundle(incidentId, b));
    return b;
  }

  async function downloadBundle(incidentId, button) {
    button.disabled = true;
    notice(`Building the evidence bundle of ${incidentId}\u2026`);
    try {
      let res;
      try {
        res = await fetch(`/api/incidents/${encodeURIComponent(incidentId)}/bundle`, {
          headers: { Authorization: `Bearer ${token}` },
        });
      } catch (exc) {
        error(`The evidence bundle of ${incidentId} could not be fetched: the console server does not answer (${exc})`);
        return;
      }
      if (res.status === 401) {
        signOut("The token was refused: sign in again.");
        return;
      }
      if (!res.ok) {
        let why = `HTTP ${res.status}`;
        try {
          const body = await res.json();
          if (body && body.detail) why = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
        } catch (_) {
          // not JSON: the status says it
        }
        error(`The evidence bundle of ${incidentId} could not be built (${res.status}): ${why}`);
        return;
      }
      const blob = await res.blob();
      const named = /filename="([^"]+)"/.exec(res.headers.get("Content-Disposition") || "");
      const a = document.createElement("a");
      a.href = URL.createObjectURL(blob);
      a.download = named ? named[1] : `${incidentId}.tar.gz`;
      a.hidden = true;
      document.body.appendChild(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(a.href), 60000);
      notice(`Evidence bundle of ${incidentId} downloaded as ${a.download} (${blob.size} bytes).`);
    } finally {
      button.disabled = false;
    }
  }

  function updateEmpty() {
    const visible = [...$("incidents").tBodies[0].rows].some((r) => !r.hidden);
    $("incidents-empty").hidden = visible;
    $("incidents-empty").textContent = $("open-only").checked ? "No open incidents." : "No incidents in the last 7 days.";
  }

  function applyFilter() {
    for (const [id, tr] of rows) tr.hidden = $("open-only").checked && !OPEN.has(statusOf(incidents.get(id)));
    updateEmpty();
  }

  // --- approve / reject ------------------------------------------------------------------------

  function setBusy(wrap, busy) {
    for (const b of wrap.querySelectorAll("button")) b.disabled = busy;
  }

  async function decide(rec, verb, body) {
    const path = `/api/recommendations/${encodeURIComponent(rec.decision_id)}/${verb}`;
    for (let attempt = 0; ; attempt++) {
      const r = await api(path, { method: "POST", body });
      const seen = seenLive.get(rec.decision_id);
      const fresh = seen !== undefined && Date.now() - seen < AUDIT_LAG_RETRY_MS * AUDIT_LAG_RETRIES;
      if (r.status === 404 && fresh && attempt < AUDIT_LAG_RETRIES) {
        notice(`Waiting for the audit to record ${rec.decision_id}\u2026`);
        await sleep(AUDIT_LAG_RETRY_MS);
        continue;
      }
      return r;
    }
  }

  async function approve(rec, wrap) {
    if (!operator) return askName("Enter your name: it is recorded with the approval.");
    setBusy(wrap, true);
    notice(`Approving ${rec.decision_action} for job ${rec.job_id}\u2026`);
    const r = await decide(rec, "approve", { operator, comment: "approved in the console" });
    if (r.status === 202 || r.status === 200) {
      upsert(rec.incident_id, { verdict: "approved", operator });
      notice(`Approved: ${rec.decision_action} for job ${rec.job_id} (action ${r.body.action_id}). Waiting for the result\u2026`);
      return;
    }
    if (r.status === 401) return;
    setBusy(wrap, false);
    if (r.status === 409 && /already approved/.test(detail(r))) upsert(rec.incident_id, { verdict: "approved" });
    if (r.status === 409 && /already rejected/.test(detail(r))) upsert(rec.incident_id, { verdict: "rejected" });
    error(`Approve failed (${r.status}): ${detail(r)}`);
  }

  let rejecting = null;

  function openReject(rec, wrap, what) {
    rejecting = { rec, wrap, opener: document.activeElement };
    $("reject-what").textContent = `Reject ${what}?`;
    $("reject-reason").value = "";
    $("reject-comment").value = "";
    $("reject-dialog").showModal();
    $("reject-reason").focus();
  }

  function closeReject() {
    const d = $("reject-dialog");
    if (d.open) d.close();
    if (rejecting && rejecting.opener && document.contains(rejecting.opener)) rejecting.opener.focus();
    rejecting = null;
  }

  async function submitReject(e) {
    e.preventDefault();
    if (!rejecting) return;
    const reason = $("reject-reason").value;
    if (!reason) {
      $("reject-reason").focus();
      return;
    }
    if (!operator) return askName("Enter your name: it is recorded with the rejection.");
    const { rec, wrap } = rejecting;
    const comment = $("reject-comment").value;
    closeReject();
    setBusy(wrap, true);
    const r = await decide(rec, "reject", { operator, reason, comment });
    if (r.status === 200) {
      upsert(rec.incident_id, { verdict: "rejected", reject_reason: reason, operator });
      notice(`Rejected: ${rec.decision_action} for job ${rec.job_id} (${reason}).`);
      return;
    }
    if (r.status === 401) return;
    setBusy(wrap, false);
    error(`Reject failed (${r.status}): ${detail(r)}`);
  }

  // --- action results -------------------------------------------------------------------------

  function addResult(r, flash) {
    const tbody = $("results").tBodies[0];
    const key = `${r.incident_id}|${r.action}|${r.status}`;
    if ([...tbody.rows].some((row) => row.dataset.key === key)) return;
    const tr = tbody.insertRow(0);
    tr.dataset.key = key;
    if (flash) flashRow(tr);
    tr.insertCell().appendChild(timeEl(toSeconds(r.t)));
    tr.insertCell().textContent = r.job_id ?? "\u2014";
    tr.insertCell().textContent = `${r.action}${r.node ? " " + r.node : ""}`;
    tr.insertCell().appendChild(badge(r.status));
    const steps = tr.insertCell();
    steps.append(text("span", r.steps));
    if (r.error) steps.append(text("span", r.error, "why"));
    while (tbody.rows.length > 50) tbody.deleteRow(-1);
    $("results-empty").hidden = tbody.rows.length > 0;
  }

  // --- snapshot loads ----------------------------------------------------------------------------

  async function loadSnapshot() {
    snapshotLoaded = true;
    await Promise.all([loadIncidents(), loadNodes(), loadModes(), loadCharts(), loadReadiness(), loadGoodput()]);
  }

  async function loadIncidents() {
    const r = await api("/api/incidents?since=7d&limit=200");
    if (r.status !== 200) return error(`Incidents could not be loaded (${r.status}): ${detail(r)}`);
    for (const row of r.body) {
      const existing = incidents.get(row.incident_id) || {};
      const merged = { ...row, detected_t: toSeconds(row.detected_at) };
      // Live events are at least as new as the snapshot: where both know a field, keep the live value.
      for (const [k, v] of Object.entries(existing)) if (v !== null && v !== undefined) merged[k] = v;
      incidents.set(row.incident_id, merged);
      renderIncident(merged, false);
    }
    const done = r.body.filter((row) => row.result_status).slice(0, 20).reverse();
    for (const row of done) {
      addResult({
        t: row.verified_at || row.detected_at,
        job_id: row.job_id,
        action: row.result_action,
        node: null,
        status: row.result_status,
        steps: row.result_steps,
        error: row.result_error,
        incident_id: row.incident_id,
      }, false);
    }
    updateEmpty();
  }

  async function loadNodes() {
    const r = await api("/api/nodes");
    if (r.status !== 200) return error(`Nodes could not be loaded (${r.status}): ${detail(r)}`);
    nodes = r.body;
    const tbody = $("nodes").tBodies[0];
    tbody.replaceChildren();
    const sorted = [...nodes].sort((a, b) => Number(b.drained) - Number(a.drained) || a.node.localeCompare(b.node));
    for (const n of sorted) {
      const tr = tbody.insertRow();
      if (n.drained) tr.className = "drained";
      const th = document.createElement("th");
      th.scope = "row";
      th.textContent = n.node;
      tr.appendChild(th);
      const state = [n.state, ...n.flags].join("+");
      tr.insertCell().textContent = n.drained ? `${state} (drained)` : state;
      const reason = tr.insertCell();
      reason.textContent = n.reason || "\u2014";
      if (n.drained_by_trainmedic) reason.append(text("span", "drained by trainmedic", "why"));
    }
    const drained = nodes.filter((n) => n.drained).length;
    $("nodes-summary").textContent = `${nodes.length} nodes, ${drained} drained`;
    renderModes();
  }

  async function loadReadiness() {
    const r = await api("/api/readiness");
    if (r.status !== 200) return error(`Readiness could not be loaded (${r.status}): ${detail(r)}`);
    const tbody = $("readiness").tBodies[0];
    tbody.replaceChildren();
    for (const s of r.body.filter((x) => x.partition === null)) {
      const tr = tbody.insertRow();
      const th = document.createElement("th");
      th.scope = "row";
      th.textContent = s.category;
      tr.appendChild(th);
      tr.insertCell().textContent = `${s.decided} of ${s.recommendations}`;
      tr.insertCell().textContent = s.precision === null ? "\u2014" : `${Math.round(s.precision * 100)}%`;
      tr.insertCell().textContent = String(s.misses);
      const verdict = tr.insertCell();
      verdict.appendChild(text("span", s.verdict.replace("_", " "), `badge ${s.verdict}`));
      if (s.missing.length) verdict.append(text("span", s.missing.join("; "), "why"));
    }
  }

  async function loadModes() {
    const r = await api("/api/modes");
    if (r.status !== 200) return error(`Modes could not be loaded (${r.status}): ${detail(r)}`);
    modes = r.body;
    renderModes();
  }

  function renderModes() {
    if (!modes) return;
    const note = $("modes-policy-error");
    note.textContent = modes.policy_error
      ? `The policy file failed to load: ${modes.policy_error}. The modes shown are the last good policy's.`
      : "";
    note.hidden = !modes.policy_error;
    const tbody = $("modes").tBodies[0];
    tbody.replaceChildren();
    const names = new Set(Object.keys(modes.partitions || {}));
    for (const n of nodes) for (const p of n.partitions || []) names.add(p);
    const overrides = (cats) =>
      Object.entries(cats || {})
        .map(([c, m]) => `${c}: ${m}`)
        .join(", ") || "\u2014";
    const row = (label, mode, cats) => {
      const tr = tbody.insertRow();
      const th = document.createElement("th");
      th.scope = "row";
      th.textContent = label;
      tr.appendChild(th);
      tr.insertCell().appendChild(text("span", mode, `badge ${mode}`));
      tr.insertCell().textContent = overrides(cats);
    };
    row("(default)", modes.mode, modes.categories);
    for (const p of [...names].sort()) {
      const part = (modes.partitions || {})[p] || {};
      row(p, part.mode || modes.mode, { ...(modes.categories || {}), ...(part.categories || {}) });
    }
  }

  async function loadCharts() {
    const r = await api("/api/charts?since=7d");
    if (r.status !== 200) return error(`Charts could not be loaded (${r.status}): ${detail(r)}`);
    const lat = r.body.latency && r.body.latency.overall;
    const series = [
      { name: "p50", cls: "p50" },
      { name: "p95", cls: "p95" },
      { name: "p99", cls: "p99" },
    ];
    const latencyRows = lat
      ? [
          { label: "Detection", values: [lat.detection_p50, lat.detection_p95, lat.detection_p99] },
          { label: "Action", values: [lat.action_p50, lat.action_p95, lat.action_p99] },
          { label: "Recovery", values: [lat.recovery_p50, lat.recovery_p95, lat.recovery_p99] },
        ]
      : [];
    window.TMCharts.bars($("latency-chart"), {
      title: "Latency percentiles",
      desc: "Detection (first signal to incident), action (incident to verified action) and recovery, in seconds",
      unit: "s",
      rowHeader: "Latency",
      series,
      rows: latencyRows,
    });
    $("latency-note").textContent = r.body.latency_error
      ? r.body.latency_error
      : lat
        ? `${lat.incidents} incidents, ${lat.actions_verified} with a verified action`
        : "No incidents yet.";
    window.TMCharts.bars($("categories-chart"), {
      title: "Incidents by category, last 7 days",
      desc: "Number of incidents per fault category",
      unit: "",
      rowHeader: "Category",
      series: [{ name: "incidents", cls: "cat" }],
      rows: r.body.categories.map((c) => ({ label: c.category, values: [c.incidents] })),
    });
  }

  const fmtNum = (v, digits) => (v === null || v === undefined ? "\u2014" : Number(v).toFixed(digits));
  const fmtPct = (v) => (v === null || v === undefined ? "\u2014" : `${(Number(v) * 100).toFixed(1)}%`);

  function rowHeader(tr, value) {
    const th = document.createElement("th");
    th.scope = "row";
    if (value instanceof Node) th.appendChild(value);
    else th.textContent = value;
    tr.appendChild(th);
    return th;
  }

  async function loadGoodput() {
    const r = await api("/api/goodput?since=7d&limit=5");
    if (r.status !== 200) return error(`Goodput could not be loaded (${r.status}): ${detail(r)}`);
    const f = r.body.fleet;
    const gpn = r.body.assumptions.gpus_per_node;
    const parts = [
      `${f.incidents} incident(s): ${fmtNum(f.gpu_hours_lost, 1)} GPU-hours lost in ${f.outages} outage(s) (fault to running again, overlapping ones charged once, ${gpn} GPUs per node)`,
    ];
    const saved = r.body.saved_by_migration;
    if (saved && (saved.migrations_requeued || saved.false_predictions_drained)) {
      parts.push(
        `${fmtNum(saved.gpu_hours_saved, 1)} GPU-hours saved by migration (at least; ${saved.migrations_requeued} job(s) moved at a checkpoint), ` +
          `${fmtNum(saved.false_drain_node_hours, 1)} node-hours drained for ${saved.false_predictions_drained} false prediction(s)`,
      );
    }
    if (f.incidents_not_running_again) parts.push(`${f.incidents_not_running_again} not running again (not counted)`);
    if (f.incidents_kept_running) parts.push(`${f.incidents_kept_running} did not stop their job (0)`);
    parts.push(
      f.effective_ratio === null
        ? "effective training time: no job reported progress"
        : `effective training time ${fmtPct(f.effective_ratio)} over ${f.jobs_with_ratio} job(s) reporting progress`,
    );
    $("goodput-summary").textContent = parts.join("; ") + ".";
    const times = $("goodput-times").tBodies[0];
    times.replaceChildren();
    for (const [label, key] of [["Detect", "time_to_detect"], ["Act", "time_to_act"], ["Recover", "time_to_recover"]]) {
      const tr = times.insertRow();
      rowHeader(tr, label);
      for (const stat of ["p50", "p95", "mean"]) {
        const td = tr.insertCell();
        td.className = "num";
        td.textContent = fmtNum(f[`${key}_${stat}`], 1);
      }
    }
    const jobs = $("goodput-jobs").tBodies[0];
    jobs.replaceChildren();
    for (const j of r.body.jobs) {
      const tr = jobs.insertRow();
      const b = document.createElement("button");
      b.type = "button";
      b.className = "quiet";
      b.textContent = j.job_id;
      b.setAttribute("aria-label", `Show the timeline and attempts of job ${j.job_id}`);
      b.addEventListener("click", () => loadTimeline(j.job_id, true));
      rowHeader(tr, b);
      const lost = tr.insertCell();
      lost.className = "num";
      lost.textContent = fmtNum(j.gpu_hours_lost, 2);
      if (j.incidents_not_running_again) lost.append(text("span", `${j.incidents_not_running_again} not running again`, "why"));
      if (j.incidents_kept_running) lost.append(text("span", `${j.incidents_kept_running} kept running`, "why"));
      const restarts = tr.insertCell();
      restarts.className = "num";
      restarts.textContent = String(j.restarts ?? 0);
      const eff = tr.insertCell();
      eff.className = "num";
      eff.textContent = fmtPct(j.effective_ratio);
      if (j.attempts_running) eff.append(text("span", "running", "why"));
    }
    $("goodput-empty").hidden = f.incidents > 0 || r.body.jobs.length > 0;
  }

  const PROGRESS_TEXT = { true: "Made progress", false: "No progress", null: "Unknown" };

  function renderAttempts(attempts) {
    const table = $("attempts");
    const tbody = table.tBodies[0];
    tbody.replaceChildren();
    const lineages = new Set(attempts.map((a) => a.lineage_id));
    for (const a of attempts) {
      const tr = tbody.insertRow();
      rowHeader(tr, lineages.size > 1 ? `${a.attempt} (${a.lineage_id})` : String(a.attempt));
      tr.insertCell().appendChild(timeEl(toSeconds(a.started_at)));
      const ended = tr.insertCell();
      if (a.ended_at) {
        ended.appendChild(timeEl(toSeconds(a.ended_at)));
        if (a.end_reason) ended.append(text("span", a.end_reason, "why"));
      } else {
        ended.textContent = "running";
      }
      const cause = tr.insertCell();
      cause.append(text("span", a.cause_incident_id));
      if (a.cause_incident_id) {
        cause.append(text("span", `${a.cause_category ?? "?"}${a.cause_node ? " on " + a.cause_node : ""}`, "why"));
      }
      tr.insertCell().textContent = (a.excluded_nodes || []).join(", ") || "\u2014";
      const prog = tr.insertCell();
      const verdict = a.progressed === null || a.progressed === undefined ? null : Boolean(a.progressed);
      prog.append(text("span", a.ended_at || verdict !== null ? PROGRESS_TEXT[verdict] : "Running (judged at its end)"));
      const steps = `step ${a.start_step ?? "\u2014"} \u2192 ${a.max_step ?? "\u2014"}`;
      prog.append(text("span", a.new_checkpoint ? `${steps}, new checkpoint` : steps, "why"));
    }
    table.hidden = attempts.length === 0;
  }

  function renderMigrations(jobId, migrations) {
    const table = $("migrations");
    const tbody = table.tBodies[0];
    tbody.replaceChildren();
    for (const m of migrations) {
      const tr = tbody.insertRow();
      rowHeader(tr, `${m.node} GPU ${m.gpu ?? "?"}`);
      const state = tr.insertCell();
      state.append(text("span", m.state === "waiting" ? "Pending: node drained" : m.state));
      state.append(text("span", m.detail, "why"));
      const wanted = m.checkpoint_before === null || m.checkpoint_before === undefined
        ? "its first completed checkpoint"
        : `checkpoint ${m.checkpoint_before + 1} or later`;
      tr.insertCell().textContent = m.state === "waiting" ? wanted : (m.checkpoint_step ?? "\u2014");
      tr.insertCell().appendChild(timeEl(toSeconds(m.deadline)));
      const cell = tr.insertCell();
      if (m.state !== "waiting") continue;
      const b = text("button", "Cancel migration");
      b.type = "button";
      b.setAttribute("aria-label", `Cancel the migration of job ${jobId} off ${m.node} and resume the node`);
      b.addEventListener("click", () => cancelMigration(jobId, cell));
      cell.append(b);
    }
    table.hidden = migrations.length === 0;
  }

  async function cancelMigration(jobId, cell) {
    if (!operator) return askName("Enter your name: it is recorded with the cancel.");
    setBusy(cell, true);
    notice(`Cancelling the migration of job ${jobId}\u2026`);
    const body = { operator, comment: "cancelled in the console" };
    const r = await api(`/api/migrations/${encodeURIComponent(jobId)}/cancel`, { method: "POST", body });
    if (r.status === 401) return;
    setBusy(cell, false);
    if (r.status !== 200) return notice(`The migration of job ${jobId} was not cancelled (${r.status}): ${detail(r)}`);
    notice(`Cancelled ${r.body.migration_id} of job ${jobId}: ${r.body.detail}`);
    loadTimeline(jobId, false);
  }

  async function loadTimeline(jobId, focus) {
    if (!jobId) return;
    timelineJob = jobId;
    $("timeline-job").value = jobId;
    const summary = $("timeline-summary");
    const table = $("timeline");
    const r = await api(`/api/jobs/${encodeURIComponent(jobId)}/timeline`);
    if (r.status === 404) {
      table.hidden = true;
      $("attempts").hidden = true;
      $("migrations").hidden = true;
      summary.textContent = `Nothing recorded for job ${jobId}.`;
      return;
    }
    if (r.status !== 200) {
      table.hidden = true;
      $("attempts").hidden = true;
      $("migrations").hidden = true;
      summary.textContent = `The timeline of job ${jobId} could not be loaded (${r.status}): ${detail(r)}`;
      return;
    }
    const t = r.body;
    const attempts = t.attempts || [];
    summary.textContent =
      `Job ${t.job_id}: ${t.incidents.length} incident(s), ${t.restarts} restart(s), ` +
      `${attempts.length} attempt(s), ${t.timeline.length} events.`;
    renderAttempts(attempts);
    renderMigrations(t.job_id, t.migrations || []);
    const tbody = table.tBodies[0];
    tbody.replaceChildren();
    for (const item of t.timeline) {
      const tr = tbody.insertRow();
      tr.insertCell().appendChild(timeEl(toSeconds(item.time)));
      tr.insertCell().textContent = item.kind;
      tr.insertCell().textContent = item.node || "\u2014";
      const s = tr.insertCell();
      s.append(text("span", item.summary));
      if (item.detail) s.append(text("span", item.detail, "why"));
    }
    table.hidden = false;
    if (focus) $("timeline-heading").scrollIntoView({ block: "start" });
  }

  // --- start --------------------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", (e) => {
      e.preventDefault();
      signIn($("login-token").value.trim(), $("login-operator").value.trim());
    });
    $("sign-out").addEventListener("click", () => signOut(""));
    $("open-only").addEventListener("change", applyFilter);
    $("timeline-form").addEventListener("submit", (e) => {
      e.preventDefault();
      loadTimeline($("timeline-job").value.trim(), false);
    });
    $("reject-form").addEventListener("submit", submitReject);
    $("reject-cancel").addEventListener("click", closeReject);
    $("reject-dialog").addEventListener("cancel", () => {
      rejecting = null;
    });
    // A link like http://127.0.0.1:PORT/#token=TOKEN[&operator=NAME] signs in without typing: a fragment
    // never reaches a server (nor its log, nor a Referer). It leaves the address bar before anything else
    // runs, so the token stays out of the history, bookmarks and screenshots; signIn keeps it where the
    // form does. The name is asked when it is needed (approve, reject): a read-only token never needs it.
    // Split by hand, not URLSearchParams: that reads "+" as a space, and a token may hold one.
    // A token may end in "=" too (base64 padding): each part splits at its first "=" only.
    const decode = (v) => {
      try {
        return decodeURIComponent(v);
      } catch (_) {
        return v; // a stray "%": taken as it is, and the server judges the token
      }
    };
    const link = new Map(
      location.hash
        .slice(1)
        .split("&")
        .filter((part) => part.includes("="))
        .map((part) => [part.slice(0, part.indexOf("=")), decode(part.slice(part.indexOf("=") + 1))]),
    );
    const linkToken = (link.get("token") || "").trim();
    if (location.hash) history.replaceState(null, "", location.pathname + location.search);
    if (linkToken) signIn(linkToken, (link.get("operator") || operator).trim());
    else if (token) signIn(token, operator);
    else showLogin("");
  });
})();
