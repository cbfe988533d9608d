// kvpilot console. Plain JavaScript, no dependencies: it polls the REST API with the token the
// operator signed in with and redraws only what changed (rows are keyed, and a row is rewritten
// only when its data differs), so a thousand endpoints update without stalling the page. The
// endpoint list is a CSS grid of independent rows, not a <table>: a table lays out every row to
// size its columns, while grid rows with `content-visibility: auto` cost layout only on screen.
//
// Polling rather than server-sent events: EventSource cannot send an Authorization header, and
// a token in a URL ends up in logs and browser history.

import { renderAdmission } from "./admission.js";
import { changesHtml, changesSource } from "./changes.js";
import { ago, duration, esc, isoTime, num, since } from "./format.js";

const POLL_MS = 1000;
const SLOW_POLL_MS = 5000;
const SPARK_POINTS = 60;
const TYPES = [
  ["CDS", "type.googleapis.com/envoy.config.cluster.v3.Cluster"],
  ["EDS", "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"],
  ["LDS", "type.googleapis.com/envoy.config.listener.v3.Listener"],
  ["RDS", "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"],
];

const $ = (selector) => document.querySelector(selector);
const state = {
  token: sessionStorage.getItem("kvpilot.token") || "",
  role: null,
  tab: "endpoints",
  status: null,
  endpoints: null,
  policies: null,
  rolloutHistory: new Map(), // rollout name -> its recorded history
  rolloutMoved: new Map(), // rollout name -> "phase/step" when its history was read
  history: new Map(), // row key -> {at: [], waiting: [], kv: []}
  rows: new Map(), // row key -> {tr, sig, text}
  bodies: new Map(), // pool -> {tbody, header}
  slowAt: {},
  rendered: { signatures: {} },
};
// Render timings, read by the browser tests (and handy in the devtools console).
window.kvpilotConsole = { renders: 0, lastRenderMs: 0, firstRenderMs: null, firstRowsAt: null, signedInAt: null };

// ---------------------------------------------------------------------------------------------
// helpers

function toast(message, bad = false) {
  const box = $("#toast");
  box.textContent = message;
  box.className = bad ? "toast bad" : "toast";
  box.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => (box.hidden = true), bad ? 8000 : 3500);
}

class Unauthorized extends Error {}

async function api(path, options = {}) {
  const response = await fetch(path, {
    ...options,
    headers: { Authorization: `Bearer ${state.token}`, "Content-Type": "application/json", ...(options.headers || {}) },
  });
  if (response.status === 401) throw new Unauthorized("the token was not accepted");
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  if (!response.ok) {
    const detail = body && body.detail;
    const message = Array.isArray(detail) ? detail.map((d) => `${d.loc}: ${d.msg}`).join("; ") : detail || response.statusText;
    const error = new Error(message);
    error.status = response.status;
    throw error;
  }
  return body;
}

// ---------------------------------------------------------------------------------------------
// sign-in

function askToken(message = "") {
  $("#signin-error").textContent = message;
  const dialog = $("#signin");
  if (!dialog.open) dialog.showModal();
  $("#token").focus();
}

async function signIn(token) {
  state.token = token;
  try {
    const me = await api("/v1/whoami");
    state.role = me.role;
    window.kvpilotConsole.signedInAt = performance.now();
    sessionStorage.setItem("kvpilot.token", token);
    $("#signin").close();
    $("#who").innerHTML = `${esc(me.name)} · <b>${esc(me.role)}</b><button id="signout" class="link">sign out</button>`;
    $("#signout").onclick = signOut;
    document.body.dataset.role = me.role;
    resetEndpoints();
    poll();
  } catch (error) {
    state.token = "";
    sessionStorage.removeItem("kvpilot.token");
    askToken(error instanceof Unauthorized ? "That token was not accepted." : `Cannot reach kvpilot: ${error.message}`);
  }
}

function signOut() {
  sessionStorage.removeItem("kvpilot.token");
  state.token = "";
  state.role = null;
  location.reload();
}

// ---------------------------------------------------------------------------------------------
// header: readiness, etcd, Envoys, last build

function renderHealth(status) {
  const envoys = status.envoys || [];
  const nacking = envoys.filter((e) => Object.values(e.types || {}).some((t) => t.last_nack && t.version_acked !== t.version_sent)).length;
  const etcd = status.etcd || {};
  const etcdText = `etcd ${(etcd.endpoints || []).join(",")}${etcd.embedded ? " (embedded)" : ""}`;
  const build = status.lastBuild || {};
  const pills = [
    status.ready ? `<span class="pill ok">ready</span>` : `<span class="pill bad">not ready</span>`,
    etcd.watching === false ? `<span class="pill bad" title="${esc(etcdText)}">etcd unreachable</span>` : `<span class="pill ok" title="watch established">${esc(etcdText)}</span>`,
    `<span class="pill ${nacking ? "bad" : "ok"}">${envoys.length} Envoy${envoys.length === 1 ? "" : "s"}${nacking ? ` · ${nacking} NACKing` : ""}</span>`,
    `<span class="pill" title="revision ${esc(build.revision)}">build ${esc(build.path || "—")} · ${since(build.at)}</span>`,
  ];
  const invalid = (status.invalidObjects || []).length;
  const errors = (status.diagnostics || []).filter((d) => d.severity === "error").length;
  if (invalid || errors) pills.push(`<span class="pill warn" title="see kvpilot status">${invalid} invalid · ${errors} errors</span>`);
  $("#health").innerHTML = pills.join("");
}

