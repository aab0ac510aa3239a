// The datasets table: GET /v1/datasets polled every three seconds while the view is open.
// Status (with the reason a failed one carries), who owns it, and its counts once ready.

import { mountPolledTable } from "./table.js";
import { age, dash, el, si, statusPill } from "./format.js";

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

function row(d) {
  return el(
    "tr",
    { "data-dataset": d.name, "data-owner": d.owner },
    el("td", {},
      el("span", { class: "job-name", text: d.name }),
      el("div", { class: "muted mono small", text: d.path })),
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
