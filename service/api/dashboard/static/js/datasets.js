// The datasets table: GET /v1/datasets polled every three seconds while the view is open.
// Status (with the reason a failed one carries), who owns it, and its counts once ready.

import { api } from "./api.js";
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
  const tbody = el("tbody");
  const footer = el("p", { class: "muted small" });
  const table = el("table", { class: "grid datasets" },
    el("thead", {}, el("tr", {}, COLUMNS.map((c) =>
      el("th", { class: NUMERIC.has(c) ? "num" : null, text: c })))), tbody);
  view.append(
    el("div", { class: "view-head" }, el("h1", { text: "Datasets" }), footer),
    el("section", { class: "card flush" }, table),
  );
  state.datasets = { polls: 0, names: [], error: null };
  let timer = 0;
  let stopped = false;
  const controller = new AbortController();

  async function poll() {
    try {
      const page = await api("/v1/datasets", { signal: controller.signal });
      const items = page.items || [];
      tbody.replaceChildren(...items.map(row));
      if (!items.length) {
        tbody.append(el("tr", {}, el("td", { colspan: COLUMNS.length, class: "empty",
          text: "No datasets yet. Upload one with trainq data upload FILE --name NAME." })));
      }
      state.datasets.names = items.map((d) => d.name);
      state.datasets.error = null;
      footer.textContent = `${items.length} dataset${items.length === 1 ? "" : "s"}` +
        ` · updated ${new Date().toLocaleTimeString()}`;
      state.setConn("ok");
    } catch (err) {
      if (stopped) return;
      state.datasets.error = err.message;
      footer.textContent = `Could not load datasets: ${err.message}`;
      state.setConn(err.status === 401 ? "auth" : "error");
    } finally {
      state.datasets.polls += 1;
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