// ---------------------------------------------------------------------------------------------
// pools and endpoints

function resetEndpoints() {
  state.rows.clear();
  state.bodies.clear();
  state.history.clear();
  state.endpoints = null;
  document.querySelectorAll("#endpoints .pool-body").forEach((body) => body.remove());
}

function rowKey(pool, endpoint) {
  return `${pool}/${endpoint.id}`;
}

function remember(key, endpoint) {
  // Keep a short history per endpoint: seeded from the server, extended by each new scrape.
  let history = state.history.get(key);
  if (!history) {
    const seed = endpoint.history || { at: [], waiting: [], kv_cache: [] };
    history = { at: [...seed.at], waiting: [...seed.waiting], kv: [...seed.kv_cache] };
    state.history.set(key, history);
  }
  const t = endpoint.telemetry;
  if (t && history.at[history.at.length - 1] !== t.at) {
    history.at.push(t.at);
    history.waiting.push(t.waiting ?? null);
    history.kv.push(t.kv_cache ?? null);
    if (history.at.length > SPARK_POINTS) {
      history.at.shift();
      history.waiting.shift();
      history.kv.shift();
    }
  }
  return history;
}

function sparkline(history) {
  if (!history || history.at.length < 2) return `<span class="muted">—</span>`;
  const n = history.at.length;
  const maxQueue = Math.max(1, ...history.waiting.map((v) => v || 0));
  const points = (values, max) => values.map((v, i) => `${((i / (n - 1)) * 120).toFixed(1)},${(21 - ((v || 0) / max) * 20).toFixed(1)}`).join(" ");
  return `<svg class="spark" viewBox="0 0 120 22" preserveAspectRatio="none"><polyline class="k" points="${points(history.kv, 1)}"/><polyline class="q" points="${points(history.waiting, maxQueue)}"/></svg>`;
}

function weightCell(endpoint, maxWeight) {
  const sent = endpoint.effectiveWeight;
  const share = Math.max(2, Math.round((sent / maxWeight) * 100));
  const arrow = sent !== endpoint.weight ? `<span class="changed">→ ${num(sent)}</span>` : "";
  return `<span class="weight"><span class="bar"><i style="width:${share}%"></i></span><span>${num(endpoint.weight)}</span>${arrow}</span>`;
}

function rowCells(pool, endpoint, history, maxWeight, admin) {
  const t = endpoint.telemetry || {};
  const drained = endpoint.health === "draining";
  const disabled = admin ? "" : ` aria-disabled="true" title="needs an admin token"`;
  const id = esc(endpoint.id);
  const poolName = esc(pool.name);
  return (
    `<span class="id">${id}${endpoint.source === "registered" ? ` <span class="muted">reg</span>` : ""}</span>` +
    `<span><span class="badge ${esc(endpoint.effectiveHealth)}">${esc(endpoint.effectiveHealth)}</span></span>` +
    `<span class="num weightcell">${weightCell(endpoint, maxWeight)}</span>` +
    `<span class="num">${num(t.waiting)}</span>` +
    `<span class="num">${t.running === undefined ? "—" : num(t.running) + (t.max_running ? `<span class="muted">/${num(t.max_running)}</span>` : "")}</span>` +
    `<span class="num">${t.kv_cache === undefined ? "—" : num(t.kv_cache * 100) + "%"}</span>` +
    `<span class="num">${num(t.pending_tokens)}</span>` +
    `<span>${sparkline(history)}</span>` +
    `<span class="num">${endpoint.telemetryAge === null ? "—" : ago(endpoint.telemetryAge)}</span>` +
    `<span class="why">${esc(endpoint.reasons.join("; ")) || `<span class="muted">—</span>`}</span>` +
    `<span class="actions">` +
    // Spans, not form controls: a thousand native inputs and buttons cost seconds of layout.
    `<span class="act" role="button" tabindex="0" data-act="weight" data-pool="${poolName}" data-id="${id}" data-weight="${endpoint.weight}"${disabled}>weight…</span>` +
    `<span class="act drain" role="button" tabindex="0" data-act="${drained ? "undrain" : "drain"}" data-pool="${poolName}" data-id="${id}"${disabled}>${drained ? "undrain" : "drain"}</span>` +
    `</span>`
  );
}

