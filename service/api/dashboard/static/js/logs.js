// The logs pane: log events from the job's SSE stream, which replays its last events
// (job.js STREAM_TAIL: the last lines of the run) and then follows.

import { el } from "./format.js";

const MAX_LINES = 5000; // DOM rows kept; older ones are dropped from the pane

export class LogPane {
  constructor() {
    this.pre = el("pre", { class: "logs", "aria-live": "off" });
    this.follow = el("input", { type: "checkbox", checked: true });
    this.count = 0;
    this.node = el("section", { class: "card" },
      el("div", { class: "card-head" }, el("h2", { text: "Logs" }),
        el("label", { class: "small muted" }, this.follow, " follow")),
      this.pre);
  }

  // The tag the text log (GET /v1/jobs/{id}/logs) gives a line: attempt, node, rank.
  lineNode({ rank, node, stream, line }, attempt) {
    let who = rank === null || rank === undefined ? "worker" : `rank ${rank}`;
    if (node !== null && node !== undefined) who = `node ${node} ${who}`;
    if (attempt !== null && attempt !== undefined) who = `a${attempt} ${who}`;
    return el("div", { class: stream === "stderr" ? "stderr" : "" }, `[${who}] ${line}`);
  }

  append(lines, attempt) {
    const atBottom = this.pre.scrollHeight - this.pre.scrollTop - this.pre.clientHeight < 24;
    this.pre.append(...lines.map((l) => this.lineNode(l, attempt)));
    this.after(lines.length, atBottom);
  }

  after(added, atBottom = true) {
    this.count += added;
    while (this.count > MAX_LINES) {
      this.pre.firstChild.remove();
      this.count -= 1;
    }
    if (this.follow.checked && atBottom) this.pre.scrollTop = this.pre.scrollHeight;
  }
}
