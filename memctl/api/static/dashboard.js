// memctl dashboard: polls the JSON API of the same server (relative URLs, nothing external)
// and draws inline SVG / canvas charts. Every number shown carries its exact value in
// data-value, so what the page shows can be checked against /v1/stats.
"use strict";

const POLL_MS = 1000;
const MAX_STEPS = 240;          // steps kept for the activation chart and the heat map
const COLORS = { raw: "#8a94a6", packed: "#2f6fdf", budget: "#d9534f", used: "#2a9d6a", total: "#5d6677" };
const SVG = "http://www.w3.org/2000/svg";  // a namespace name, not a download

const byStep = new Map();       // step -> {raw, packed, activationBudget, bits: {layer: bits}}
const $ = (id) => document.getElementById(id);
const tokenRequired = document.body.dataset.tokenRequired === "true";

function formatBytes(n) {
  if (n === null || n === undefined) return "none";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(n), i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i === 0 ? v.toFixed(0) : v.toFixed(2)) + " " + units[i];
}

function show(id, value, text) {
  const el = $(id);
  el.dataset.value = value === null || value === undefined ? "" : String(value);
  el.textContent = text;
}

function authHeaders(headers) {
  // The token field also serves reads, for a server whose reads need the token (token_for_reads).
  const token = $("token-input").value.trim();
  if (token) headers.Authorization = "Bearer " + token;
  return headers;
}

async function getJSON(path) {
  const r = await fetch(path, { cache: "no-store", headers: authHeaders({ Accept: "application/json" }) });
  if (!r.ok) throw new Error(path + " answered " + r.status);
  return r.json();
}

function el(name, attrs, text) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "color") node.style.fill = v;  // CSSOM, allowed by the page's CSP (style attributes are not)
    else node.setAttribute(k, v);
  }
  if (text !== undefined) node.textContent = text;
  return node;
}

