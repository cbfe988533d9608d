// The Service classes view: per route, what kvpilot admits of each class now, since when, and
// the pressure behind it (GET /v1/admission). Admission is decided from the route's first-tier
// telemetry and reaches Envoy in RDS; kvpilot does not count requests, so each class names the
// Envoy counters that do.

import { duration, esc, interval, isoTime, num, since } from "./format.js";

const SIGNAL_NAMES = { queue: "queue", kvCache: "KV cache", pendingTokens: "pending tokens", ttft: "TTFT" };
function signalValue(name, value) {
  if (name === "ttft") return interval(value);
  return name === "kvCache" ? `${num(value * 100)}%` : num(value, value < 10 ? 1 : 0);
}

function pressureLevel(pressure, saturation) {
  if (pressure === null || pressure === undefined) return "none";
  if (pressure >= saturation.high) return "bad";
  if (pressure > saturation.low) return "warn";
  return "ok";
}

function gauge(route, saturation) {
  // A bar on a fixed scale of twice the high bound, with the band's low and high marked, so the
  // marks stay readable; a pressure past the scale fills the bar and says so.
  const pressure = route.pressure;
  const top = saturation.high * 2;
  const at = (value) => `${Math.min(100, (value / top) * 100).toFixed(1)}%`;
  const fill = pressure === null ? "" : `<i class="${pressureLevel(pressure, saturation)}" style="width:${at(pressure)}"></i>`;
  const over = pressure !== null && pressure > top ? `<span class="over">${num(pressure, 2)} ▸</span>` : "";
  return (
    `<div class="gauge" title="pressure ${pressure === null ? "unknown" : num(pressure, 2)}; readmit at or below ${num(saturation.low, 2)}, restrict at or above ${num(saturation.high, 2)}">` +
    `${fill}<b class="mark low" style="left:${at(saturation.low)}"></b><b class="mark high" style="left:${at(saturation.high)}"></b>${over}</div>` +
    `<div class="gauge-scale muted"><span style="left:${at(saturation.low)}">low ${num(saturation.low, 2)}</span><span style="left:${at(saturation.high)}">high ${num(saturation.high, 2)}</span></div>`
  );
}

function signalsHtml(route) {
  if (!route.signals.length) {
    return `<div class="muted">No fresh telemetry from ${esc(route.pools.join(", ") || "the first tier")}: every class is admitted (fail open).</div>`;
  }
  const top = Math.max(...route.signals.map((s) => s.pressure));
  return `<table class="signals">${route.signals
    .map(
      (s) =>
        `<tr data-signal="${esc(s.name)}"${s.pressure === top ? ` class="top"` : ""}><td>${esc(SIGNAL_NAMES[s.name] || s.name)}</td>` +
        `<td class="num">${signalValue(s.name, s.mean)}</td><td class="muted">of bound</td><td class="num">${signalValue(s.name, s.bound)}</td>` +
        `<td class="num">= ${num(s.pressure, 2)}</td></tr>`,
    )
    .join("")}</table>`;
}

function stepText(route, saturation, now) {
  const parts = [`level <b>${route.level}</b> of ${route.levels} steps restricted`];
  parts.push(route.changedAt ? `last change <span title="${esc(isoTime(route.changedAt))}">${since(route.changedAt)}</span>` : "no change since this kvpilot started");
  const next = route.nextStep;
  if (next) {
    const wait = Math.max(0, next.at - now);
    parts.push(
      next.direction === "restrict"
        ? `<span class="sync-bad">restricts more ${wait < 1 ? "now" : `in ${duration(wait)}`}</span> unless pressure falls`
        : `<span class="sync-ok">gives a step back ${wait < 1 ? "now" : `in ${duration(wait)}`}</span> while pressure stays at or below low`,
    );
  } else if (route.pressure !== null && route.level > 0 && route.level >= route.levels && route.pressure >= saturation.high) {
    parts.push(`<span class="sync-bad">every class that may be restricted is fully restricted</span>`);
  } else if (route.pressure !== null && route.level > 0) {
    parts.push("holding: pressure is inside the band, or already falling");
  }
  return parts.join(" · ");
}

function shareBar(share) {
  return `<span class="share"><span class="bar"><i style="width:${Math.round(share * 100)}%"></i></span>${num(share * 100)}%</span>`;
}

function actionHtml(c) {
  if (c.whenSaturated === "divert") return `divert to route <b>${esc(c.divertTo)}</b>`;
  if (c.whenSaturated === "shed") return `shed: 429, Retry-After ${num(c.retryAfter)}s`;
  if (c.whenSaturated === "queue") return `queue in Envoy${c.queue ? ` (${num(c.queue.concurrency)} in flight, ${num(c.queue.size)} waiting)` : ""}`;
  return "admit: never restricted";
}

