// The jobs table: GET /v1/jobs polled every two seconds while the view is open.

import { mountPolledTable } from "./table.js";
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
  return mountPolledTable(view, state, {
    key: "jobs", title: "Jobs", className: "jobs", columns: COLUMNS, numeric: NUMERIC,
    url: "/v1/jobs?limit=100", pollMs: POLL_MS, row, noun: "job",
    empty: "No jobs yet. Submit one with POST /v1/jobs.",
    idsKey: "ids", idOf: (j) => j.id, note: (page) => (page.next_cursor ? " (newest 100)" : ""),
  });
}
