// One sweep (#/sweeps/ID): its trials, best first, and their loss curves on one chart.
// The sweep and each trial's metrics are read every five seconds while the view is open.

import { api } from "./api.js";
import { dash, el, num, statusPill } from "./format.js";

const POLL_MS = 5000;
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];

function trialRows(sweep) {
  const sign = sweep.goal === "max" ? -1 : 1;
  const trials = [...sweep.trials].sort((a, b) =>
    (a.value === null) - (b.value === null) || sign * ((a.value ?? 0) - (b.value ?? 0)));
  const paths = Object.keys(sweep.space);
  return el("table", { class: "jobs sweep-trials" },
    el("thead", {}, el("tr", {}, ...["Trial", "Job", "Status", ...paths, sweep.metric, "Best"]
      .map((h) => el("th", { text: h })))),
    el("tbody", {}, ...trials.map((t) => el("tr", { "data-trial": String(t.number) },
      el("td", { class: "num", text: String(t.number) }),
      el("td", {}, el("a", { href: `#/jobs/${encodeURIComponent(t.job_id)}`, text: t.job_id })),
      el("td", {}, statusPill(t.status)),
      ...paths.map((p) => el("td", { class: "num mono", text: dash(t.params[p]) })),
      el("td", { class: "num", text: num(t.value) }),
      el("td", { class: "num", text: num(t.best) })))));
}

// Every trial's loss over its steps: one x axis (the union of steps), one series per trial.
function lossChart(node, sweep, curves) {
  const steps = [...new Set(curves.flatMap((c) => c.points.map((p) => p.step)))].sort((a, b) => a - b);
  const data = [steps, ...curves.map((c) => {
    const at = new Map(c.points.map((p) => [p.step, p.loss]));
    return steps.map((s) => (at.has(s) ? at.get(s) : null));
  })];
  const series = [{}, ...curves.map((c, i) => ({
    label: `trial ${c.number}`, stroke: COLORS[i % COLORS.length], spanGaps: true, width: 1.5,
  }))];
  const width = Math.max(320, Math.floor(node.clientWidth || 640));
  node.replaceChildren();
  return new window.uPlot({ width, height: 260, series, scales: { x: { time: false } } }, data, node);
}

export function mountSweep(view, state, sweepId) {
  const head = el("h2", { text: `Sweep ${sweepId}` });
  const summary = el("p", { class: "muted" });
  const chartNode = el("section", { class: "card chart sweep-chart", "data-chart": "sweep-loss" });
  const table = el("div");
  view.append(head, summary, chartNode, table);
  let stopped = false;
  let timer = 0;
  async function refresh() {
    try {
      const sweep = await api(`/v1/sweeps/${encodeURIComponent(sweepId)}`);
      const curves = await Promise.all(sweep.trials.map(async (t) => ({
        number: t.number,
        points: (await api(`/v1/jobs/${encodeURIComponent(t.job_id)}/metrics?max_points=300`)).points,
      })));
      if (stopped) return;
      const best = sweep.best_trial;
      summary.textContent = `${sweep.status} · ${sweep.method} · ${sweep.proposed}/${sweep.budget} trials`
        + ` · ${sweep.metric} ${sweep.goal}` + (best ? ` · best: trial ${best.number} (${num(best.value)})` : "");
      table.replaceChildren(trialRows(sweep));
      lossChart(chartNode, sweep, curves);
      state.sweep = { id: sweepId, trials: sweep.trials.length, series: curves.length };
      state.setConn("ok");
      if (sweep.status !== "running") return;
    } catch (err) {
      summary.textContent = err.message;
    }
    if (!stopped) timer = setTimeout(refresh, POLL_MS);
  }
  refresh();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
