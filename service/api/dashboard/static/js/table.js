// A polled table view: a heading with a footer line, a table whose rows are redrawn from one
// GET every few seconds while the view is open, and the connection state it reports. The jobs
// and datasets views are this with their own columns and rows.

import { api } from "./api.js";
import { el } from "./format.js";

// opts: key (state[key] holds polls, error and the listed ids), title, className, columns,
// numeric (a Set of columns), url, pollMs, row (item -> tr), empty (text with no items),
// noun (singular), idsKey and idOf (item -> id), note (page -> extra footer text).
export function mountPolledTable(view, state, opts) {
  const tbody = el("tbody");
  const footer = el("p", { class: "muted small" });
  const table = el("table", { class: `grid ${opts.className}` },
    el("thead", {}, el("tr", {}, opts.columns.map((c) =>
      el("th", { class: opts.numeric.has(c) ? "num" : null, text: c })))), tbody);
  view.append(
    el("div", { class: "view-head" }, el("h1", { text: opts.title }), footer),
    el("section", { class: "card flush" }, table),
  );
  const mine = { polls: 0, [opts.idsKey]: [], error: null };
  state[opts.key] = mine;
  let timer = 0;
  let stopped = false;
  const controller = new AbortController();

  async function poll() {
    try {
      const page = await api(opts.url, { signal: controller.signal });
      const items = page.items || [];
      tbody.replaceChildren(...items.map(opts.row));
      if (!items.length) {
        tbody.append(el("tr", {}, el("td", { colspan: opts.columns.length, class: "empty",
          text: opts.empty })));
      }
      mine[opts.idsKey] = items.map(opts.idOf);
      mine.error = null;
      footer.textContent = `${items.length} ${opts.noun}${items.length === 1 ? "" : "s"}` +
        `${opts.note ? opts.note(page) : ""} · updated ${new Date().toLocaleTimeString()}`;
      state.setConn("ok");
    } catch (err) {
      if (stopped) return;
      mine.error = err.message;
      footer.textContent = `Could not load ${opts.noun}s: ${err.message}`;
      state.setConn(err.status === 401 ? "auth" : "error");
    } finally {
      mine.polls += 1;
      if (!stopped) timer = setTimeout(poll, opts.pollMs);
    }
  }
  poll();
  return () => {
    stopped = true;
    clearTimeout(timer);
    controller.abort();
  };
}