// A line chart: series [{name, color, points: [[x, y], ...]}], horizontal lines [{y, name, color}].
function lineChart(svg, series, hlines, yFormat, xLabel) {
  svg.replaceChildren();
  const W = 640, H = 220, L = 70, R = 10, T = 10, B = 36;
  const xs = series.flatMap((s) => s.points.map((p) => p[0]));
  const ys = series.flatMap((s) => s.points.map((p) => p[1])).concat(hlines.map((h) => h.y));
  if (!xs.length) { svg.append(el("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "waiting for data")); return; }
  const x0 = Math.min(...xs), x1 = Math.max(...xs) === x0 ? x0 + 1 : Math.max(...xs);
  const y1 = Math.max(...ys, 1) * 1.05;
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = (y) => T + (1 - y / y1) * (H - T - B);
  svg.append(el("line", { class: "axis", x1: L, y1: sy(0), x2: W - R, y2: sy(0) }));
  svg.append(el("line", { class: "axis", x1: L, y1: T, x2: L, y2: sy(0) }));
  for (const f of [0, 0.5, 1]) svg.append(el("text", { x: L - 4, y: sy(f * y1) + 4, "text-anchor": "end" }, yFormat(f * y1)));
  svg.append(el("text", { x: L, y: H - 18 }, String(Math.round(x0))));
  svg.append(el("text", { x: W - R, y: H - 18, "text-anchor": "end" }, String(Math.round(x1))));
  svg.append(el("text", { x: (L + W) / 2, y: H - 4, "text-anchor": "middle" }, xLabel));
  for (const h of hlines) {
    svg.append(el("line", { x1: L, x2: W - R, y1: sy(h.y), y2: sy(h.y), stroke: h.color, "stroke-dasharray": "5 4",
                            "data-series": h.name, "data-value": String(h.y) }));
    svg.append(el("text", { x: W - R - 4, y: sy(h.y) - 4, "text-anchor": "end", color: h.color }, h.name));
  }
  let legendX = L + 8;
  for (const s of series) {
    const d = s.points.map((p, i) => (i ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1)).join(" ");
    svg.append(el("path", { d, fill: "none", stroke: s.color, "stroke-width": 2, "data-series": s.name }));
    svg.append(el("text", { x: legendX, y: T + 12, color: s.color }, s.name));
    legendX += 12 + 7 * s.name.length;
  }
}

function bitsChart(svg, layers) {
  svg.replaceChildren();
  const W = 640, rowH = 18, L = 170;
  const shown = layers.filter((l) => l.bits !== null && l.bits !== undefined);
  svg.setAttribute("viewBox", `0 0 ${W} ${Math.max(40, rowH * shown.length + 10)}`);
  if (!shown.length) { svg.append(el("text", { x: W / 2, y: 24, "text-anchor": "middle" }, "no compressed layers yet")); return; }
  const maxBits = Math.max(8, ...shown.map((l) => l.bits));
  shown.forEach((l, i) => {
    const g = el("g", { class: "layer-bar", "data-layer": l.name, "data-bits": String(l.bits) });
    const y = 5 + i * rowH;
    g.append(el("text", { x: L - 6, y: y + 12, "text-anchor": "end" }, l.name));
    g.append(el("rect", { x: L, y, height: rowH - 4, width: Math.max(1, (W - L - 60) * l.bits / maxBits), fill: COLORS.packed }));
    g.append(el("text", { x: L + 6 + (W - L - 60) * l.bits / maxBits, y: y + 12 }, l.bits.toFixed(2) + " bits"));
    svg.append(g);
  });
}

function heatMap(canvas, steps) {
  const ctx = canvas.getContext("2d");
  const names = [...new Set(steps.flatMap((s) => Object.keys(s.bits)))].sort();
  canvas.height = Math.max(20, names.length * 10);
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (!names.length) return;
  const cw = canvas.width / Math.max(steps.length, 1), ch = canvas.height / names.length;
  steps.forEach((s, x) => names.forEach((n, y) => {
    const b = s.bits[n];
    if (b === undefined || b === null) return;
    const t = Math.min(Math.log2(Math.max(b, 1)) / 5, 1);  // 1 bit light ... 32 bits (uncompressed) dark
    ctx.fillStyle = `rgb(${Math.round(235 - 200 * t)}, ${Math.round(240 - 160 * t)}, ${Math.round(250 - 60 * t)})`;
    ctx.fillRect(x * cw, y * ch, Math.ceil(cw), Math.ceil(ch));
  }));
}

function events(list) {
  const body = $("events").tBodies[0];
  body.replaceChildren();
  for (const e of list.slice(-20).reverse()) {
    const tr = document.createElement("tr");
    for (const v of [e.step, e.kind, e.message]) { const td = document.createElement("td"); td.textContent = String(v); tr.append(td); }
    tr.dataset.kind = e.kind;
    body.append(tr);
  }
}

// One row per rank (GET v1/ranks), shown when the job has more than one rank.
function ranksTable(view) {
  const rows = (view && view.ranks) || [];
  const panel = $("ranks-panel");
  panel.hidden = !view || (view.world_size <= 1 && rows.length <= 1);
  if (panel.hidden) return;
  const steps = [...new Set(rows.map((r) => r.step))];
  $("ranks-note").textContent = "gathered at step " + steps.join(", ") + " (each allocation step) · this server is rank " + view.rank;
  const body = $("ranks").tBodies[0];
  body.replaceChildren();
  for (const r of rows) {
    const tr = document.createElement("tr");
    tr.dataset.rank = String(r.rank);
    tr.dataset.agreed = String(r.agreed);
    const cells = [
      [r.rank, String(r.rank)],
      [r.step, String(r.step)],
      [r.avg_bits, r.avg_bits.toFixed(2)],
      [r.ratio, r.ratio === null ? "∞" : r.ratio.toFixed(2) + "×"],
      [r.packed_bytes, formatBytes(r.packed_bytes)],
      [r.process_bytes, r.process_bytes === null ? "–" : formatBytes(r.process_bytes)],
      [r.batch_size, r.batch_size === null ? "–" : String(r.batch_size)],
      [r.budget_bytes, r.budget_bytes === null ? "none" : formatBytes(r.budget_bytes)],
      [r.agreed, r.agreed ? "yes" : "no"],
    ];
    for (const [value, text] of cells) {
      const td = document.createElement("td");
      td.dataset.value = value === null || value === undefined ? "" : String(value);
      td.textContent = text;
      tr.append(td);
    }
    body.append(tr);
  }
}

function render(stats, layers, history) {
  show("step", stats.step, String(stats.step));
  show("ratio", stats.ratio, stats.ratio === null ? "∞" : stats.ratio.toFixed(2) + "×");
  show("avg-bits", stats.avg_bits, stats.avg_bits.toFixed(2));
  show("raw-bytes", stats.raw_bytes, formatBytes(stats.raw_bytes));
  show("packed-bytes", stats.packed_bytes, formatBytes(stats.packed_bytes));
  show("budget", stats.budget_bytes, stats.budget_bytes === null ? "none" : formatBytes(stats.budget_bytes));
  show("activation-budget", stats.activation_budget_bytes, stats.activation_budget_bytes === null ? "none" : formatBytes(stats.activation_budget_bytes));
  show("batch-size", stats.batch_size, stats.batch_size === null ? "–" : String(stats.batch_size));
  show("fallbacks", stats.fallbacks, String(stats.fallbacks));
  const mem = stats.memory;
  show("device-used", mem ? mem.used_bytes : null, mem && mem.used_bytes !== null ? formatBytes(mem.used_bytes) : "–");

  const bits = {};
  for (const l of layers.layers) if (l.bits !== null && l.bits !== undefined) bits[l.name] = l.bits;
  byStep.set(stats.step, { raw: stats.raw_bytes, packed: stats.packed_bytes, activationBudget: stats.activation_budget_bytes, bits });
  while (byStep.size > MAX_STEPS) byStep.delete(byStep.keys().next().value);
  const steps = [...byStep.entries()].sort((a, b) => a[0] - b[0]);
  const ab = stats.activation_budget_bytes;
  lineChart($("activation-chart"), [
    { name: "raw", color: COLORS.raw, points: steps.map(([s, v]) => [s, v.raw]) },
    { name: "packed", color: COLORS.packed, points: steps.map(([s, v]) => [s, v.packed]) },
  ], ab === null ? [] : [{ y: ab, name: "activation budget", color: COLORS.budget }], formatBytes, "step");

  const samples = history.samples || [];
  const t0 = samples.length ? samples[0].time : 0;
  const lines = [];
  if (stats.budget_bytes !== null) lines.push({ y: stats.budget_bytes, name: "budget", color: COLORS.budget });
  const total = mem ? mem.total_bytes : null;
  if (total !== null && total !== undefined) lines.push({ y: total, name: "device total", color: COLORS.total });
  lineChart($("memory-chart"), [
    { name: "used", color: COLORS.used, points: samples.filter((s) => s.used_bytes !== null).map((s) => [s.time - t0, s.used_bytes]) },
    { name: "activations", color: COLORS.packed, points: samples.filter((s) => s.activation_bytes !== null && s.activation_bytes !== undefined).map((s) => [s.time - t0, s.activation_bytes]) },
  ], lines, formatBytes, "seconds");

  bitsChart($("bits-chart"), layers.layers);
  heatMap($("bits-heatmap"), steps.map(([, v]) => v));
  events(stats.events || []);
}

async function refresh() {
  try {
    const [stats, layers, history, ranks] = await Promise.all([getJSON("v1/stats"), getJSON("v1/layers"), getJSON("v1/history"), getJSON("v1/ranks")]);
    render(stats, layers, history);
    ranksTable(ranks);
    $("status").textContent = "live · step " + stats.step;
    $("status").className = "status";
    document.body.dataset.renderedStep = String(stats.step);
  } catch (err) {
    $("status").textContent = "cannot reach the job: " + err.message;
    $("status").className = "status error";
  }
}

function parseBudget(text) {
  const t = text.trim();
  if (/^(none|null)$/i.test(t)) return null;
  if (/^\d+$/.test(t)) return Number(t);
  return t;
}

async function submitBudget(event) {
  event.preventDefault();
  const out = $("budget-result");
  const headers = authHeaders({ "Content-Type": "application/json", Accept: "application/json" });
  try {
    const r = await fetch("v1/budget", { method: "PUT", headers, body: JSON.stringify({ target: parseBudget($("budget-input").value) }) });
    const body = await r.json();
    if (!r.ok) throw new Error(body.detail || r.statusText);
    out.textContent = "queued: " + (body.target === null ? "no limit" : formatBytes(body.target_bytes)) + ", applies at step " + body.applies_at_step;
    out.className = "result ok";
    out.dataset.state = "ok";
  } catch (err) {
    out.textContent = "refused: " + err.message;
    out.className = "result error";
    out.dataset.state = "error";
  }
}

$("token-label").hidden = !tokenRequired;
$("budget-form").addEventListener("submit", submitBudget);
refresh();
setInterval(refresh, POLL_MS);
