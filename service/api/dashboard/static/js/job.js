// One job: live charts (SSE metric events over a downsampled history), attempts, logs, cancel.

import { api, ApiError } from "./api.js";
import { ChartGrid, MetricStore } from "./charts.js";
import { clock, dash, duration, el, num, parseTime, percent, si, statusPill, TERMINAL }
  from "./format.js";
import { checkpointsPane } from "./checkpoints.js";
import { LogPane } from "./logs.js";
import { generateBox } from "./generate.js";
import { follow } from "./sse.js";

// The API downsamples history to this many points, so a 100,000-step run draws quickly.
export const HISTORY_POINTS = 2000;
const REFRESH_MS = 3000;
const MAX_LIVE_STEPS = 50_000; // steps seen on the stream, kept for tests (a bounded list)
const STREAM_TAIL = 2000; // events replayed when the page opens (logs pane: its last lines)

// SSE data is the event's payload plus {attempt, source, ts} (service/sse.py).
function payloadOf(ev) {
  try {
    const data = JSON.parse(ev.data);
    if (data && typeof data === "object") return { kind: ev.type, attempt: data.attempt, data };
  } catch {
    // not JSON: nothing to show
  }
  return { kind: ev.type, attempt: undefined, data: null };
}

function attemptTone(a) {
  if (a.status !== "exited") return a.status;
  if (!a.reason) return "succeeded";
  return a.reason === "cancelled" ? "cancelled" : "failed";
}

function attemptRow(a) {
  const start = parseTime(a.started_at);
  const end = parseTime(a.ended_at);
  return el("tr", { "data-attempt": a.number ?? a.attempt },
    el("td", { class: "num", text: dash(a.number ?? a.attempt) }),
    el("td", {}, statusPill(a.status, a.reason, attemptTone(a))),
    el("td", { class: "mono", text: dash(a.host) }),
    el("td", { class: "mono small", text: dash(a.worker) }),
    el("td", { class: "num", text: dash(a.exit_code) }),
    el("td", { class: "small", text: clock(a.started_at) }),
    el("td", { class: "num", text: start ? duration((end || Date.now()) - start) : "–" }),
    el("td", { class: "small clip", title: a.message || "", text: dash(a.message) }),
  );
}

function stat(label, node) {
  return el("div", { class: "stat" }, el("div", { class: "stat-label", text: label }), node);
}

