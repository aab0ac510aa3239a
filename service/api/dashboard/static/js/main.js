// The dashboard's entry point: a hash router (#/, #/jobs/ID, #/datasets) and the token dialog.
//
// window.__trainq is the page's state, read by the browser tests and the bench.

import { getToken, onAuthNeeded, setToken } from "./api.js";
import { mountDatasets } from "./datasets.js";
import { mountJob } from "./job.js";
import { mountJobs } from "./jobs.js";
import { mountSweep } from "./sweep.js";

const view = document.getElementById("view");
const conn = document.getElementById("conn");
const dialog = document.getElementById("token-dialog");
const tokenInput = document.getElementById("token-input");
const tokenError = document.getElementById("token-error");

const state = {
  route: null,
  authPrompts: 0,
  setConn(s) {
    conn.dataset.state = s;
    conn.textContent = { ok: "connected", error: "API unreachable", auth: "token needed" }[s] || s;
  },
};
window.__trainq = state;

let unmount = () => {};

function route() {
  unmount();
  view.replaceChildren();
  const match = location.hash.match(/^#\/jobs\/([^/?#]+)(?:\?(.*))?/);
  if (match) {
    // ?points=N asks for a finer (or coarser) history than the default.
    const points = Number(new URLSearchParams(match[2] || "").get("points")) || undefined;
    state.route = { name: "job", id: decodeURIComponent(match[1]), points };
    unmount = mountJob(view, state, state.route.id, { points });
  } else if (/^#\/sweeps\/[^/?#]+$/.test(location.hash)) {
    const id = decodeURIComponent(location.hash.slice("#/sweeps/".length));
    state.route = { name: "sweep", id };
    unmount = mountSweep(view, state, id);
  } else if (/^#\/datasets\/?$/.test(location.hash)) {
    state.route = { name: "datasets" };
    unmount = mountDatasets(view, state);
  } else {
    state.route = { name: "jobs" };
    state.job = null;
    unmount = mountJobs(view, state);
  }
}

function openTokenDialog(status) {
  if (dialog.open) return;
  state.authPrompts += 1;
  tokenError.hidden = !getToken() || !status;
  tokenError.textContent = status === 403
    ? "This token may not see that."
    : "The saved token was not accepted.";
  tokenInput.value = "";
  dialog.showModal();
  tokenInput.focus();
}

onAuthNeeded(openTokenDialog);
document.getElementById("token-button").addEventListener("click", () => openTokenDialog(0));
document.getElementById("token-form").addEventListener("submit", () => {
  setToken(tokenInput.value.trim());
  route(); // reload the view with the new token
});
document.getElementById("token-clear").addEventListener("click", () => {
  setToken("");
  dialog.close();
  route();
});

window.addEventListener("hashchange", route);
route();
