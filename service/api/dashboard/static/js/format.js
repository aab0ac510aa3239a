// Small display helpers shared by the views.

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    // Through the CSSOM, not the style attribute, which the page's CSP forbids.
    else if (key === "style") Object.assign(node.style, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const DASH = "–";

export function num(value, digits = 4) {
  if (value === null || value === undefined || !Number.isFinite(value)) return DASH;
  if (value !== 0 && (Math.abs(value) < 1e-3 || Math.abs(value) >= 1e6)) {
    return value.toExponential(2);
  }
  return Number(value.toPrecision(digits)).toString();
}

// 1234567 -> "1.23M": throughput reads better with a unit than with eight digits.
export function si(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return DASH;
  const abs = Math.abs(value);
  if (abs === 0) return "0";
  for (const [scale, unit] of [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (abs >= scale) return `${(value / scale).toPrecision(3)}${unit}`;
  }
  return value.toPrecision(3);
}

export function percent(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return DASH;
  return `${(value * 100).toFixed(1)}%`;
}

export function parseTime(value) {
  if (value === null || value === undefined) return null;
  if (typeof value === "number") return value > 1e11 ? value : value * 1000; // s or ms
  const t = Date.parse(value);
  return Number.isNaN(t) ? null : t;
}

export function duration(ms) {
  if (ms === null || !Number.isFinite(ms)) return DASH;
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${s % 60}s`;
  const h = Math.floor(m / 60);
  if (h < 48) return `${h}h ${m % 60}m`;
  return `${Math.floor(h / 24)}d ${h % 24}h`;
}

export function age(value) {
  const t = parseTime(value);
  return t === null ? DASH : duration(Date.now() - t);
}

export function clock(value) {
  const t = parseTime(value);
  if (t === null) return DASH;
  return new Date(t).toLocaleString(undefined, {
    month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", second: "2-digit",
  });
}

export const TERMINAL = new Set(["succeeded", "failed", "cancelled", "stopped_early"]);

// `tone` picks the colour when the status alone does not say how it went (an exited attempt).
export function statusPill(status, reason, tone = status) {
  return el(
    "span",
    { class: `pill status-${tone || "unknown"}`, "data-status": status || "" },
    status || "unknown",
    reason && reason !== status ? el("span", { class: "pill-reason", text: reason.replaceAll("_", " ") }) : null,
  );
}

export function dash(value) {
  return value === null || value === undefined || value === "" ? DASH : String(value);
}
