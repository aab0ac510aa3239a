// Server-Sent Events over fetch(), so the Bearer header can be sent (EventSource cannot).
//
// parseSSE() follows the WHATWG event-stream rules (fields, comments, CR/LF/CRLF line ends,
// multi-line data). follow() reconnects after a dropped connection and sends the last seen
// id as Last-Event-ID, as EventSource would; the service resumes right after that entry,
// so nothing is delivered twice.

import { authHeaders, authNeeded } from "./api.js";

export async function* parseSSE(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data = [];
  let type = "";
  let id = null; // last event id buffer; null = no id field seen in this event
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      // A lone CR at the end may be the first half of a CRLF: keep it for the next chunk.
      const lines = buffer.split(/\r\n|\n|\r(?!$)/);
      buffer = lines.pop();
      for (const line of lines) {
        if (line === "") {
          if (data.length) yield { type: type || "message", data: data.join("\n"), id };
          data = [];
          type = "";
          id = null;
          continue;
        }
        if (line.startsWith(":")) continue; // comment: keep-alive ping
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? "" : line.slice(colon + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (field === "data") data.push(val);
        else if (field === "event") type = val;
        else if (field === "id" && !val.includes("\0")) id = val;
        else if (field === "retry" && /^\d+$/.test(val)) yield { type: "__retry", data: val, id };
      }
    }
  } finally {
    reader.releaseLock();
  }
}

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => {
      clearTimeout(timer);
      resolve();
    });
  });
}

// Follow `path` until onEvent returns "done", the server says the stream is over (204), or
// `signal` aborts. `stats` is updated in place so tests and the page can watch it.
// stats.drop() aborts only the current connection, to exercise the resume path.
export async function follow(path, onEvent, { signal, onState = () => {}, stats = {} } = {}) {
  let retryMs = 1000;
  Object.assign(stats, { connects: 0, events: 0, lastEventId: null });
  while (!signal.aborted) {
    const conn = new AbortController();
    const abortConn = () => conn.abort();
    signal.addEventListener("abort", abortConn);
    stats.drop = abortConn;
    try {
      const headers = authHeaders({ Accept: "text/event-stream" });
      if (stats.lastEventId) headers.set("Last-Event-ID", stats.lastEventId);
      const res = await fetch(path, { headers, signal: conn.signal, cache: "no-store" });
      if (res.status === 401 || res.status === 403) {
        authNeeded(res.status);
        onState("auth");
        return;
      }
      if (res.status === 204 || res.status === 404) {
        onState("closed");
        return;
      }
      if (!res.ok) throw new Error(`${res.status}`);
      stats.connects += 1;
      onState("open");
      for await (const ev of parseSSE(res.body)) {
        if (ev.type === "__retry") {
          retryMs = Number(ev.data);
          continue;
        }
        if (ev.id !== null) stats.lastEventId = ev.id;
        stats.events += 1;
        if (onEvent(ev) === "done") {
          onState("closed");
          return;
        }
      }
    } catch (err) {
      if (signal.aborted) return;
      // A network error or a dropped connection: fall through to reconnect.
    } finally {
      signal.removeEventListener("abort", abortConn);
    }
    if (signal.aborted) return;
    onState("reconnecting");
    await sleep(retryMs, signal);
  }
}
