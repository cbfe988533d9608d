// The Spend view: tokens and their cost per tenant, model and pool, summed over every kvpilot
// replica (GET /v1/spend), for all time or the current calendar window in UTC, and what each
// priced pool cost in that window: per token for paid pools, per replica-hour for owned ones
// with the effective price per million tokens and the part of it that bought idle capacity.

import { esc, num } from "./format.js";

export const SPEND_GROUPS = ["tenant", "model", "pool"];

function money(amount, currency) {
  if (amount === null || amount === undefined || !currency) return "—";
  return `${esc(amount)} ${esc(currency)}`;
}

function groupTable(name, view) {
  if (!view.rows.length) return `<div class="empty">No responses counted yet.</div>`;
  const rows = view.rows
    .map(
      (r) =>
        `<tr data-${name}="${esc(r[name])}"><td>${esc(r[name] || "(none)")}</td><td class="num">${num(r.requests)}</td>` +
        `<td class="num">${num(r.promptTokens)}</td><td class="num">${num(r.cachedTokens)}</td><td class="num">${num(r.completionTokens)}</td>` +
        `<td class="num">${money(r.cost, r.currency)}</td></tr>`,
    )
    .join("");
  const totals = view.totals
    .map(
      (t) =>
        `<tr class="total"><td>total${t.currency ? ` (${esc(t.currency)})` : " (unpriced)"}</td><td class="num">${num(t.requests)}</td>` +
        `<td class="num">${num(t.promptTokens)}</td><td class="num">${num(t.cachedTokens)}</td><td class="num">${num(t.completionTokens)}</td>` +
        `<td class="num">${money(t.cost, t.currency)}</td></tr>`,
    )
    .join("");
  return (
    `<table class="spend" data-by="${name}"><thead><tr><th>${name}</th><th class="num">requests</th><th class="num">prompt tok</th>` +
    `<th class="num">cached</th><th class="num">completion</th><th class="num">cost</th></tr></thead><tbody>${rows}${totals}</tbody></table>`
  );
}

function poolsTable(pools) {
  if (!pools || !pools.length) return `<div class="empty">No pool has a price. Set <code>spec.price</code> on a Pool (docs/cost.md).</div>`;
  const rows = pools
    .map(
      (p) =>
        `<tr data-pool="${esc(p.pool)}"><td>${esc(p.pool)}</td><td>${p.kind === "tokens" ? "per token" : `replica-hour × ${num(p.replicas)} (${money(p.hourly, p.currency)}/h)`}</td>` +
        `<td class="num">${num(p.tokens)}</td><td class="num">${money(p.cost, p.currency)}</td><td class="num">${money(p.perMillionTokens, p.currency)}</td>` +
        `<td class="num">${p.utilization === null || p.utilization === undefined ? "—" : `${num(p.utilization * 100)}%`}</td>` +
        `<td class="num">${money(p.idleCost, p.currency)}</td></tr>`,
    )
    .join("");
  return (
    `<table class="spend pools"><thead><tr><th>pool</th><th>priced</th><th class="num">tokens</th><th class="num">cost</th>` +
    `<th class="num">per 1M tokens</th><th class="num">utilization</th><th class="num">idle cost</th></tr></thead><tbody>${rows}</tbody></table>`
  );
}

export function spendHtml(views, window) {
  const first = views.tenant;
  const span = first.start ? `${esc(first.start)} to ${esc(first.end)} (UTC)` : "since kvpilot first counted";
  return (
    `<p class="muted">${span}</p>` +
    SPEND_GROUPS.map((name) => `<section class="policy"><header><h2>by ${name}</h2></header>${groupTable(name, views[name])}</section>`).join("") +
    `<section class="policy"><header><h2>priced pools${window === "total" ? "" : ` this ${esc(window)}`}</h2></header>${poolsTable(first.pools)}</section>`
  );
}

export function renderSpend(container, views, window, rendered) {
  const html = spendHtml(views, window);
  if (rendered.spend !== html) {
    container.innerHTML = html;
    rendered.spend = html;
  }
}
