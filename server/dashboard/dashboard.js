// CacheSeek dashboard: polls /v1/stats and draws it. No library, no request beyond this server.
// Every figure shown in a [data-stat] element is the /v1/stats value at that path, formatted;
// its raw value is kept in data-value. Charts are drawn from the differences between polls.
"use strict";

const PERIOD_MS = 2000;
const HISTORY = 150; // points kept per chart (5 minutes at 2 s)
const COLORS = ["#3b6fd6", "#e07b00", "#1a7f37", "#c62828", "#7b3fb8", "#00838f"];
const TOKEN_KEY = "cacheseek-dashboard-token";

const state = { prev: null, points: { hits: [], io: [], latency: [], fill: [] }, refreshes: 0 };

function get(obj, path) {
  return path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
}

const fmt = {
  percent: (v) => (v == null ? "-" : (100 * v).toFixed(1) + "%"),
  count: (v) => (v == null ? "-" : Math.round(v).toLocaleString("en-US")),
  bytes: (v) => {
    if (v == null) return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i ? v.toFixed(2) : v.toFixed(0)) + " " + units[i];
  },
  rate: (v) => (v == null ? "-" : fmt.bytes(v) + "/s"),
  ms: (v) => (v == null ? "-" : (1000 * v).toFixed(2) + " ms"),
  ratio: (v) => (v == null ? "-" : v.toFixed(2) + "x"),
};

function headers() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { Authorization: "Bearer " + token } : {};
}

async function poll() {
  let stats;
  try {
    const r = await fetch("v1/stats", { headers: headers(), cache: "no-store" });
    if (r.status === 401 || r.status === 403) {
      document.getElementById("links-need-token").hidden = false;  // (the footer's links send no token)
      document.getElementById("login").hidden = false;
      document.getElementById("login-error").textContent = r.status === 403 ? "token not accepted" : "";
      setHealth("needs a token", "warn");
      return;
    }
    if (!r.ok) throw new Error("HTTP " + r.status);
    stats = await r.json();
  } catch (err) {
    setHealth("unreachable", "bad");
    return;
  }
  document.getElementById("login").hidden = true;
  let ready = false;
  try {
    ready = (await fetch("readyz", { cache: "no-store" })).ok;
  } catch (err) { /* shown as not ready */ }
  render(stats, ready);
  state.refreshes += 1;
  document.body.dataset.refreshes = String(state.refreshes);
}

function setHealth(text, cls) {
  const el = document.getElementById("health");
  el.textContent = text;
  el.className = "badge " + cls;
}

function render(s, ready) {
  const breakers = (s.tiers || []).filter((t) => t.breaker).map((t) => [t.name, t.breaker.state, t.index_stale]);
  const degraded = breakers.some(([, st]) => st !== "closed");
  setHealth(!ready ? "not ready" : degraded ? "degraded" : "healthy", !ready ? "bad" : degraded ? "warn" : "good");
  document.getElementById("breakers").innerHTML = breakers
    .map(([name, st]) => `<span class="badge ${st === "closed" ? "good" : "bad"}" data-breaker="${esc(name)}">${esc(name)} breaker ${esc(st)}</span>`)
    .join(" ");
  document.getElementById("version").textContent = "v" + s.version;
  document.getElementById("uptime").textContent = duration(s.uptime_seconds);
  document.getElementById("refreshed").textContent = new Date().toLocaleTimeString();
  for (const el of document.querySelectorAll("[data-stat]")) {
    const v = get(s, el.dataset.stat);
    el.dataset.value = v == null ? "" : String(v);
    el.textContent = fmt[el.dataset.format](v);
  }
  renderTiers(s.tiers || []);
  renderNamespaces(s.namespaces || []);
  renderOwners((s.traffic && s.traffic.by_owner) || []);
  renderRequests(s.requests || []);
  addPoints(s);
  drawAll(s);
  state.prev = { at: performance.now(), s };
}