function poolCard(pool) {
  const counts = { healthy: 0, degraded: 0, draining: 0, unhealthy: 0 };
  for (const e of pool.endpoints) counts[e.effectiveHealth] = (counts[e.effectiveHealth] || 0) + 1;
  const serving = counts.healthy + counts.degraded;
  return (
    `<div class="card${serving ? "" : " bad"}" data-pool="${esc(pool.name)}"><h3><span>${esc(pool.name)}</span>` +
    `<span class="pill ${serving ? "ok" : "bad"}">${serving}/${pool.endpoints.length} serving</span></h3>` +
    `<div class="meta">${pool.models.map((m) => `<span class="chip model">${esc(m)}</span>`).join("") || "any model"} ` +
    `${pool.balancing.map((b) => `<span class="chip">${esc(b)}</span>`).join("")}${pool.external ? `<span class="chip">external</span>` : ""}</div>` +
    `<div class="counts"><span class="sync-ok"><b>${counts.healthy}</b> healthy</span><span class="sync-wait"><b>${counts.degraded}</b> degraded</span>` +
    `<span style="color:var(--drain)"><b>${counts.draining}</b> draining</span><span class="sync-bad"><b>${counts.unhealthy}</b> unhealthy</span></div></div>`
  );
}

function rowClass(endpoint) {
  return endpoint.effectiveHealth === "healthy" || endpoint.effectiveHealth === "degraded" ? "erow" : "erow out";
}

function rowFacts(pool, view) {
  const e = view.endpoint;
  return {
    sig: view.sig,
    health: e.effectiveHealth,
    weight: e.weight,
    sent: e.effectiveWeight,
    text: `${pool.name} ${e.id} ${e.effectiveHealth} ${e.reasons.join(" ")}`.toLowerCase(),
  };
}

function renderEndpoints(data) {
  const started = performance.now();
  const table = $("#endpoints");
  const admin = state.role === "admin";
  const seen = new Set();
  const cards = [];
  let total = 0;
  let previousBody = table.firstElementChild; // the header row
  for (const pool of data.pools) {
    cards.push(poolCard(pool));
    const maxWeight = Math.max(1, ...pool.endpoints.map((e) => Math.max(e.weight, e.effectiveWeight)));
    const views = pool.endpoints.map((endpoint) => {
      const key = rowKey(pool.name, endpoint);
      seen.add(key);
      total += 1;
      const history = remember(key, endpoint);
      const { history: _omit, ...shown } = endpoint;
      const sig = JSON.stringify(shown) + admin + maxWeight + history.at.length + history.at[history.at.length - 1];
      return { key, endpoint, history, sig };
    });
    let entry = state.bodies.get(pool.name);
    if (!entry) {
      // A new pool: every row in one string, parsed once, attached once.
      const tbody = document.createElement("div");
      tbody.className = "pool-body";
      tbody.dataset.pool = pool.name;
      tbody.innerHTML =
        `<div class="pool-row">${esc(pool.name)} <span class="muted">· used by ${esc(pool.usedBy.join(", ") || "no route")}</span></div>` +
        views
          .map(
            (v) =>
              `<div role="row" class="${rowClass(v.endpoint)}" data-key="${esc(v.key)}" data-pool="${esc(pool.name)}" data-endpoint="${esc(v.endpoint.id)}">` +
              `${rowCells(pool, v.endpoint, v.history, maxWeight, admin)}</div>`,
          )
          .join("");
      let tr = tbody.firstElementChild.nextElementSibling;
      for (const v of views) {
        state.rows.set(v.key, { tr, ...rowFacts(pool, v) });
        tr = tr.nextElementSibling;
      }
      entry = { tbody };
      state.bodies.set(pool.name, entry);
    } else {
      let previousRow = entry.tbody.firstElementChild;
      for (const v of views) {
        let row = state.rows.get(v.key);
        if (!row) {
          const tr = document.createElement("div");
          tr.setAttribute("role", "row");
          tr.dataset.key = v.key;
          tr.dataset.pool = pool.name;
          tr.dataset.endpoint = v.endpoint.id;
          row = { tr, sig: "" };
          state.rows.set(v.key, row);
        }
        if (row.sig !== v.sig) {
          const moved =
            row.sig !== "" &&
            (row.health !== v.endpoint.effectiveHealth || row.weight !== v.endpoint.weight || row.sent !== v.endpoint.effectiveWeight);
          row.tr.innerHTML = rowCells(pool, v.endpoint, v.history, maxWeight, admin);
          row.tr.className = rowClass(v.endpoint);
          if (moved) {
            void row.tr.offsetWidth; // restart the highlight
            row.tr.classList.add("flash");
          }
          Object.assign(row, rowFacts(pool, v));
        }
        if (previousRow.nextSibling !== row.tr) previousRow.after(row.tr);
        previousRow = row.tr;
      }
    }
    if (previousBody.nextSibling !== entry.tbody) previousBody.after(entry.tbody);
    previousBody = entry.tbody;
  }
  for (const [key, row] of state.rows) {
    if (!seen.has(key)) {
      row.tr.remove();
      state.rows.delete(key);
      state.history.delete(key);
    }
  }
  for (const [name, entry] of state.bodies) {
    if (!data.pools.some((p) => p.name === name)) {
      entry.tbody.remove();
      state.bodies.delete(name);
    }
  }
  const cardsHtml = cards.join("") || `<div class="empty">No pools yet: <code>kvpilot apply -f pool.yaml</code></div>`;
  if (state.rendered.signatures.cards !== cardsHtml) {
    $("#pool-cards").innerHTML = cardsHtml;
    state.rendered.signatures.cards = cardsHtml;
  }
  $("#endpoint-count").textContent = `${total} endpoint${total === 1 ? "" : "s"} in ${data.pools.length} pool${data.pools.length === 1 ? "" : "s"}`;
  applyFilter();
  void table.offsetHeight; // lay out now, so the time measured is what the operator waits
  const timings = window.kvpilotConsole;
  timings.renders += 1;
  timings.lastRenderMs = performance.now() - started;
  if (timings.firstRowsAt === null && total > 0) {
    timings.firstRenderMs = timings.lastRenderMs;
    timings.firstRowsAt = performance.now();
  }
  table.dataset.rows = String(total);
}

