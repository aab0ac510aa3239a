// The job page's checkpoints table: step, losses, size, formats, and download links.
//
// A download needs the Bearer token, which a plain link cannot send: with a token the
// archive is fetched and handed to the browser as a file (held in memory, fine for the
// models this page trains); without one (auth off) the link is a plain one, streamed to disk.

import { api, authHeaders, getToken } from "./api.js";
import { clock, dash, el, num } from "./format.js";

const REFRESH_MS = 10_000; // while the job runs; a finished job's list changes no more

function size(bytes) {
  if (!Number.isFinite(bytes)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let i = 0;
  while (value >= 1024 && i < units.length - 1) {
    value /= 1024;
    i += 1;
  }
  return i === 0 ? `${value} B` : `${value.toFixed(1)} ${units[i]}`;
}

function downloadUrl(jobId, step, format) {
  return `/v1/jobs/${encodeURIComponent(jobId)}/checkpoints/${step}/download?format=${format}`;
}

async function fetchAndSave(url, filename, link) {
  link.classList.add("busy");
  try {
    const res = await fetch(url, { headers: authHeaders(), cache: "no-store" });
    if (!res.ok) {
      const body = await res.json().catch(() => null);
      throw new Error((body && typeof body.detail === "string" && body.detail) || res.statusText);
    }
    const blob = await res.blob();
    const href = URL.createObjectURL(blob);
    const a = el("a", { href, download: filename, hidden: true });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(href), 60_000);
    link.title = "";
  } catch (err) {
    link.title = `Download failed: ${err.message}`;
    link.classList.add("error");
  } finally {
    link.classList.remove("busy");
  }
}

function downloadLink(jobId, step, format) {
  const url = downloadUrl(jobId, step, format);
  const filename = `${jobId}-step-${step}-${format}.tar`;
  const link = el("a", { href: url, download: filename, class: "download",
    "data-format": format, text: format });
  link.addEventListener("click", (ev) => {
    if (!getToken()) return; // auth off: the browser streams the plain link to disk
    ev.preventDefault();
    fetchAndSave(url, filename, link);
  });
  return link;
}

function row(jobId, c) {
  return el("tr", { "data-step": c.step },
    el("td", { class: "num", text: `${c.step}${c.latest ? " (latest)" : ""}` }),
    el("td", { class: "small", text: clock(c.time) }),
    el("td", { class: "num", text: num(c.loss) }),
    el("td", { class: "num", text: num(c.val_loss) }),
    el("td", { class: "num", text: size(c.size_bytes) }),
    el("td", { class: "mono", text: dash(c.strategy) }),
    el("td", {}, ...(c.formats || []).flatMap((f, i) =>
      [i ? " · " : null, downloadLink(jobId, c.step, f)])),
  );
}

// The section and `update(job)`, which job.js calls with every fresh job record.
export function checkpointsPane(jobId, signal) {
  const body = el("tbody");
  const pane = {
    items: null, // what the last listing answered (tests read it)
    error: null,
    node: el("section", { class: "card checkpoints" }, el("h2", { text: "Checkpoints" }),
      el("table", { class: "grid" },
        el("thead", {}, el("tr", {}, ["Step", "Written", "Loss", "Val loss", "Size",
          "Strategy", "Download"].map((c) => el("th", {
          class: ["Step", "Loss", "Val loss", "Size"].includes(c) ? "num" : null, text: c })))),
        body)),
  };
  let fetchedAt = 0;
  let lastStatus = null;

  async function refresh() {
    fetchedAt = Date.now();
    try {
      const out = await api(`/v1/jobs/${encodeURIComponent(jobId)}/checkpoints`, { signal });
      pane.items = out.items || [];
      pane.error = null;
      body.replaceChildren(...pane.items.slice().reverse().map((c) => row(jobId, c)));
      if (!pane.items.length) {
        body.append(el("tr", {}, el("td", { colspan: 7, class: "empty",
          text: "No checkpoint yet." })));
      }
    } catch (err) {
      if (!signal.aborted) pane.error = err.message;
    }
  }

  pane.update = (job) => {
    const changed = job.status !== lastStatus;
    lastStatus = job.status;
    if (changed || (job.status === "running" && Date.now() - fetchedAt >= REFRESH_MS)) {
      refresh();
    }
  };
  return pane;
}
