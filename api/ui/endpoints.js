// The Pools & endpoints view: a card per pool and a row per endpoint, rewritten only when its data
// changed, with the admin's actions (set a weight, drain or undrain).

import { $, api, hooks, state, toast } from "./core.js";
import { ago, esc, num } from "./format.js";

const SPARK_POINTS = 60;

export function resetEndpoints() {
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

// What the replica serves: its pool's models, or the models and LoRA adapters its agent
// reports; a model list that could not be read is flagged (the last one read still routes).
function servedCell(endpoint) {
  const models = (endpoint.models || []).map((m) => `<span class="chip model">${esc(m)}</span>`);
  const adapters = (endpoint.adapters || []).map((a) => `<span class="chip adapter" title="LoRA adapter">${esc(a)}</span>`);
  const error = endpoint.modelsError
    ? `<span class="chip warn" title="${esc(endpoint.modelsError)}">model list unread</span>`
    : "";
  if (!models.length && !adapters.length && !error) return "";
  return `<span class="served">${models.join("")}${adapters.join("")}${error}</span> `;
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
    `<span class="why">${servedCell(endpoint)}${esc(endpoint.reasons.join("; ")) || `<span class="muted">—</span>`}</span>` +
    `<span class="actions">` +
    // Spans, not form controls: a thousand native inputs and buttons cost seconds of layout.
    `<span class="act" role="button" tabindex="0" data-act="weight" data-pool="${poolName}" data-id="${id}" data-weight="${endpoint.weight}"${disabled}>weight…</span>` +
    `<span class="act drain" role="button" tabindex="0" data-act="${drained ? "undrain" : "drain"}" data-pool="${poolName}" data-id="${id}"${disabled}>${drained ? "undrain" : "drain"}</span>` +
    `</span>`
  );
}

// A pool's own models, or else the models and adapters its replicas report.
function poolModels(pool) {
  if (pool.models.length) return pool.models;
  const found = new Set();
  for (const e of pool.endpoints) for (const m of [...(e.models || []), ...(e.adapters || [])]) found.add(m);
  return [...found].sort();
}

function poolCard(pool) {
  const counts = { healthy: 0, degraded: 0, draining: 0, unhealthy: 0 };
  for (const e of pool.endpoints) counts[e.effectiveHealth] = (counts[e.effectiveHealth] || 0) + 1;
  const serving = counts.healthy + counts.degraded;
  return (
    `<div class="card${serving ? "" : " bad"}" data-pool="${esc(pool.name)}"><h3><span>${esc(pool.name)}</span>` +
    `<span class="pill ${serving ? "ok" : "bad"}">${serving}/${pool.endpoints.length} serving</span></h3>` +
    `<div class="meta">${poolModels(pool).map((m) => `<span class="chip model">${esc(m)}</span>`).join("") || "any model"} ` +
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
    text: `${pool.name} ${e.id} ${e.effectiveHealth} ${e.reasons.join(" ")} ${(e.models || []).join(" ")} ${(e.adapters || []).join(" ")}`.toLowerCase(),
  };
}

export function renderEndpoints(data) {
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

export function applyFilter() {
  const words = $("#filter").value.toLowerCase().split(/\s+/).filter(Boolean);
  for (const row of state.rows.values()) {
    const hide = words.length > 0 && !words.every((w) => row.text.includes(w));
    if (row.tr.hidden !== hide) row.tr.hidden = hide;
  }
}

export async function send(pool, id, field, value) {
  const path = `/v1/pools/${encodeURIComponent(pool)}/endpoints/${encodeURIComponent(id)}/${field}`;
  try {
    await api(path, { method: "PUT", body: JSON.stringify({ [field]: value }) });
    const what =
      field === "weight" ? `weight ${value}` : value === "draining" ? "draining: Envoys stop sending it new requests" : "back in rotation";
    toast(`${pool} ${id}: ${what}`);
    hooks.poll();
  } catch (error) {
    toast(error.status === 403 ? `Not allowed: ${error.message}` : `Failed: ${error.message}`, true);
  }
}

export function act(button) {
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