function matchHtml(c, tenantHeader) {
  if (c.fallback) return `<span class="muted">the route's fallback: what no class above claims</span>`;
  const parts = [
    ...c.match.headers.map(([name, value]) => `<span class="chip">${esc(name)}: ${esc(value)}</span>`),
    c.match.tenants.length ? `<span class="chip">${esc(tenantHeader)} in ${esc(c.match.tenants.join(", "))}</span>` : "",
  ];
  return parts.join("");
}

function statsHtml(c) {
  const rows = Object.entries(c.stats).map(([what, name]) => `<div><span class="muted">${esc(what)}</span> <code>${esc(name)}</code></div>`);
  if (c.runtimeKey) rows.push(`<div><span class="muted">override</span> <code>${esc(c.runtimeKey)}</code></div>`);
  return `<details><summary class="muted">Envoy counters</summary>${rows.join("")}</details>`;
}

function classRow(c, tenantHeader) {
  const budget = c.budget ? `<div class="muted">budget ${num(c.budget.requests)}/${esc(c.budget.unit)}${c.budget.tenantShare < 100 ? `, ${c.budget.tenantShare}% per tenant` : ""}</div>` : "";
  return (
    `<tr data-class="${esc(c.name)}" data-state="${esc(c.state)}"><td><b>${esc(c.name)}</b>${budget}</td>` +
    `<td class="num">${interval(c.objective.ttft)}</td>` +
    `<td>${actionHtml(c)}</td>` +
    `<td><span class="badge ${esc(c.state)}">${esc(c.state)}</span></td>` +
    `<td>${shareBar(c.admitted)}</td>` +
    `<td class="since" title="${esc(isoTime(c.since))}">${c.since ? since(c.since) : `<span class="muted">since start</span>`}</td>` +
    `<td>${matchHtml(c, tenantHeader)}</td>` +
    `<td>${statsHtml(c)}</td></tr>`
  );
}

function routeHtml(route, policy, now) {
  const saturation = policy.saturation;
  const level = pressureLevel(route.pressure, saturation);
  return (
    `<section class="svc-route" data-route="${esc(route.route)}" data-pressure="${level}"><header>` +
    `<h3>${esc(route.name)}</h3><span class="muted">pools ${esc(route.pools.join(", ") || "—")}</span>` +
    `<span class="pill ${level === "none" ? "" : level}">pressure ${route.pressure === null ? "—" : num(route.pressure, 2)}</span>` +
    (route.compiled ? "" : `<span class="pill bad">not served: the route did not compile (see kvpilot status)</span>`) +
    `</header><div class="svc-body"><div class="box"><h4>pressure against its bounds</h4>${gauge(route, saturation)}${signalsHtml(route)}` +
    `<div class="steps-text">${stepText(route, saturation, now)}</div></div>` +
    `<table class="grid classes"><thead><tr><th title="most important first">class</th><th class="num">TTFT objective</th><th>when saturated</th><th>now</th><th>admitted</th><th>since</th><th>requests</th><th>counted by Envoy</th></tr></thead>` +
    `<tbody>${route.classes.map((c) => classRow(c, policy.tenantHeader)).join("")}</tbody></table></div></section>`
  );
}

function policyHtml(policy, now) {
  const s = policy.saturation;
  const bounds = [
    `queue ${num(s.queue, 1)}`,
    `KV cache ${num(s.kvCache * 100)}%`,
    s.pendingTokens ? `pending tokens ${num(s.pendingTokens)}` : null,
    s.ttft ? `TTFT ${interval(s.ttft)}` : null,
  ].filter(Boolean);
  return (
    `<section class="policy" data-policy="${esc(policy.name)}"><header><h2>${esc(policy.name)}</h2>` +
    `<span class="muted">saturated at ${esc(bounds.join(" · "))} (${s.busiest ? `queue and KV-cache over the busiest ${s.busiest}% of the replicas, TTFT over all` : "mean per replica"})</span>` +
    `<span class="muted">at pressure ≥ ${num(s.high, 2)} restrict the excess over it (in ${s.step}% steps), at most every ${interval(s.shedInterval)}; give back ${s.step}% at ≤ ${num(s.low, 2)} after ${interval(s.recoverInterval)}</span>` +
    `<span class="muted">tenant header <code>${esc(policy.tenantHeader)}</code></span></header>` +
    policy.routes.map((route) => routeHtml(route, policy, now)).join("") +
    `</section>`
  );
}

export function admissionHtml(data) {
  const now = data.now || Date.now() / 1000;
  return (
    data.policies.map((policy) => policyHtml(policy, now)).join("") ||
    `<div class="empty">No routing policy declares service classes. See the README's "Service classes under overload".</div>`
  );
}

export function renderAdmission(container, data, rendered) {
  const html = admissionHtml(data);
  if (rendered.admission !== html) {
    container.innerHTML = html;
    rendered.admission = html;
  }
}
