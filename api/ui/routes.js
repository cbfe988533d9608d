// The Routes view: each RoutingPolicy as the path a request takes.

import { $, state } from "./core.js";
import { esc, num } from "./format.js";

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
      ? `<span class="chip aff">affinity ${affinity.prefixHashChars ? `prompt prefix ${affinity.prefixHashChars} chars${affinity.hotPrefixShare ? `, prefixes over ${affinity.hotPrefixShare}% spread` : ""}` : `header ${esc(affinity.header)}`} · ${esc(affinity.algorithm)}${affinity.hashBalanceFactor ? ` · bounded load ${affinity.hashBalanceFactor}%` : ""}</span>`
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

export function renderRoutes(policies) {
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