function applyFilter() {
  const words = $("#filter").value.toLowerCase().split(/\s+/).filter(Boolean);
  for (const row of state.rows.values()) {
    const hide = words.length > 0 && !words.every((w) => row.text.includes(w));
    if (row.tr.hidden !== hide) row.tr.hidden = hide;
  }
}

async function send(pool, id, field, value) {
  const path = `/v1/pools/${encodeURIComponent(pool)}/endpoints/${encodeURIComponent(id)}/${field}`;
  try {
    await api(path, { method: "PUT", body: JSON.stringify({ [field]: value }) });
    const what =
      field === "weight" ? `weight ${value}` : value === "draining" ? "draining: Envoys stop sending it new requests" : "back in rotation";
    toast(`${pool} ${id}: ${what}`);
    poll();
  } catch (error) {
    toast(error.status === 403 ? `Not allowed: ${error.message}` : `Failed: ${error.message}`, true);
  }
}

function act(button) {
  const { act: action, pool, id } = button.dataset;
  if (action === "weight") {
    // One editor for the whole table, placed at the row it edits.
    const editor = $("#weight-editor");
    editor.dataset.pool = pool;
    editor.dataset.id = id;
    $("#weight-input").value = button.dataset.weight;
    $("#weight-label").textContent = `${pool} ${id}`;
    const box = button.getBoundingClientRect();
    editor.style.top = `${window.scrollY + box.bottom + 4}px`;
    editor.style.left = `${Math.max(8, window.scrollX + box.right - 260)}px`;
    editor.hidden = false;
    $("#weight-input").select();
  } else {
    send(pool, id, "health", action === "drain" ? "draining" : "healthy");
  }
}

// ---------------------------------------------------------------------------------------------
// routes

function poolHealth(name) {
  const pool = state.endpoints && state.endpoints.pools.find((p) => p.name === name);
  if (!pool) return null;
  const serving = pool.endpoints.filter((e) => e.effectiveHealth === "healthy" || e.effectiveHealth === "degraded").length;
  return { serving, total: pool.endpoints.length };
}

function routeHtml(route, index) {
  const match = route.match || {};
  const matchParts = [
    ...(match.models || []).map((m) => `<span class="chip model">model ${esc(m)}</span>`),
    match.pathPrefix && match.pathPrefix !== "/" ? `<span class="chip">path ${esc(match.pathPrefix)}*</span>` : "",
    ...(match.headers || []).map((h) => `<span class="chip">${esc(h.name)}: ${esc(h.value)}</span>`),
  ].join("");
  const affinity = route.sessionAffinity;
  const limit = route.rateLimit;
  const settings = [
    `<span class="chip">${esc(route.balancing)}</span>`,
    affinity
      ? `<span class="chip aff">affinity ${affinity.prefixHashChars ? `prompt prefix ${affinity.prefixHashChars} chars` : `header ${esc(affinity.header)}`} · ${esc(affinity.algorithm)}${affinity.hashBalanceFactor ? ` · bounded load ${affinity.hashBalanceFactor}%` : ""}</span>`
      : "",
    limit ? `<span class="chip limit">${num(limit.requests)}/${esc(limit.unit)}${limit.burst ? ` burst ${num(limit.burst)}` : ""}${limit.tenantHeader ? ` per ${esc(limit.tenantHeader)}` : ""}</span>` : "",
    route.retries ? `<span class="chip">${route.retries.attempts} retries</span>` : "",
    route.timeouts && route.timeouts.request ? `<span class="chip">timeout ${esc(route.timeouts.request)}</span>` : "",
  ].join("");
  const tiers = route.tiers
    .map((tier, t) => {
      const total = tier.pools.reduce((sum, p) => sum + p.weight, 0) || 1;
      const parts = tier.pools
        .map((p) => {
          const health = poolHealth(p.pool);
          const share = Math.round((p.weight / total) * 100);
          const cls = p.weight === 0 ? "drained" : health && health.serving === 0 ? "dead" : "";
          const hs = health ? ` · ${health.serving}/${health.total}` : " · missing";
          return `<div class="${cls}" style="flex:${Math.max(p.weight, total * 0.12)}" title="${esc(p.pool)}: weight ${p.weight} (${share}%)${esc(hs)} serving">${esc(p.pool)} ${share}%${esc(hs)}</div>`;
        })
        .join("");
      return `<div class="tier"><span class="label">${t === 0 ? "tier 0" : `tier ${t} ↓`}</span><div class="split">${parts}</div></div>`;
    })
    .join("");
  return (
    `<div class="route" data-route="${esc(route.name)}"><div class="order">${index + 1}</div>` +
    `<div class="box"><h4>${esc(route.name)} · match</h4>${matchParts || `<span class="muted">every request</span>`}</div>` +
    `<div class="box"><h4>how</h4>${settings}</div>` +
    `<div class="box"><h4>where</h4>${tiers}</div></div>`
  );
}

