// The jobs table: GET /v1/jobs polled every two seconds while the view is open.

import { api } from "./api.js";
import { age, dash, el, num, percent, si, statusPill } from "./format.js";

const POLL_MS = 2000;
const COLUMNS = ["Name", "Status", "Owner", "Queue", "Age", "Step", "Loss", "Tokens/s", "MFU"];
const NUMERIC = new Set(["Age", "Step", "Loss", "Tokens/s", "MFU"]);

export function latestOf(job) {
  return job.latest || job.metrics || {};
}

function stepText(latest) {
  if (latest.step === null || latest.step === undefined) return "–";
  return latest.steps ? `${latest.step} / ${latest.steps}` : String(latest.step);
}

function row(job) {
  const latest = latestOf(job);
  const reasonTitle = job.message || job.pending_reason || "";
  return el(
    "tr",
    { "data-job-id": job.id, onclick: () => { location.hash = `#/jobs/${job.id}`; } },
    el("td", {},
      el("a", { href: `#/jobs/${job.id}`, class: "job-name", text: job.name || job.id }),
      el("div", { class: "muted mono small", text: job.id })),
    el("td", { title: reasonTitle },
      statusPill(job.status, job.reason),
      reasonTitle ? el("div", { class: "muted small clip", text: reasonTitle }) : null),
    el("td", { text: dash(job.owner) }),
    el("td", { class: "mono", text: dash(job.queue) }),
    el("td", { class: "num", text: age(job.created_at) }),
    el("td", { class: "num", text: stepText(latest) }),
    el("td", { class: "num", text: num(latest.loss) }),
    el("td", { class: "num", text: si(latest.tokens_per_s) }),
    el("td", { class: "num", text: percent(latest.mfu) }),
  );
}

export function mountJobs(view, state) {
  const tbody = el("tbody");
  const footer = el("p", { class: "muted small" });
  const table = el("table", { class: "grid jobs" },
    el("thead", {}, el("tr", {}, COLUMNS.map((c) =>
      el("th", { class: NUMERIC.has(c) ? "num" : null, text: c })))), tbody);
  view.append(
    el("div", { class: "view-head" }, el("h1", { text: "Jobs" }), footer),
    el("section", { class: "card flush" }, table),
  );
  state.jobs = { polls: 0, ids: [], error: null };
  let timer = 0;
  let stopped = false;
  const controller = new AbortController();

  async function poll() {
    try {
      const page = await api("/v1/jobs?limit=100", { signal: controller.signal });
      const items = page.items || [];
      tbody.replaceChildren(...items.map(row));
      if (!items.length) {
        tbody.append(el("tr", {}, el("td", { colspan: COLUMNS.length, class: "empty",
          text: "No jobs yet. Submit one with POST /v1/jobs." })));
      }
      state.jobs.ids = items.map((j) => j.id);
      state.jobs.error = null;
      footer.textContent = `${items.length} job${items.length === 1 ? "" : "s"}` +
        `${page.next_cursor ? " (newest 100)" : ""} · updated ${new Date().toLocaleTimeString()}`;
      state.setConn("ok");
    } catch (err) {
      if (stopped) return;
      state.jobs.error = err.message;
      footer.textContent = `Could not load jobs: ${err.message}`;
      state.setConn(err.status === 401 ? "auth" : "error");
    } finally {
      state.jobs.polls += 1;
      if (!stopped) timer = setTimeout(poll, POLL_MS);
    }
  }
  poll();
  return () => {
    stopped = true;
    clearTimeout(timer);
    controller.abort();
  };
}
