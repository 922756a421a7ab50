// The chat: streams /v1/chat/completions (SSE read with fetch + ReadableStream). Text from the
// user and from the model is only ever inserted as text (textContent), never parsed as HTML.

import { api, ApiError, AuthRequired } from "./api.js";

function bubble(role, text) {
  const el = document.createElement("div");
  el.className = `message ${role}`;
  el.dataset.role = role;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  el.append(who, body);
  return el;
}

/** The collapsible block an answer's reasoning goes in (hidden until reasoning arrives). */
function reasoningBlock() {
  const block = document.createElement("details");
  block.className = "reasoning";
  block.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "Reasoning";
  const body = document.createElement("div");
  body.className = "reasoning-text";
  block.append(summary, body);
  return block;
}

/** Yields the parsed JSON of each `data:` event of an SSE body until `[DONE]`. */
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value.replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

export class Chat {
  /**
   * @param {object} els  the page's elements (messages, error, form, input, send, stop, clear,
   *                      temperature, maxTokens, stopStrings, systemPrompt)
   * @param {() => string} model         the served model's id
   * @param {() => object|null} cluster  the latest /v1/cluster document, or null
   * @param {() => void} onAuth          called when the server asks for a key
   */
  constructor(els, model, cluster, onAuth) {
    this.els = els;
    this.model = model;
    this.cluster = cluster;
    this.onAuth = onAuth;
    this.history = [];
    this.abort = null;
    els.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.send();
    });
    els.input.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) {
        e.preventDefault();
        this.send();
      }
    });
    els.stop.addEventListener("click", () => this.abort && this.abort.abort());
    els.clear.addEventListener("click", () => {
      this.history = [];
      els.messages.replaceChildren();
      this.showError("");
    });
  }

  showError(text) {
    this.els.error.textContent = text;
    this.els.error.hidden = !text;
  }

  request(messages) {
    const e = this.els;
    const body = { model: this.model(), messages, stream: true };
    const t = parseFloat(e.temperature.value);
    if (Number.isFinite(t)) body.temperature = t;
    const n = parseInt(e.maxTokens.value, 10);
    if (Number.isFinite(n)) body.max_tokens = n;
    const stop = e.stopStrings.value.split("\n").filter((s) => s.length > 0);
    if (stop.length) body.stop = stop;
    return body;
  }

  async send() {
    const e = this.els;
    const text = e.input.value;
    if (!text.trim() || this.abort) return;
    const view = this.cluster();
    if (view && view.state !== "whole") {
      this.showError(
        `The cluster is not whole (${view.state}): ${view.detail}. ` +
          "Requests cannot be served until every rank is up.",
      );
      return;
    }
    if (!this.model()) {
      this.showError("The server has named no model yet; try again in a moment.");
      return;
    }
    this.showError("");
    e.input.value = "";
    const system = e.systemPrompt.value.trim();
    const messages = [
      ...(system ? [{ role: "system", content: system }] : []),
      ...this.history,
      { role: "user", content: text },
    ];
    e.messages.append(bubble("user", text));
    const reply = bubble("assistant", "");
    const out = reply.querySelector(".text");
    // the server's reasoning_content apart from the answer: open while it streams, folded
    // once the answer starts
    const thought = reasoningBlock();
    const thoughtText = thought.querySelector(".reasoning-text");
    out.before(thought);
    reply.dataset.state = "streaming";
    reply.dataset.deltas = "0";
    e.messages.append(reply);
    this.abort = new AbortController();
    e.send.disabled = true;
    e.stop.disabled = false;
    let answer = "";
    let reasoning = "";
    try {
      const resp = await api("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(this.request(messages)),
        signal: this.abort.signal,
      });
      for await (const chunk of sseEvents(resp.body)) {
        if (chunk.error) throw new ApiError(503, chunk.error.message);
        for (const choice of chunk.choices || []) {
          const thinking = (choice.delta && choice.delta.reasoning_content) || "";
          if (thinking) {
            if (!reasoning) thought.open = true;
            reasoning += thinking;
            thoughtText.textContent = reasoning;
            thought.hidden = false;
          }
          const delta = (choice.delta && choice.delta.content) || "";
          if (delta) {
            if (!answer) thought.open = false;
            answer += delta;
            out.textContent = answer;
            reply.dataset.deltas = String(Number(reply.dataset.deltas) + 1);
            e.messages.scrollTop = e.messages.scrollHeight;
          }
          if (choice.finish_reason) reply.dataset.finish = choice.finish_reason;
        }
      }
      reply.dataset.state = "done";
      this.history.push({ role: "user", content: text }, { role: "assistant", content: answer });
    } catch (err) {
      reply.dataset.state = "error";
      if (err instanceof AuthRequired) {
        this.showError(`The server refused the API key: ${err.message}`);
        this.onAuth();
      } else if (err.name === "AbortError") {
        reply.dataset.state = "stopped";
        this.history.push({ role: "user", content: text }, { role: "assistant", content: answer });
      } else if (err instanceof ApiError && err.status === 503) {
        this.showError(`The cluster is not whole: ${err.message}`);
      } else {
        this.showError(`The request failed: ${err.message}`);
      }
    } finally {
      this.abort = null;
      e.send.disabled = false;
      e.stop.disabled = true;
    }
  }
}