function renderRoutes(policies) {
  const html =
    policies
      .map((policy) => {
        const spec = policy.spec;
        return (
          `<section class="policy" data-policy="${esc(policy.metadata.name)}"><header><h2>${esc(policy.metadata.name)}</h2>` +
          `<span class="muted">listener ${esc(spec.listener.address)}:${spec.listener.port}</span>` +
          `<span class="muted">fleets ${esc((spec.fleets || []).join(", "))}</span>` +
          `<span class="muted">hosts ${esc((spec.hosts || []).join(", "))}</span>` +
          `<span class="muted">model from body <code>model</code> or header <code>${esc(spec.modelHeader)}</code></span></header>` +
          spec.routes.map(routeHtml).join("") +
          `</section>`
        );
      })
      .join("") || `<div class="empty">No routing policies yet.</div>`;
  if (state.rendered.signatures.routes !== html) {
    $("#routes").innerHTML = html;
    state.rendered.signatures.routes = html;
  }
}

// ---------------------------------------------------------------------------------------------
// fleets and Envoys

function shortVersion(version) {
  return version ? esc(version.slice(0, 8)) : "—";
}

function typeCell(envoy, typeUrl, served) {
  const t = (envoy.types || {})[typeUrl];
  if (!t) return `<td class="version muted">—</td>`;
  const nacked = t.last_nack && t.version_acked !== t.version_sent;
  const inSync = t.version_acked && t.version_acked === t.version_sent && (!served || served === t.version_acked);
  const cls = nacked ? "sync-bad" : inSync ? "sync-ok" : "sync-wait";
  const title = `sent ${t.version_sent || "—"}\nACKed ${t.version_acked || "—"}${served ? `\nserved ${served}` : ""}`;
  return `<td class="version ${cls}" title="${esc(title)}">${shortVersion(t.version_acked)}${t.version_sent !== t.version_acked ? ` <span class="muted">← ${shortVersion(t.version_sent)}</span>` : ""}</td>`;
}

function renderFleets(status) {
  const envoys = status.envoys || [];
  const served = (status.lastBuild || {}).fleets || {};
  const byReplica = new Map();
  for (const envoy of envoys) {
    const replica = envoy.replica || "?";
    if (!byReplica.has(replica)) byReplica.set(replica, []);
    byReplica.get(replica).push(envoy);
  }
  const now = Date.now() / 1000;
  const fleetNames = new Set([...Object.keys(served), ...envoys.map((e) => e.fleet)]);
  const fleetRows = [...fleetNames]
    .sort()
    .map((fleet) => {
      const members = envoys.filter((e) => e.fleet === fleet);
      const versions = served[fleet] || served[(status.lastBuild || {}).defaultFleet] || {};
      const synced = members.filter((e) => TYPES.every(([, url]) => !e.types[url] || e.types[url].version_acked === versions[url])).length;
      return `<tr><td>${esc(fleet)}</td><td class="num">${members.length}</td><td class="${synced === members.length ? "sync-ok" : "sync-wait"}">${synced}/${members.length} in sync</td>${TYPES.map(([, url]) => `<td class="version">${shortVersion(versions[url])}</td>`).join("")}</tr>`;
    })
    .join("");
  let html =
    `<div class="replica"><h2>Fleets <span class="muted">· versions this replica (${esc(status.replica || "")}) serves</span></h2>` +
    `<table class="grid"><thead><tr><th>fleet</th><th class="num">Envoys</th><th>sync</th>${TYPES.map(([name]) => `<th>${name}</th>`).join("")}</tr></thead><tbody>${fleetRows}</tbody></table></div>`;
  for (const [replica, members] of [...byReplica].sort()) {
    const rows = members
      .map((envoy) => {
        const types = Object.values(envoy.types || {});
        const lastAck = Math.max(0, ...types.map((t) => t.acked_at || 0));
        const nacks = types.filter((t) => t.last_nack).sort((a, b) => b.last_nack.at - a.last_nack.at);
        const nack = nacks[0];
        const versions = served[envoy.fleet] || served[(status.lastBuild || {}).defaultFleet] || {};
        const current = nack && nack.version_acked !== nack.version_sent;
        const nackHtml = nack
          ? `<div class="nack" data-nack>${esc(nack.type)} ${current ? "rejected" : "rejected earlier"} (${since(nack.last_nack.at)}): ${esc(nack.last_nack.message)}</div>`
          : `<span class="muted">none</span>`;
        return (
          `<tr data-node="${esc(envoy.node_id)}"><td class="id">${esc(envoy.node_id)}</td><td>${esc(envoy.fleet)}</td><td>${esc(envoy.mode)}</td>` +
          `<td class="muted">${esc(envoy.peer)}</td><td class="num">${ago(now - envoy.connected_since)}</td>` +
          TYPES.map(([, url]) => typeCell(envoy, url, versions[url])).join("") +
          `<td class="num">${lastAck ? ago(now - lastAck) : "—"}</td><td class="nackcell">${nackHtml}</td></tr>`
        );
      })
      .join("");
    html +=
      `<div class="replica" data-replica="${esc(replica)}"><h2>Envoys connected to replica <span class="mono">${esc(replica)}</span> <span class="muted">(${members.length})</span></h2>` +
      `<table class="grid"><thead><tr><th>node</th><th>fleet</th><th>mode</th><th>peer</th><th class="num">up</th>${TYPES.map(([name]) => `<th>${name} ACKed</th>`).join("")}<th class="num">last ACK</th><th>last NACK</th></tr></thead><tbody>${rows}</tbody></table></div>`;
  }
  if (!envoys.length) html += `<div class="empty">No Envoy is connected. Start one with the bootstrap in <code>deploy/envoy/</code>.</div>`;
  if (state.rendered.signatures.fleets !== html) {
    $("#fleets").innerHTML = html;
    state.rendered.signatures.fleets = html;
  }
}

