// pdserve's live dashboard: polls the gateway's /metrics (Prometheus text) and /health every 2 s and
// draws the last 5 minutes. No build step, nothing loaded from elsewhere: this file and the page.
"use strict";

const POLL_MS = 2000, KEEP_S = 300, WINDOW_S = 10;  // rates and quantiles over the last WINDOW_S seconds
const history = [];  // {t, samples: Map("name{labels}" -> value)}

// The metrics the panels read (tests check that the gateway exports each one).
const M = {
  ttft: "pdserve_time_to_first_token_seconds_bucket",
  itl: "pdserve_inter_token_latency_seconds_bucket",
  kvTransfer: "pdserve_kv_transfer_seconds_bucket",
  running: "pdserve_requests_running",
  waiting: "pdserve_requests_waiting",
  blocks: "pdserve_kv_blocks_in_use",
  prefixQueries: "pdserve_prefix_cache_queries_total",
  prefixHits: "pdserve_prefix_cache_hits_total",
  // tokens as they stream: every token after a choice's first is one ITL observation, every first
  // token one TTFT observation (the generation-token counter moves only when a request ends)
  itlCount: "pdserve_inter_token_latency_seconds_count",
  ttftCount: "pdserve_time_to_first_token_seconds_count",
  prefillCore: "pdserve_prefill_core_seconds_total",
  decodeCore: "pdserve_decode_core_seconds_total",
  cost: "pdserve_cost_total",
  requests: "pdserve_requests_total",
  migrations: "pdserve_migrations_total",
  busy: "pdserve_engine_busy_seconds_total",
};

function parse(text) {
  const out = new Map();
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)/);
    if (m) out.set(m[1] + (m[2] || ""), parseFloat(m[3]));
  }
  return out;
}

function labels(key) {
  const out = {};
  const body = key.includes("{") ? key.slice(key.indexOf("{") + 1, -1) : "";
  for (const m of body.matchAll(/([a-zA-Z_]+)="((?:[^"\\]|\\.)*)"/g)) out[m[1]] = m[2];
  return out;
}

function series(samples, name) {  // [{labels, value}] of one metric
  const out = [];
  for (const [key, value] of samples) {
    const base = key.includes("{") ? key.slice(0, key.indexOf("{")) : key;
    if (base === name) out.push({ labels: labels(key), value });
  }
  return out;
}

function sum(samples, name, filter = () => true) {
  return series(samples, name).filter(s => filter(s.labels)).reduce((a, s) => a + s.value, 0);
}

function past(seconds) {  // the snapshot closest to `seconds` ago (the oldest one we have otherwise)
  const target = history[history.length - 1].t - seconds;
  for (const h of history) if (h.t >= target) return h;
  return history[0];
}

function rate(name, filter) {
  if (history.length < 2) return 0;
  const now = history[history.length - 1], then = past(WINDOW_S);
  const dt = now.t - then.t;
  return dt > 0 ? Math.max(0, sum(now.samples, name, filter) - sum(then.samples, name, filter)) / dt : 0;
}

function quantile(q, bucketName) {  // from the histogram's bucket increase over the window
  if (history.length < 2) return null;
  const now = history[history.length - 1], then = past(WINDOW_S);
  const le = new Map();
  for (const s of series(now.samples, bucketName)) le.set(s.labels.le, (le.get(s.labels.le) || 0) + s.value);
  for (const s of series(then.samples, bucketName)) le.set(s.labels.le, (le.get(s.labels.le) || 0) - s.value);
  const buckets = [...le].map(([b, c]) => [b === "+Inf" ? Infinity : parseFloat(b), c]).sort((a, b) => a[0] - b[0]);
  const total = buckets.length ? buckets[buckets.length - 1][1] : 0;
  if (total <= 0) return null;
  let prevBound = 0, prevCount = 0;
  for (const [bound, count] of buckets) {
    if (count >= q * total) {
      if (bound === Infinity) return prevBound;
      return prevBound + (bound - prevBound) * (q * total - prevCount) / Math.max(count - prevCount, 1e-9);
    }
    prevBound = bound; prevCount = count;
  }
  return prevBound;
}

function byInstance(name, filter = () => true) {  // {"service/instance": value} of the latest snapshot
  const out = {};
  for (const s of series(history[history.length - 1].samples, name)) {
    if (filter(s.labels)) out[`${s.labels.service}/${s.labels.instance}`] = s.value;
  }
  return out;
}

function rateByInstance(name) {
  if (history.length < 2) return {};
  const now = history[history.length - 1], then = past(WINDOW_S), dt = now.t - then.t, out = {};
  for (const s of series(now.samples, name)) {
    const key = `${s.labels.service}/${s.labels.instance}`;
    const before = series(then.samples, name).find(b => b.labels.service === s.labels.service &&
                                                       b.labels.instance === s.labels.instance);
    out[key] = dt > 0 && before ? Math.max(0, s.value - before.value) / dt : 0;
  }
  return out;
}

