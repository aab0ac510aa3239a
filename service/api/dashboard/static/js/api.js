// The REST API client: one fetch wrapper that adds the Bearer token kept in localStorage.
//
// EventSource cannot send headers, so streams also go through fetch() (see sse.js) and use
// authHeaders() from here.

const TOKEN_KEY = "trainq.token";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function getToken() {
  return localStorage.getItem(TOKEN_KEY) || "";
}

export function setToken(token) {
  if (token) localStorage.setItem(TOKEN_KEY, token);
  else localStorage.removeItem(TOKEN_KEY);
}

// Listeners for "the server wants a (different) token"; the page opens the token dialog.
const authListeners = new Set();
export function onAuthNeeded(fn) {
  authListeners.add(fn);
}
export function authNeeded(status) {
  for (const fn of authListeners) fn(status);
}

export function authHeaders(extra = {}) {
  const headers = new Headers(extra);
  const token = getToken();
  if (token) headers.set("Authorization", `Bearer ${token}`);
  return headers;
}

// FastAPI puts the reason in {"detail": str | [{loc, msg}]}; show one readable line.
function errorText(body, fallback) {
  const detail = body && body.detail;
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail) && detail.length) {
    return detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("; ");
  }
  if (body && typeof body.message === "string") return body.message;
  return fallback;
}

export async function api(path, { method = "GET", body, signal } = {}) {
  const headers = authHeaders({ Accept: "application/json" });
  const init = { method, headers, signal, cache: "no-store" };
  if (body !== undefined) {
    headers.set("Content-Type", "application/json");
    init.body = JSON.stringify(body);
  }
  const res = await fetch(path, init);
  if (res.status === 401) authNeeded(401);
  if (!res.ok) {
    const parsed = await res.json().catch(() => null);
    throw new ApiError(res.status, errorText(parsed, `${res.status} ${res.statusText}`));
  }
  if (res.status === 204) return null;
  return res.json();
}