// ---------------------------------------------------------------------------------------------
// changes

function renderChanges(data) {
  $("#changes-source").textContent = changesSource(data);
  const html = changesHtml(data);
  if (state.rendered.signatures.changes !== html) {
    $("#changes").innerHTML = html;
    state.rendered.signatures.changes = html;
  }
}

// ---------------------------------------------------------------------------------------------
// rollouts: the live part (phase, step, verdict) comes with /v1/status every poll; the history
// is read per rollout on the slow poll, or at once when its phase or step moves.

const ROLLOUT_COMMANDS = ["pause", "resume", "abort", "promote"];
const ENDED = ["Succeeded", "RolledBack", "Aborted", "Failed"];
const HISTORY_SHOWN = 12;

function commandProblem(command, phase) {
  // The server's rule (controlplane/rollouts.py allowed), so a button that would get a 409 is off.
  if (ENDED.includes(phase)) return `the rollout has ended (${phase})`;
  if (phase === "Pending" || phase === null || phase === undefined) return "the rollout has not started yet";
  if (command === "pause" && phase === "Paused") return "already paused";
  if (command === "resume" && phase !== "Paused") return "only a paused rollout can be resumed";
  return null;
}

function splitText(weights) {
  return Object.entries(weights || {})
    .map(([pool, weight]) => `${esc(pool)} <b>${num(weight)}%</b>`)
    .join(" · ");
}

function stepsHtml(rollout) {
  const live = rollout.phase === "Progressing" || rollout.phase === "Paused";
  const current = rollout.step ?? -1;
  return rollout.steps
    .map((weights, i) => {
      const done = rollout.phase === "Succeeded" || i < current;
      const here = live && i === current;
      let held = "";
      if (here && rollout.stepStartedAt) {
        const elapsed = Math.max(0, Date.now() / 1000 - rollout.stepStartedAt);
        const minimum = rollout.minDuration || 0;
        const share = minimum ? Math.min(100, (elapsed / minimum) * 100) : 100;
        held =
          `<span class="time" title="held ${duration(elapsed)} of its minimum ${duration(minimum)}">` +
          `<span class="held"><i class="${share >= 100 ? "full" : ""}" style="width:${share.toFixed(1)}%"></i></span>` +
          `<span class="muted">${duration(Math.min(elapsed, minimum || elapsed))} / ${duration(minimum)}</span></span>`;
      }
      const mark = done ? `<span class="sync-ok">✓</span>` : here ? `<span class="q">▶</span>` : `<span class="muted">${i + 1}</span>`;
      return `<div class="step${done ? " done" : ""}${here ? " current" : ""}" data-step="${i}"><span class="mark">${mark}</span><span>${splitText(weights)}</span>${held || "<span></span>"}</div>`;
    })
    .join("");
}

