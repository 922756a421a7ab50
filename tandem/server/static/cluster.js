// The cluster view: polls /v1/cluster about once a second and renders each rank, each link, the
// state and the tokens/s plot. Unmeasured figures arrive as null and are shown as "—".

import { api, AuthRequired } from "./api.js";
import { drawPlot } from "./plot.js";

const POLL_MS = 1000;
const DASH = "—";

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function lines(parts) {
  const td = document.createElement("td");
  for (const part of parts) {
    const div = document.createElement("div");
    div.textContent = part;
    td.append(div);
  }
  return td;
}

const range = (r) => `[${r[0]}, ${r[1]})`;
const pct = (x) => (x === null || x === undefined ? DASH : `${(100 * x).toFixed(1)} %`);

export function bytes(n) {
  if (n === null || n === undefined) return DASH;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function shardLines(s) {
  const out = [];
  const stage = s.stage !== null && s.n_stages > 1 ? `stage ${s.stage}/${s.n_stages} · ` : "";
  out.push(`${stage}layers ${range(s.layers)}`);
  if (s.tp_size > 1) {
    out.push(`tp ${s.tp_rank}/${s.tp_size} · kv heads ${range(s.kv_heads)} · q heads ${range(s.q_heads)}`);
    const rest = [`mlp rows ${range(s.mlp_rows)}`];
    if (s.vocab_rows) rest.push(`vocab ${range(s.vocab_rows)}`);
    out.push(rest.join(" · "));
  }
  return out;
}

// A mixture of experts' placement on one rank (`experts` in /v1/cluster; null for a dense model):
// the experts it holds and its rows of each (per group where the cut differs by expert), the bytes it reads per token (the expert part an
// expectation under whole experts) and the expert bytes it holds.
export function expertLines(x) {
  if (x === null || x === undefined) return [];
  const how = x.moe === "experts" ? "whole experts" : "rows of every expert";
  const g = x.expert_groups;
  const rows = g.length === 1
    ? `${g[0].rows[1] - g[0].rows[0]} rows of each`
    : g.map((p) => `rows ${range(p.rows)} of ${range(p.experts)}`).join(", ");
  return [
    `experts ${range(x.experts)} (${x.n_experts}) · ${rows} · ${how}`,
    `reads ${bytes(x.active_bytes_per_token)}/token · holds ${bytes(x.held_expert_bytes)} of experts`,
  ];
}

function rankRow(r) {
  const tr = document.createElement("tr");
  tr.dataset.rank = String(r.rank);
  tr.append(
    lines([`${r.rank}`, r.role]),
    lines([r.host, r.pid === null ? "" : `pid ${r.pid}`]),
    lines([r.device, r.dtype + (r.threads ? ` · ${r.threads} thr` : "")]),
    cell(r.weight_format || DASH),
    shardCell(r),
    cell(pct(r.work_share), "num"),
    cell(bytes(r.rss_bytes), "num"),
    cell(pct(r.wait_fraction), "num"),
  );
  tr.children[4].className = "shard";
  return tr;
}

function shardCell(r) {
  const td = lines(shardLines(r.shard));
  for (const text of expertLines(r.experts)) {
    const div = document.createElement("div");
    div.className = "experts";
    div.textContent = text;
    td.append(div);
  }
  return td;
}

function linkRow(l) {
  const tr = document.createElement("tr");
  tr.append(
    cell(`${l.a} ${l.kind === "stage" ? "→" : "↔"} ${l.b}`),
    cell(l.kind),
    cell(l.rtt_ms === null ? DASH : `${l.rtt_ms.toFixed(2)} ms`, "num"),
    cell(l.goodput_mbit_s === null ? DASH : `${l.goodput_mbit_s.toFixed(0)} Mbit/s`, "num"),
  );
  return tr;
}

export class ClusterPanel {
  constructor(els, onAuth) {
    this.els = els;
    this.onAuth = onAuth;
    this.latest = null;
    this.polling = false;
  }

  start() {
    if (this.polling) return;
    this.polling = true;
    this.tick();
  }

  async tick() {
    try {
      const resp = await api("/v1/cluster");
      this.latest = await resp.json();
      this.render(this.latest);
    } catch (err) {
      if (err instanceof AuthRequired) {
        this.polling = false;
        this.onAuth();
        return;
      }
      this.latest = null;
      this.setState("unreachable", `the server does not answer (${err.message})`);
    }
    setTimeout(() => this.tick(), POLL_MS);
  }

  setState(state, detail) {
    const badge = this.els.state;
    badge.textContent = state;
    badge.dataset.state = state;
    this.els.detail.textContent = detail;
  }

  render(v) {
    const e = this.els;
    this.setState(v.state, v.detail);
    const l = v.layout;
    e.layout.textContent =
      l.kind === "single" ? "one device" : `${l.kind} · tp=${l.tp} pp=${l.pp} · ${l.world_size} ranks`;
    e.tokensPerS.textContent = v.tokens_per_s === null ? DASH : v.tokens_per_s.toFixed(1);
    e.decodeMs.textContent = v.decode_ms_per_step === null ? DASH : `${v.decode_ms_per_step.toFixed(1)} ms`;
    e.load.textContent = `${v.running} / ${v.waiting}`;
    e.generated.textContent = String(v.generated_tokens);
    e.wire.textContent = bytes(v.wire_bytes);
    const pc = v.prefix_cache;
    e.prefixCache.textContent =
      pc === null || pc === undefined ? "off" : `${pc.hits} / ${pc.misses} · ${pc.reused_tokens} tokens reused · ${pc.copies ?? 0} copies · ${pc.held_blocks ?? 0} blocks · ${bytes(pc.cache_bytes ?? 0)} kept`;
    const waiting = emptyRow(8, "no rank is up yet");
    e.ranks.replaceChildren(...(v.ranks.length ? v.ranks.map(rankRow) : [waiting]));
    const none = l.world_size > 1 ? "not known yet" : "none: one rank";
    e.links.replaceChildren(...(v.links.length ? v.links.map(linkRow) : [emptyRow(4, none)]));
    drawPlot(e.plot, v.history, v.time);
  }
}

function emptyRow(span, text) {
  const tr = document.createElement("tr");
  const td = cell(text, "muted");
  td.colSpan = span;
  tr.append(td);
  return tr;
}