export function mountJob(view, state, jobId, { points = HISTORY_POINTS } = {}) {
  const historyPoints = Math.min(100_000, Math.max(10, Math.round(points)));
  const controller = new AbortController();
  const { signal } = controller;
  const store = new MetricStore(Math.max(6000, 2 * historyPoints));
  const t0 = performance.now();
  const js = {
    id: jobId,
    job: null,
    error: null,
    cancel: null, // the status the cancel request answered with
    // History: what was asked, what came, the newest (step, attempt) it holds.
    historyRequested: historyPoints,
    historyReceived: null,
    historyDownsampled: null,
    historyLast: null,
    firstRenderMs: null, // mount to charts drawn, history request included
    drawMs: null,
    historyFetchMs: null, // the request and its JSON, of firstRenderMs
    // Stream: events seen, replayed points skipped, steps drawn from it, ids seen twice.
    stream: {},
    streamState: "connecting",
    metricEvents: 0,
    skippedReplay: 0,
    liveSteps: [],
    streamIds: new Set(),
    duplicateEvents: 0,
  };
  state.job = js;
  // Tests read these: how many points the store and each chart hold.
  js.points = () => store.size;
  js.chartPoints = () => grid.pointCounts();
  js.steps = () => [...store.steps];

  const title = el("h1", { text: jobId });
  const pill = el("span");
  const streamBadge = el("span", { class: "badge", text: "connecting" });
  const cancelButton = el("button", { class: "danger", type: "button", text: "Cancel job" });
  const message = el("p", { class: "message", hidden: true });
  const stats = el("div", { class: "stats card" });
  const attemptsBody = el("tbody");
  const logs = new LogPane();
  const checkpoints = checkpointsPane(jobId, signal);
  js.checkpoints = checkpoints; // tests read its items
  view.append(
    el("div", { class: "view-head" },
      el("a", { href: "#/", class: "back", text: "← Jobs" }),
      el("div", { class: "title-row" }, title, pill, streamBadge, el("span", { class: "spacer" }),
        cancelButton)),
    message,
    stats,
  );
  const grid = new ChartGrid(view, store);
  grid.onDraw = () => renderStats();
  view.append(
    el("section", { class: "card" }, el("h2", { text: "Attempts" }),
      el("table", { class: "grid attempts" },
        el("thead", {}, el("tr", {}, ["#", "Status", "Host", "Worker", "Exit", "Started",
          "Duration", "Message"].map((c) =>
          el("th", { class: ["#", "Exit", "Duration"].includes(c) ? "num" : null, text: c })))),
        attemptsBody)),
    checkpoints.node,
    logs.node,
    generateBox(jobId, signal),
  );

  function renderJob(job) {
    js.job = job;
    title.textContent = job.name || job.id;
    pill.replaceChildren(statusPill(job.status, job.reason));
    const text = job.message || job.pending_reason || "";
    message.hidden = !text;
    message.textContent = text;
    message.className = `message ${job.status === "failed" ? "error" : ""}`;
    cancelButton.hidden = TERMINAL.has(job.status);
    cancelButton.disabled = job.status === "cancelling";
    if (job.status === "cancelling") cancelButton.textContent = "Cancelling…";
    renderStats();
    checkpoints.update(job);
    const attempts = job.attempts || [];
    attemptsBody.replaceChildren(...attempts.map(attemptRow));
    if (!attempts.length) {
      attemptsBody.append(el("tr", {}, el("td", { colspan: 8, class: "empty",
        text: "No attempt yet." })));
    }
  }

  // The numbers row: the job's latest metrics, overtaken by live points as they arrive.
  function renderStats() {
    if (!js.job) return;
    const job = js.job;
    const latest = { ...(job.latest || {}) };
    for (const [k, v] of Object.entries(store.latest() || {})) if (v != null) latest[k] = v;
    const steps = latest.steps ?? job.train?.steps;
    const progress = steps && latest.step != null ? Math.min(1, latest.step / steps) : 0;
    stats.replaceChildren(
      stat("Step", el("div", { class: "stat-value" },
        `${dash(latest.step)}${steps ? ` / ${steps}` : ""}`,
        el("div", { class: "bar" },
          el("div", { style: { width: `${(progress * 100).toFixed(1)}%` } })))),
      stat("Loss", el("div", { class: "stat-value", text: num(latest.loss) })),
      stat("Val loss", el("div", { class: "stat-value", text: num(latest.val_loss) })),
      stat("Tokens/s", el("div", { class: "stat-value", text: si(latest.tokens_per_s) })),
      stat("MFU", el("div", { class: "stat-value", text: percent(latest.mfu) })),
      stat("Queue", el("div", { class: "stat-value mono", text: dash(job.queue) })),
      stat("Owner", el("div", { class: "stat-value", text: dash(job.owner) })),
      stat("Created", el("div", { class: "stat-value small", text: clock(job.created_at) })),
    );
  }

  async function refresh() {
    try {
      renderJob(await api(`/v1/jobs/${encodeURIComponent(jobId)}`, { signal }));
      js.error = null;
      state.setConn("ok");
    } catch (err) {
      if (signal.aborted) return;
      js.error = err.message;
      if (err instanceof ApiError && err.status === 404) {
        message.hidden = false;
        message.className = "message error";
        message.textContent = `Job ${jobId} not found.`;
      }
      state.setConn(err.status === 401 ? "auth" : "error");
    }
  }

  // Many events in a row (a replay) cost one GET, not one each.
  let soon = 0;
  function refreshSoon() {
    if (soon) return;
    soon = setTimeout(() => {
      soon = 0;
      refresh();
    }, 250);
  }

  let refreshTimer = 0;
  async function refreshLoop() {
    await refresh();
    const over = js.job && TERMINAL.has(js.job.status) && js.streamState === "closed";
    if (!signal.aborted && !over) {
      refreshTimer = setTimeout(refreshLoop, REFRESH_MS);
    }
  }

  function onEvent(ev) {
    if (ev.id !== null) {
      if (js.streamIds.has(ev.id)) {
        js.duplicateEvents += 1;
        return undefined;
      }
      js.streamIds.add(ev.id);
    }
    const { kind, attempt, data } = payloadOf(ev);
    if (!data) return undefined;
    if (kind === "metric") {
      js.metricEvents += 1;
      // The stream starts at its oldest entry; what the downsampled history already covers
      // is not drawn again at full resolution (a retry's new attempt is, as it replaces it).
      const h = js.historyLast;
      if (h && data.step <= h.step && (attempt ?? 0) <= h.attempt) {
        js.skippedReplay += 1;
        return undefined;
      }
      if (js.liveSteps.length < MAX_LIVE_STEPS) js.liveSteps.push(data.step);
      store.add(data);
      grid.schedule();
    } else if (kind === "log") {
      logs.append(data.lines || [], attempt);
    } else if (kind === "status") {
      // The row is the truth (a replayed status is old news): fetch it rather than apply this.
      refreshSoon();
      // The service ends the stream after the final status; following again would only
      // wait for a ping interval to hear the same.
      if (TERMINAL.has(data.status)) return "done";
    } else if (kind === "lifecycle") {
      refreshSoon(); // a new attempt, its host, its exit code
    }
    return undefined;
  }

  async function loadHistory() {
    const url = `/v1/jobs/${encodeURIComponent(jobId)}/metrics?max_points=${historyPoints}`;
    try {
      const f0 = performance.now();
      const body = await api(url, { signal });
      js.historyFetchMs = performance.now() - f0;
      const points = Array.isArray(body) ? body : body.points || body.items || [];
      js.historyReceived = points.length;
      js.historyDownsampled = Boolean(body.downsampled);
      if (points.length) {
        js.historyLast = {
          step: Math.max(...points.map((p) => p.step)),
          attempt: Math.max(...points.map((p) => p.attempt ?? 0)),
        };
      }
      store.addMany(points.map((p) => (p.data ? { step: p.step, ...p.data } : p)));
      grid.draw();
      js.drawMs = grid.renderMs;
      js.firstRenderMs = performance.now() - t0;
    } catch (err) {
      if (!signal.aborted) js.error = err.message;
    }
  }

  cancelButton.addEventListener("click", async () => {
    // Two clicks, not window.confirm(): a modal would block the page's live updates.
    if (cancelButton.dataset.armed !== "1") {
      cancelButton.dataset.armed = "1";
      cancelButton.textContent = "Confirm cancel";
      setTimeout(() => {
        if (cancelButton.dataset.armed === "1") {
          cancelButton.dataset.armed = "";
          cancelButton.textContent = "Cancel job";
        }
      }, 4000);
      return;
    }
    cancelButton.dataset.armed = "";
    cancelButton.disabled = true;
    try {
      const job = await api(`/v1/jobs/${encodeURIComponent(jobId)}/cancel`, { method: "POST" });
      js.cancel = job.status;
      renderJob({ ...(js.job || {}), ...job });
    } catch (err) {
      js.cancel = `error: ${err.message}`;
      cancelButton.disabled = false;
      cancelButton.textContent = "Cancel job";
      message.hidden = false;
      message.className = "message error";
      message.textContent = `Cancel failed: ${err.message}`;
    }
  });

  refreshLoop();
  // History first, then the stream: the stream replays its last STREAM_TAIL events (not
  // the whole stream: a long job's would be thousands), and onEvent skips the points the
  // history holds (it needs js.historyLast for that).
  const events = `/v1/jobs/${encodeURIComponent(jobId)}/events?tail=${STREAM_TAIL}`;
  loadHistory().then(() => follow(events, onEvent, {
    signal,
    stats: js.stream,
    onState: (s) => {
      js.streamState = s;
      streamBadge.textContent = s === "open" ? "live" : s;
      streamBadge.className = `badge badge-${s}`;
    },
  }));

  return () => {
    controller.abort();
    clearTimeout(refreshTimer);
    clearTimeout(soon);
    grid.destroy();
  };
}