function verdictHtml(verdict) {
  if (!verdict) return `<div class="muted">No verdict yet: the numbers appear once the rollout runs.</div>`;
  const side = (name) => {
    const numbers = verdict[name] || {};
    const rate = numbers.requests ? `${num((numbers.errors / numbers.requests) * 100, 1)}%` : "—";
    return `<tr><td>${name}</td><td class="num">${num(numbers.requests)}</td><td class="num">${num(numbers.errors)}</td><td class="num">${rate}</td></tr>`;
  };
  const value = (v) => (v === null || v === undefined ? "—" : num(v, 4));
  const rules = (verdict.rules || [])
    .map(
      (rule) =>
        `<tr title="${esc(rule.message)}"><td>${esc(rule.rule)}</td><td class="outcome-${esc(rule.outcome)}">${esc(rule.outcome)}</td>` +
        `<td class="num">${value(rule.canary)}</td><td class="num">${value(rule.stable)}</td><td class="num">${value(rule.limit)}</td></tr>`,
    )
    .join("");
  return (
    `<div>verdict <b class="outcome-${esc(verdict.outcome)}">${esc(verdict.outcome)}</b></div>` +
    `<table class="grid verdict"><thead><tr><th>pool</th><th class="num">requests</th><th class="num">errors</th><th class="num">error rate</th></tr></thead><tbody>${side("canary")}${side("stable")}</tbody></table>` +
    (rules
      ? `<table class="grid verdict"><thead><tr><th>rule</th><th>outcome</th><th class="num">canary</th><th class="num">stable</th><th class="num">limit</th></tr></thead><tbody>${rules}</tbody></table>`
      : `<div class="muted">No rules: a step passes on time and requests.</div>`)
  );
}

function eventText(event) {
  const parts = [];
  if (event.step !== undefined && event.event !== "step") parts.push(`step ${event.step + 1}`);
  if (event.weights) parts.push(splitText(event.weights));
  if (event.outcome) parts.push(`<span class="outcome-${esc(event.outcome)}">${esc(event.outcome)}</span> canary ${num((event.canary || {}).requests)} req / ${num((event.canary || {}).errors)} err`);
  for (const field of ["reason", "command", "message"]) if (event[field]) parts.push(esc(event[field]));
  return parts.join(" · ");
}

function historyHtml(history) {
  if (history === undefined) return `<div class="muted">loading…</div>`;
  if (!history.length) return `<div class="muted">Nothing recorded yet.</div>`;
  return `<ul class="events">${history
    .slice(-HISTORY_SHOWN)
    .reverse()
    .map((e) => `<li><span class="muted" title="${esc(isoTime(e.at))}">${since(e.at)}</span><span><b>${esc(e.event)}${e.event === "step" ? ` ${e.step + 1}` : ""}</b> ${eventText(e)}</span></li>`)
    .join("")}</ul>`;
}

function rolloutHtml(rollout, admin) {
  const target = rollout.target || {};
  const buttons = ROLLOUT_COMMANDS.map((command) => {
    const problem = admin ? commandProblem(command, rollout.phase) : "needs an admin token";
    const off = problem ? ` aria-disabled="true" title="${esc(problem)}"` : "";
    return `<span class="act" role="button" tabindex="0" data-rollout="${esc(rollout.name)}" data-command="${command}"${off}>${command}</span>`;
  }).join("");
  return (
    `<section class="rollout" data-rollout="${esc(rollout.name)}" data-phase="${esc(rollout.phase)}"><header><h2>${esc(rollout.name)}</h2>` +
    `<span class="pill phase-${esc(rollout.phase)}" data-phase-pill>${esc(rollout.phase)}</span>` +
    `<span class="muted">${esc(target.policy)}/${esc(target.route)} tier ${esc(target.tier)}</span>` +
    (rollout.step !== null && rollout.step !== undefined ? `<span class="muted">step ${Math.min(rollout.step + 1, rollout.steps.length)} of ${rollout.steps.length}</span>` : "") +
    (rollout.driver ? `<span class="muted">driven by <span class="mono">${esc(rollout.driver)}</span></span>` : "") +
    (rollout.message ? `<span class="muted">${esc(rollout.message)}</span>` : "") +
    `<span class="actions">${buttons}</span></header>` +
    `<div class="body"><div class="box"><h4>steps</h4>${stepsHtml(rollout)}</div>` +
    `<div class="box"><h4>live verdict</h4>${verdictHtml(rollout.verdict)}</div>` +
    `<div class="box"><h4>history</h4>${historyHtml(state.rolloutHistory.get(rollout.name))}</div></div></section>`
  );
}

async function loadRolloutHistories(rollouts) {
  const slow = due("rollouts", SLOW_POLL_MS);
  for (const rollout of rollouts) {
    const moved = `${rollout.phase}/${rollout.step}`;
    if (!slow && state.rolloutMoved.get(rollout.name) === moved) continue;
    const body = await api(`/v1/rollouts/${encodeURIComponent(rollout.name)}/status`);
    state.rolloutHistory.set(rollout.name, body.history || []);
    state.rolloutMoved.set(rollout.name, moved);
  }
}

function renderRollouts(rollouts) {
  const admin = state.role === "admin";
  const html =
    rollouts.map((rollout) => rolloutHtml(rollout, admin)).join("") ||
    `<div class="empty">No rollouts. Create one with <code>kvpilot apply -f rollout.yaml</code> (see the README's "Progressive rollouts").</div>`;
  if (state.rendered.signatures.rollouts !== html) {
    $("#rollouts").innerHTML = html;
    state.rendered.signatures.rollouts = html;
  }
}

