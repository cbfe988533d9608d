// Virtual models (GET /v1/virtualmodels): per virtual model its targets and scorer, the threshold
// in force and the large share it aims at, and what Envoys reported to this kvpilot replica:
// requests by target, where scores came from, cap and floor overrides, escalations and the
// score distribution as a row of bars; and, from every replica's spend, what its requests cost
// against the same tokens at the large model's price.

import { esc, num } from "./format.js";

function bars(scores) {
  const top = Math.max(1, ...scores);
  return (
    `<span class="score-bars" title="scores in bins of 0.1, from 0 (easy) to 1 (hard)">` +
    scores.map((n, i) => `<span style="height:${Math.round((24 * n) / top)}px" title="${(i / 10).toFixed(1)}-${((i + 1) / 10).toFixed(1)}: ${n}"></span>`).join("") +
    `</span>`
  );
}

function counts(map) {
  const entries = Object.entries(map || {});
  return entries.length ? entries.map(([k, v]) => `${esc(k)} ${num(v)}`).join(" · ") : "none";
}

function spendHtml(v) {
  const s = v.spend;
  if (!s || !s.requests) return `<p class="muted" data-spend="none">Spend: no responses counted yet.</p>`;
  if (s.saved === null) return `<p class="muted" data-spend="none">Spend saved: not stated, ${esc(s.reason)} (docs/difficulty.md).</p>`;
  const share = Number(s.largeCost) > 0 ? ` (${num((100 * Number(s.saved)) / Number(s.largeCost), 1)}%)` : "";
  return (
    `<p data-spend="${esc(s.currency)}">Spend ${esc(s.cost)} ${esc(s.currency)} over ${num(s.tokens)} tokens; ` +
    `all at ${esc(v.large)}'s price ${esc(s.largeCost)} ${esc(s.currency)}; saved <b data-saved>${esc(s.saved)} ${esc(s.currency)}</b>${share}</p>`
  );
}

function targetsText(v) {
  const models = v.targetModels || [{ model: v.small }, { model: v.large }];
  if (models.length === 2) return `${esc(v.small)} or ${esc(v.large)}`;
  return models.map((t, i) => (i === 0 ? esc(t.model) : `${esc(t.model)} above ${num(t.threshold, 4)}${t.share === null ? "" : ` (${num(t.share, 1)}%)`}`)).join(", ");
}

function virtualHtml(v) {
  const many = (v.targetModels || []).length > 2;
  const aimed = many ? `targets after the first` : `large`;
  const share = many ? v.targetModels.slice(1).reduce((sum, t) => sum + (t.share || 0), 0) : v.share;
  const target = v.share === null ? `fixed threshold` : `target ${num(share, 1)}% ${aimed} (floor ${num(v.floor, 1)}%, cap ${num(v.cap, 1)}%)`;
  const observed = v.largeShare === null ? "no requests reported yet" : `${num(v.largeShare, 1)}% large over ${num(v.requests)} requests`;
  return (
    `<section class="policy" data-virtual="${esc(v.key)}"><header><h2>${esc(v.name)}</h2>` +
    `<span class="muted">policy ${esc(v.policy)} · ${targetsText(v)} · ${esc(v.scorer)} scorer${v.escalation ? " · escalation" : ""}</span></header>` +
    `<p>${esc(target)}; threshold <b>${num(v.threshold, 4)}</b>${v.tie ? ` (ties large ${num(100 * v.tie, 1)}%)` : ""}` +
    `${v.expectedShare === null ? "" : `, ${num(v.expectedShare, 1)}% of the last ${num(v.samples)} scores above it`}</p>` +
    `<p>${esc(observed)} · by target: ${counts(v.targets)} · sources: ${counts(v.sources)} · cap/floor overrides: ${counts(v.forced)} · escalations ${num(v.escalations)}</p>` +
    `${spendHtml(v)}<p>${bars(v.scores)}</p></section>`
  );
}

export function virtualModelsHtml(data) {
  return (
    (data.virtualModels || []).map(virtualHtml).join("") ||
    `<div class="empty">No routing policy declares virtual models. See docs/difficulty.md.</div>`
  );
}

export function renderVirtualModels(container, data, rendered) {
  const html = virtualModelsHtml(data);
  if (rendered.virtualModels !== html) {
    container.innerHTML = html;
    rendered.virtualModels = html;
  }
}
