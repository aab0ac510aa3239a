// Metric points keyed by step, and the uPlot charts that draw them.
//
// Points are keyed by step, so the downsampled history, the live stream and a resumed
// stream can overlap without drawing a point twice; a retried attempt that resumes from a
// checkpoint overwrites the steps it repeats. uPlot is vendored (static/vendor/uplot).

import { el, num, si } from "./format.js";

const FIELDS = [
  "loss", "val_loss", "lr", "tokens_per_s", "mfu", "grad_norm",
  // family moe: the router's balance (trainer/moe.py)
  "aux_loss", "expert_load_max", "expert_load_cv",
];

export class MetricStore {
  // Past maxPoints the older half is thinned, so a long live session stays light.
  constructor(maxPoints = 6000) {
    this.maxPoints = maxPoints;
    this.byStep = new Map();
    this.steps = []; // sorted
    this.version = 0;
    this.seen = new Set(); // the fields any point has had a number for
  }

  get size() {
    return this.steps.length;
  }

  add(point) {
    this.addMany([point]);
  }

  // Bulk insert (the history) sorts once, not once per point.
  addMany(points) {
    let unsorted = false;
    for (const point of points) {
      const step = Number(point.step);
      if (!Number.isFinite(step)) continue;
      const old = this.byStep.get(step);
      const merged = old ? { ...old } : { step };
      for (const f of FIELDS) {
        // A metric event without val_loss must not erase a val_loss seen for that step.
        if (point[f] !== undefined && (point[f] !== null || !old)) merged[f] = point[f];
        if (point[f] != null) this.seen.add(f);
      }
      this.byStep.set(step, merged);
      if (!old) {
        const n = this.steps.length;
        if (n && step < this.steps[n - 1]) unsorted = true;
        this.steps.push(step);
      }
    }
    if (unsorted) this.steps.sort((a, b) => a - b);
    this.version += 1;
    if (this.steps.length > this.maxPoints) this.thin();
  }

  // Drop every other point in the older half, keeping eval points (val_loss is sparse).
  thin() {
    const half = Math.floor(this.steps.length / 2);
    const kept = [];
    this.steps.forEach((step, i) => {
      const keep = i >= half || i % 2 === 0 || this.byStep.get(step).val_loss != null;
      if (keep) kept.push(step);
      else this.byStep.delete(step);
    });
    this.steps = kept;
  }

  columns(fields) {
    const cols = [Float64Array.from(this.steps)];
    for (const f of fields) {
      cols.push(this.steps.map((s) => {
        const v = this.byStep.get(s)[f];
        return v === undefined ? null : v;
      }));
    }
    return cols;
  }

  // The newest point, with each field taken from the newest point that has it (val_loss
  // is only reported on eval steps).
  latest() {
    if (!this.steps.length) return null;
    const out = { ...this.byStep.get(this.steps[this.steps.length - 1]) };
    for (let i = this.steps.length - 1; i >= 0 && out.val_loss == null; i -= 1) {
      out.val_loss = this.byStep.get(this.steps[i]).val_loss;
    }
    return out;
  }
}

export const PANELS = [
  {
    key: "loss",
    title: "Loss",
    series: [
      { field: "loss", label: "loss", stroke: "#2563eb" },
      { field: "val_loss", label: "val_loss", stroke: "#ea580c", sparse: true },
    ],
    fmt: (v) => num(v, 4),
  },
  {
    key: "throughput",
    title: "Tokens/s",
    series: [{ field: "tokens_per_s", label: "tokens/s", stroke: "#059669" }],
    fmt: si,
  },
  {
    key: "lr",
    title: "Learning rate",
    series: [{ field: "lr", label: "lr", stroke: "#7c3aed" }],
    fmt: (v) => num(v, 3),
  },
  {
    // A collapsing router shows here while the job runs: the busiest expert's share of
    // the tokens climbs towards 1/top_k and the spread (cv) grows. Only for jobs that
    // report it (family moe).
    key: "experts",
    title: "Experts: load and aux loss",
    optional: "expert_load_max",
    series: [
      { field: "expert_load_max", label: "busiest share", stroke: "#dc2626" },
      { field: "expert_load_cv", label: "load cv", stroke: "#d97706" },
      { field: "aux_loss", label: "aux loss", stroke: "#0891b2" },
    ],
    fmt: (v) => num(v, 3),
  },
];

function chartOptions(panel, width) {
  return {
    width,
    height: 200,
    scales: { x: { time: false } },
    legend: { live: true },
    cursor: { drag: { x: true, y: false } },
    series: [
      { label: "step", value: (u, v) => (v == null ? "–" : String(v)) },
      ...panel.series.map((s) => ({
        label: s.label,
        stroke: s.stroke,
        width: 1.5,
        spanGaps: Boolean(s.sparse),
        points: { show: Boolean(s.sparse), size: 5, fill: s.stroke },
        value: (u, v) => panel.fmt(v),
      })),
    ],
    axes: [
      { stroke: "#6b7280", grid: { stroke: "#eef0f3" }, ticks: { stroke: "#e5e7eb" } },
      {
        stroke: "#6b7280",
        size: 64,
        grid: { stroke: "#eef0f3" },
        ticks: { stroke: "#e5e7eb" },
        values: (u, vals) => vals.map((v) => panel.fmt(v)),
      },
    ],
  };
}

// A grid of uPlot charts over one MetricStore; redraws at most once per animation frame.
export class ChartGrid {
  constructor(container, store) {
    this.store = store;
    this.charts = new Map();
    this.drawnVersion = -1;
    this.frame = 0;
    this.renderMs = 0;
    this.onDraw = () => {};
    this.node = el("div", { class: "charts" });
    container.append(this.node);
    for (const panel of PANELS) {
      const body = el("div", { class: "chart-body" });
      const empty = el("div", { class: "chart-empty", text: "no points yet" });
      const section = el("section", { class: "card chart", "data-chart": panel.key },
        el("h3", { text: panel.title }), body, empty);
      section.hidden = Boolean(panel.optional);
      this.node.append(section);
      const chart = new window.uPlot(chartOptions(panel, this.widthOf(body)),
        this.store.columns(panel.series.map((s) => s.field)), body);
      this.charts.set(panel.key, { panel, chart, body, empty, section });
    }
    this.resize = new ResizeObserver(() => {
      for (const { chart, body } of this.charts.values()) {
        chart.setSize({ width: this.widthOf(body), height: 200 });
      }
    });
    this.resize.observe(this.node);
  }

  widthOf(body) {
    return Math.max(240, Math.floor(body.clientWidth || 400));
  }

  schedule() {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = 0;
      this.draw();
    });
  }

  draw() {
    if (this.drawnVersion === this.store.version) return;
    const t0 = performance.now();
    for (const { panel, chart, empty, section } of this.charts.values()) {
      if (panel.optional) section.hidden = !this.store.seen.has(panel.optional);
      chart.setData(this.store.columns(panel.series.map((s) => s.field)));
      empty.hidden = this.store.size > 0;
    }
    this.renderMs = performance.now() - t0;
    this.drawnVersion = this.store.version;
    this.onDraw();
  }

  // What each chart holds right now (x values), for tests and the bench.
  pointCounts() {
    const out = {};
    for (const [key, { chart }] of this.charts) out[key] = chart.data[0].length;
    return out;
  }

  destroy() {
    cancelAnimationFrame(this.frame);
    this.resize.disconnect();
    for (const { chart } of this.charts.values()) chart.destroy();
    this.node.remove();
  }
}
