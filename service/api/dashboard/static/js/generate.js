// The job page's generate box: a prompt, a few sampling knobs, and the completion streamed
// from POST /v1/completions (Server-Sent Events read through fetch, as EventSource cannot
// POST or send the token). Text is added with textContent only: model output is not HTML.

import { authHeaders, authNeeded } from "./api.js";
import { el } from "./format.js";
import { parseSSE } from "./sse.js";

function field(label, input) {
  return el("label", { class: "gen-field" }, el("span", { text: label }), input);
}

export function generateBox(jobId, signal) {
  const prompt = el("textarea", { rows: 3, placeholder: "Prompt", class: "gen-prompt" });
  const maxTokens = el("input", { type: "number", min: 1, max: 4096, value: 64 });
  const temperature = el("input", { type: "number", min: 0, max: 2, step: 0.1, value: 0.8 });
  const seed = el("input", { type: "number", min: 0, placeholder: "random" });
  const run = el("button", { type: "button", text: "Generate" });
  const output = el("pre", { class: "gen-output" });
  const status = el("p", { class: "message", hidden: true });
  let current = null;

  function show(text, error = false) {
    status.hidden = !text;
    status.textContent = text || "";
    status.className = `message ${error ? "error" : ""}`;
  }

  async function generate() {
    if (current) current.abort();
    const controller = new AbortController();
    current = controller;
    signal.addEventListener("abort", () => controller.abort(), { once: true });
    const body = {
      model: jobId,
      prompt: prompt.value,
      max_tokens: Number(maxTokens.value) || 64,
      temperature: Number(temperature.value),
      stream: true,
    };
    if (seed.value !== "") body.seed = Number(seed.value);
    output.textContent = "";
    show("Generating…");
    run.disabled = true;
    const t0 = performance.now();
    let first = null;
    try {
      const res = await fetch("/v1/completions", {
        method: "POST",
        headers: authHeaders({ "Content-Type": "application/json", Accept: "text/event-stream" }),
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (res.status === 401) authNeeded(401);
      if (!res.ok) {
        const err = await res.json().catch(() => ({}));
        // /v1/completions answers errors in OpenAI's shape, {"error": {"message", "param"}}
        const text = (err.error && err.error.message) || `HTTP ${res.status}`;
        show(text, true);
        return;
      }
      let info = "";
      let failed = false;
      for await (const ev of parseSSE(res.body)) {
        if (ev.type !== "message" || ev.data === "[DONE]") continue;
        const chunk = JSON.parse(ev.data);
        if (chunk.error) {
          show(chunk.error.message, true);
          failed = true;
          continue;
        }
        for (const c of chunk.choices || []) {
          if (c.index !== 0 || !c.text) continue;
          if (first === null) first = performance.now() - t0;
          output.textContent += c.text;
        }
        if (chunk.trainq) {
          const t = chunk.trainq;
          info = `step ${t.step} · ${t.cached ? "model was loaded" : `loaded in ${t.load_s} s`}`
            + (first !== null ? ` · first token ${Math.round(first)} ms` : "");
        }
      }
      if (!failed) show(info);
    } catch (e) {
      if (e.name !== "AbortError") show(String(e.message || e), true);
    } finally {
      run.disabled = false;
      if (current === controller) current = null;
    }
  }

  run.addEventListener("click", generate);
  return el("section", { class: "card generate" }, el("h2", { text: "Generate" }),
    prompt,
    el("div", { class: "gen-controls" }, field("Max tokens", maxTokens),
      field("Temperature", temperature), field("Seed", seed), run),
    status, output);
}