function esc(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function duration(sec) {
  if (sec == null) return "-";
  const d = Math.floor(sec / 86400), h = Math.floor((sec % 86400) / 3600), m = Math.floor((sec % 3600) / 60);
  return d ? `${d}d ${h}h` : h ? `${h}h ${m}m` : `${m}m ${Math.floor(sec % 60)}s`;
}

function row(cells) {
  return "<tr>" + cells.map((c) => `<td>${c}</td>`).join("") + "</tr>";
}

function renderTiers(tiers) {
  document.querySelector("#tiers tbody").innerHTML = tiers.map((t) => {
    const fill = t.capacity_bytes ? t.used_bytes / t.capacity_bytes : 0;
    return `<tr data-tier="${esc(t.name)}">` + [
      esc(t.name),
      `<span class="bar"><span data-fill="${Math.min(100, 100 * fill).toFixed(1)}"></span></span> ${fmt.percent(fill)}`,
      `<span data-field="used_bytes" data-value="${t.used_bytes}">${fmt.bytes(t.used_bytes)}</span>`,
      fmt.bytes(t.capacity_bytes),
      t.unique_bytes == null ? "shared" : `<span data-field="unique_bytes" data-value="${t.unique_bytes}">${fmt.bytes(t.unique_bytes)}</span>`,
      `<span data-field="blocks" data-value="${t.blocks}">${fmt.count(t.blocks)}</span>`,
      fmt.count(t.pinned_blocks), fmt.count(t.hits), fmt.count(t.misses), fmt.count(t.admissions),
      fmt.count(t.evictions), fmt.count(t.promotions), fmt.count(t.demotions),
      `<span class="${t.corrupt ? "bad" : ""}">${fmt.count(t.corrupt)}</span>`, fmt.ratio(t.compression_ratio),
    ].map((c) => `<td>${c}</td>`).join("") + "</tr>";
  }).join("");
  // Widths through the CSSOM: the page's content security policy allows no inline style attribute.
  for (const bar of document.querySelectorAll("#tiers [data-fill]")) bar.style.width = bar.dataset.fill + "%";
}

function renderNamespaces(usage) {
  document.querySelector("#namespaces tbody").innerHTML = usage.map((u) =>
    row([u.namespace == null ? "<i>unattributed</i>" : esc(u.namespace === "" ? "(default)" : u.namespace),
         esc(u.model || "-"), fmt.count(u.blocks),
         `<span data-namespace="${esc(u.namespace)}" data-model="${esc(u.model)}" data-value="${u.used_bytes}">${fmt.bytes(u.used_bytes)}</span>`,
         fmt.bytes(u.raw_bytes)])).join("") || row(["-", "", "", "", ""]);
}

function renderOwners(owners) {
  document.querySelector("#owners tbody").innerHTML = owners.map((o) =>
    row([esc(o.namespace === "" ? "(default)" : o.namespace), esc(o.model || "-"), fmt.count(o.lookups),
         fmt.percent(o.token_hit_rate), fmt.bytes(o.ingest_bytes), fmt.bytes(o.materialize_bytes)])).join("")
    || row(["-", "", "", "", "", ""]);
}

function renderRequests(requests) {
  document.querySelector("#requests tbody").innerHTML = requests.map((r) =>
    row([esc(r.route), esc(r.method), fmt.count(r.count), fmt.ms(r.p50_seconds), fmt.ms(r.p90_seconds),
         fmt.ms(r.p99_seconds), esc(Object.entries(r.statuses).map(([k, v]) => `${k}: ${v}`).join(", "))])).join("");
}

// -- charts: rates and windowed percentiles from the difference between two polls --------------

function quantile(bounds, counts, q) {
  const total = counts.reduce((a, b) => a + b, 0);
  if (!total) return null;
  const rank = q * total;
  let seen = 0;
  for (let i = 0; i < counts.length; i++) {
    if (counts[i] && seen + counts[i] >= rank) {
      if (i >= bounds.length) return bounds[bounds.length - 1];
      const lo = i ? bounds[i - 1] : 0;
      return lo + (bounds[i] - lo) * (rank - seen) / counts[i];
    }
    seen += counts[i];
  }
  return bounds[bounds.length - 1];
}

function push(list, point) {
  list.push(point);
  if (list.length > HISTORY) list.shift();
}

function addPoints(s) {
  const now = performance.now();
  const t = s.traffic || {};
  const fill = {};
  for (const tier of s.tiers || []) fill[tier.name] = tier.capacity_bytes ? 100 * tier.used_bytes / tier.capacity_bytes : 0;
  push(state.points.fill, { at: now, v: fill });
  if (!state.prev) return;
  const p = state.prev.s, dt = (now - state.prev.at) / 1000, pt = p.traffic || {};
  // A restarted server counts from zero: no rate against the last process's counters.
  if (dt <= 0 || p.started_at !== s.started_at) return;
  const asked = t.lookup_tokens_requested - pt.lookup_tokens_requested;
  const found = t.lookup_tokens_matched - pt.lookup_tokens_matched;
  push(state.points.hits, { at: now, v: { "hit rate %": asked > 0 ? 100 * found / asked : null, "tokens reused/s": found / dt } });
  push(state.points.io, { at: now, v: { "ingest": (t.ingest_bytes - pt.ingest_bytes) / dt,
                                        "materialize": (t.materialize_bytes - pt.materialize_bytes) / dt } });
  const lat = s.lookup_latency, plat = p.lookup_latency;
  if (lat && plat && lat.bucket_counts && plat.bucket_counts) {
    const delta = lat.bucket_counts.map((n, i) => n - (plat.bucket_counts[i] || 0));
    const b = lat.bucket_bounds_seconds;
    push(state.points.latency, { at: now, v: { p50: ms(quantile(b, delta, 0.5)), p90: ms(quantile(b, delta, 0.9)),
                                               p99: ms(quantile(b, delta, 0.99)) } });
  }
}

function ms(v) {
  return v == null ? null : 1000 * v;
}

function drawAll() {
  draw("chart-hits", state.points.hits, { "hit rate %": (v) => v.toFixed(0) + "%", "tokens reused/s": (v) => fmt.count(v) }, true);
  draw("chart-io", state.points.io, { ingest: fmt.rate, materialize: fmt.rate });
  draw("chart-latency", state.points.latency, { p50: (v) => v.toFixed(2) + " ms", p90: (v) => v.toFixed(2) + " ms", p99: (v) => v.toFixed(2) + " ms" });
  const names = Object.keys((state.points.fill[state.points.fill.length - 1] || { v: {} }).v);
  draw("chart-fill", state.points.fill, Object.fromEntries(names.map((n) => [n, (v) => v.toFixed(1) + "%"])));
}

// One chart; with twoAxes the second series gets its own scale (drawn on the right).
function draw(id, points, series, twoAxes) {
  const canvas = document.getElementById(id);
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
  canvas.width = w * dpr;
  canvas.height = h * dpr;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  g.font = "11px sans-serif";
  const names = Object.keys(series);
  const left = 64, right = twoAxes ? 64 : 10, top = 18, bottom = 16;
  const pw = w - left - right, ph = h - top - bottom;
  g.strokeStyle = "#e2e5eb";
  g.strokeRect(left, top, pw, ph);
  if (points.length < 2) {
    g.fillStyle = "#6b7385";
    g.fillText("collecting (two refreshes needed)", left + 8, top + 16);
    return;
  }
  const scales = names.map((n, i) => {
    const vals = points.map((p) => p.v[n]).filter((v) => v != null);
    const group = twoAxes ? [n] : names;
    const all = points.flatMap((p) => group.map((k) => p.v[k])).filter((v) => v != null);
    return { max: Math.max(1e-9, ...all) * 1.1, vals };
  });
  const span = Math.min(HISTORY, Math.max(points.length, 30)); // a short history fills the width
  const x = (i) => left + (pw * i) / (span - 1);
  names.forEach((n, si) => {
    const sc = scales[si];
    g.strokeStyle = COLORS[si % COLORS.length];
    g.lineWidth = 1.6;
    g.beginPath();
    let started = false;
    const offset = span - points.length;
    points.forEach((p, i) => {
      const v = p.v[n];
      if (v == null) { started = false; return; }
      const px = x(offset + i), py = top + ph - (ph * v) / sc.max;
      if (started) g.lineTo(px, py); else g.moveTo(px, py);
      started = true;
    });
    g.stroke();
    const last = [...points].reverse().find((p) => p.v[n] != null);
    g.fillStyle = COLORS[si % COLORS.length];
    g.fillText(`${n}: ${last ? series[n](last.v[n]) : "-"}`, left + 6 + si * 150, 12);
  });
  g.fillStyle = "#6b7385";
  const fmt0 = series[names[0]] || ((v) => v.toFixed(1));
  g.fillText(fmt0(scales[0] ? scales[0].max / 1.1 : 0), 2, top + 10);
  g.fillText(fmt0(0), 2, top + ph);
  if (twoAxes && names[1]) {
    g.fillText(series[names[1]](scales[1].max / 1.1), w - right + 4, top + 10);
  }
}

document.getElementById("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value);
  poll();
});
document.getElementById("period").textContent = String(PERIOD_MS / 1000);
poll();
setInterval(poll, PERIOD_MS);