async function commandRollout(button) {
  const { rollout, command } = button.dataset;
  if ((command === "abort" || command === "promote") && !confirm(`${command} rollout ${rollout}?`)) return;
  try {
    await api(`/v1/rollouts/${encodeURIComponent(rollout)}/${command}`, { method: "POST" });
    toast(`${rollout}: ${command} sent; the driving replica applies it within a tick`);
    poll();
  } catch (error) {
    toast(error.status === 403 ? `Not allowed: ${error.message}` : `Failed: ${error.message}`, true);
  }
}

// ---------------------------------------------------------------------------------------------
// polling

function due(name, every) {
  const now = Date.now();
  if ((state.slowAt[name] || 0) + every > now) return false;
  state.slowAt[name] = now;
  return true;
}

async function refresh() {
  const status = await api("/v1/status");
  state.status = status;
  renderHealth(status);
  if (state.tab === "fleets") renderFleets(status);
  if (state.tab === "endpoints" || state.tab === "routes") {
    const first = state.endpoints === null;
    const data = await api(`/v1/endpoints${first ? "?history=true" : ""}`);
    state.endpoints = data;
    if (state.tab === "endpoints") renderEndpoints(data);
  }
  if (state.tab === "routes") {
    if (state.policies === null || due("routes", SLOW_POLL_MS)) state.policies = (await api("/v1/routingpolicies")).items;
    renderRoutes(state.policies);
  }
  if (state.tab === "changes" && (due("changes", SLOW_POLL_MS) || !state.rendered.signatures.changes)) {
    renderChanges(await api("/v1/history?limit=100"));
  }
  if (state.tab === "classes") renderAdmission($("#classes"), await api("/v1/admission"), state.rendered.signatures);
  if (state.tab === "rollouts") {
    const rollouts = status.rollouts || [];
    await loadRolloutHistories(rollouts);
    renderRollouts(rollouts);
  }
}

let timer = null;
let running = false;
let again = false;
async function poll() {
  clearTimeout(timer);
  if (!state.role) return; // not signed in yet
  if (running) {
    again = true; // e.g. an action while a poll is in flight: poll once more right after
    return;
  }
  running = true;
  again = false;
  try {
    await refresh();
  } catch (error) {
    if (error instanceof Unauthorized) {
      state.role = null;
      state.role = null;
      askToken("The token is no longer accepted; sign in again.");
      running = false;
      return;
    }
    $("#health").innerHTML = `<span class="pill bad">kvpilot unreachable: ${esc(error.message)}</span>`;
  } finally {
    running = false;
  }
  timer = setTimeout(poll, again ? 0 : POLL_MS);
}

function showTab() {
  const tab = (location.hash || "#endpoints").slice(1);
  state.tab = ["endpoints", "routes", "fleets", "changes", "rollouts", "classes"].includes(tab) ? tab : "endpoints";
  document.querySelectorAll(".view").forEach((view) => (view.hidden = view.dataset.view !== state.tab));
  document.querySelectorAll("#tabs a").forEach((a) => a.classList.toggle("active", a.dataset.tab === state.tab));
  delete state.slowAt.changes;
  delete state.slowAt.routes;
  delete state.slowAt.rollouts;
  state.rendered.signatures.changes = "";
  if (state.tab === "endpoints" && state.endpoints) renderEndpoints(state.endpoints);
  poll();
}

// ---------------------------------------------------------------------------------------------
// start

$("#signin-form").addEventListener("submit", (event) => {
  event.preventDefault();
  signIn($("#token").value.trim());
});
$("#signin").addEventListener("cancel", (event) => event.preventDefault());
$("#filter").addEventListener("input", applyFilter);
$("#endpoints").addEventListener("click", (event) => {
  const button = event.target.closest("[data-act]");
  if (button && button.getAttribute("aria-disabled") !== "true") act(button);
});
$("#endpoints").addEventListener("keydown", (event) => {
  if ((event.key === "Enter" || event.key === " ") && event.target.dataset.act) {
    event.preventDefault();
    event.target.click();
  }
});
$("#rollouts").addEventListener("click", (event) => {
  const button = event.target.closest("[data-command]");
  if (button && button.getAttribute("aria-disabled") !== "true") commandRollout(button);
});
$("#rollouts").addEventListener("keydown", (event) => {
  if ((event.key === "Enter" || event.key === " ") && event.target.dataset.command) {
    event.preventDefault();
    event.target.click();
  }
});
$("#weight-editor").addEventListener("submit", (event) => {
  event.preventDefault();
  const editor = $("#weight-editor");
  editor.hidden = true;
  send(editor.dataset.pool, editor.dataset.id, "weight", Number($("#weight-input").value));
});
$("#weight-cancel").onclick = () => ($("#weight-editor").hidden = true);
$("#signout").onclick = signOut;
window.addEventListener("hashchange", showTab);
showTab();
if (state.token) signIn(state.token);
else askToken();