// Panels: each returns {name: value} at every poll; the chart keeps their history.
const PANELS = [
  { title: "TTFT (ms)", values: () => ({ p50: ms(quantile(0.5, M.ttft)), p90: ms(quantile(0.9, M.ttft)),
                                          p99: ms(quantile(0.99, M.ttft)) }) },
  { title: "ITL (ms)", values: () => ({ p50: ms(quantile(0.5, M.itl)), p99: ms(quantile(0.99, M.itl)) }) },
  { title: "Output tokens / s", values: () => ({ "tok/s": rate(M.itlCount) + rate(M.ttftCount) }) },
  { title: "Requests running (per instance)", values: () => byInstance(M.running) },
  { title: "Requests waiting (per instance)", values: () => byInstance(M.waiting) },
  { title: "KV blocks in use (per instance)", values: () => byInstance(M.blocks) },
  { title: "Prefix-cache hit rate (per instance)", values: () => {
      const q = rateByInstance(M.prefixQueries), h = rateByInstance(M.prefixHits), out = {};
      for (const k in q) if (q[k] > 0) out[k] = h[k] / q[k];
      return out; } },
  { title: "Engine busy fraction (per worker)", values: () => rateByInstance(M.busy) },
  { title: "Compute per phase (core-seconds / s)", values: () => ({ prefill: rate(M.prefillCore),
                                                                    decode: rate(M.decodeCore) }) },
  { title: "Cost per phase (per s, --price)", values: () => ({
      prefill: rate(M.cost, l => l.phase === "prefill"), decode: rate(M.cost, l => l.phase === "decode"),
      kv_transfer: rate(M.cost, l => l.phase === "kv_transfer") }) },
  { title: "KV transfer p90 (ms)", values: () => ({ p90: ms(quantile(0.9, M.kvTransfer)) }) },
  { title: "Migrations and errors (per s)", values: () => ({
      migrations: rate(M.migrations), errors: rate(M.requests, l => l.status === "error"),
      timeouts: rate(M.requests, l => l.status === "timeout"), rejected: rate(M.requests, l => l.status === "rejected") }) },
];

function ms(seconds) { return seconds === null ? null : seconds * 1000; }

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

function setup() {
  const grid = document.getElementById("grid");
  for (const p of PANELS) {
    const div = document.createElement("div");
    div.className = "panel";
    div.innerHTML = `<h2></h2><div class="now"></div><canvas></canvas>`;
    div.querySelector("h2").textContent = p.title;
    grid.appendChild(div);
    p.now = div.querySelector(".now");
    p.canvas = div.querySelector("canvas");
    p.points = [];  // {t, values}
  }
}

function draw(p) {
  const c = p.canvas, dpr = window.devicePixelRatio || 1;
  c.width = c.clientWidth * dpr; c.height = c.clientHeight * dpr;
  const g = c.getContext("2d");
  g.scale(dpr, dpr);
  const w = c.clientWidth, h = c.clientHeight, pad = 28;
  g.clearRect(0, 0, w, h);
  const names = [...new Set(p.points.flatMap(pt => Object.keys(pt.values)))].sort();
  let max = 0;
  for (const pt of p.points) for (const v of Object.values(pt.values)) if (v !== null && isFinite(v)) max = Math.max(max, v);
  max = max > 0 ? max * 1.1 : 1;
  const t1 = p.points.length ? p.points[p.points.length - 1].t : 0, t0 = t1 - KEEP_S;
  g.strokeStyle = "#ccc"; g.fillStyle = "#777"; g.font = "10px system-ui";
  g.beginPath(); g.moveTo(pad, 4); g.lineTo(pad, h - 14); g.lineTo(w - 4, h - 14); g.stroke();
  g.fillText(fmt(max), 2, 12); g.fillText("0", 2, h - 14); g.fillText(`-${KEEP_S / 60} min`, pad, h - 2);
  names.forEach((name, i) => {
    g.strokeStyle = COLORS[i % COLORS.length]; g.beginPath();
    let started = false;
    for (const pt of p.points) {
      const v = pt.values[name];
      if (v === null || v === undefined || !isFinite(v)) { started = false; continue; }
      const x = pad + (w - pad - 4) * (pt.t - t0) / KEEP_S, y = (h - 14) - (h - 18) * v / max;
      if (started) g.lineTo(x, y); else { g.moveTo(x, y); started = true; }
    }
    g.stroke();
  });
  const last = p.points.length ? p.points[p.points.length - 1].values : {};
  p.now.innerHTML = names.map((n, i) => `<span style="color:${COLORS[i % COLORS.length]}">${escape(n)}</span> ` +
                                        `${fmt(last[n])}`).join(" &nbsp; ") || "no data yet";
}

function fmt(v) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  if (Math.abs(v) >= 100) return v.toFixed(0);
  if (Math.abs(v) >= 1) return v.toFixed(1);
  return v.toPrecision(2);
}

function escape(s) { return s.replace(/[&<>"]/g, ch => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[ch]); }

async function poll() {
  const status = document.getElementById("status");
  try {
    const [metrics, health] = await Promise.all([fetch("/metrics"), fetch("/health")]);
    const t = Date.now() / 1000;
    history.push({ t, samples: parse(await metrics.text()) });
    while (history.length > 2 && history[0].t < t - KEEP_S - WINDOW_S) history.shift();
    const hj = await health.json().catch(() => ({}));
    status.className = health.ok ? "" : "error";
    status.textContent = health.ok
      ? `${hj.model} · ${hj.mode} · workers ${JSON.stringify(hj.workers)} · in flight ${hj.requests_in_flight}`
      : `health: ${hj.error ? hj.error.message : health.status}`;
    for (const p of PANELS) {
      p.points.push({ t, values: p.values() });
      while (p.points.length && p.points[0].t < t - KEEP_S) p.points.shift();
      draw(p);
    }
  } catch (err) {
    status.className = "error";
    status.textContent = `cannot reach the gateway: ${err}`;
  }
}

setup();
poll();
setInterval(poll, POLL_MS);
