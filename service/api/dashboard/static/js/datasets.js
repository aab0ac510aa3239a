// The datasets table: GET /v1/datasets polled every three seconds while the view is open.
// Status (with the reason a failed one carries), who owns it, and its counts once ready; a
// chat or completion dataset's report (trainer.sft.SftReport) under its name.

import { mountPolledTable } from "./table.js";
import { age, dash, el, percent, si, statusPill } from "./format.js";

const POLL_MS = 3000;
const COLUMNS = [
  "Name", "Status", "Owner", "Format", "Size", "Documents", "Train tokens", "Val tokens",
  "Vocab", "Age",
];
const NUMERIC = new Set(["Size", "Documents", "Train tokens", "Val tokens", "Vocab", "Age"]);
// A dataset's status in the colours of the job statuses that mean the same.
const TONE = { uploading: "dispatched", preparing: "running", ready: "succeeded", failed: "failed" };

function bytes(value) {
  if (value === null || value === undefined) return dash(value);
  return value < 1000 ? `${value} B` : `${si(value)}B`;
}

// "400 examples · 21.3% of 9.1k tokens carry loss · longest 87 · packed 96.3% at seq_len 511 ·
// dropped: 2 too_long · truncated 0" (a field the record lacks is left out).
function report(r) {
  if (!r || typeof r !== "object") return null;
  const dropped = Object.entries(r.dropped || {}).map(([why, n]) => `${n} ${why}`).join(", ");
  const parts = [
    `${dash(r.examples)} examples`,
    `${percent(r.loss_share)} of ${si(r.tokens)} tokens carry loss`,
    r.longest ? `longest ${r.longest}` : null,
    r.longest ? `packed ${percent(r.packing_efficiency)} at seq_len ${r.packing_seq_len}` : null,
    `dropped: ${dropped || "none"}`,
    `truncated ${dash(r.truncated)}`,
  ];
  return el("div", { class: "muted small sft-report", text: parts.filter(Boolean).join(" · ") });
}

function row(d) {
  return el(
    "tr",
    { "data-dataset": d.name, "data-owner": d.owner },
    el("td", {},
      el("span", { class: "job-name", text: d.name }),
      el("div", { class: "muted mono small", text: d.path }),
      d.status === "ready" ? report(d.report) : null),
    el("td", { title: d.reason || "" },
      statusPill(d.status, null, TONE[d.status]),
      d.reason ? el("div", { class: "muted small clip", text: d.reason }) : null),
    el("td", { text: dash(d.owner) }),
    el("td", { class: "mono", text: `${d.format} · ${d.tokenizer}` }),
    el("td", { class: "num", text: bytes(d.bytes) }),
    el("td", { class: "num", text: dash(d.documents) }),
    el("td", { class: "num", text: si(d.train_tokens) }),
    el("td", { class: "num", text: si(d.val_tokens) }),
    el("td", { class: "num", text: dash(d.vocab_size) }),
    el("td", { class: "num", text: age(d.created_at) }),
  );
}

export function mountDatasets(view, state) {
  return mountPolledTable(view, state, {
    key: "datasets", title: "Datasets", className: "datasets", columns: COLUMNS,
    numeric: NUMERIC, url: "/v1/datasets", pollMs: POLL_MS, row, noun: "dataset",
    empty: "No datasets yet. Upload one with trainq data upload FILE --name NAME.",
    idsKey: "names", idOf: (d) => d.name,
  });
}
