// The Rollouts view: the live part (phase, step, verdict) comes with /v1/status every poll; the
// history is read per rollout on the slow poll, or at once when its phase or step moves.

import { $, SLOW_POLL_MS, api, due, hooks, state, toast } from "./core.js";
import { duration, esc, isoTime, num, since } from "./format.js";

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
  if (event.fleets) parts.push(`fleets ${esc(event.fleets.join(", "))} only`);
  if (event.event === "widen") parts.push("every fleet");
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

function buttonsHtml(rollout, admin) {
  return ROLLOUT_COMMANDS.map((command) => {
    const problem = admin ? commandProblem(command, rollout.phase) : "needs an admin token";
    const off = problem ? ` aria-disabled="true" title="${esc(problem)}"` : "";
    return `<span class="act" role="button" tabindex="0" data-rollout="${esc(rollout.name)}" data-command="${command}"${off}>${command}</span>`;
  }).join("");
}

function factsHtml(rollout) {
  const target = rollout.target || {};
  return (
    `<h2>${esc(rollout.name)}</h2>` +
    `<span class="pill phase-${esc(rollout.phase)}" data-phase-pill>${esc(rollout.phase)}</span>` +
    `<span class="muted">${esc(target.policy)}/${esc(target.route)} tier ${esc(target.tier)}</span>` +
    (rollout.step !== null && rollout.step !== undefined ? `<span class="muted">step ${Math.min(rollout.step + 1, rollout.steps.length)} of ${rollout.steps.length}</span>` : "") +
    (rollout.driver ? `<span class="muted">driven by <span class="mono">${esc(rollout.driver)}</span></span>` : "") +
    (rollout.message ? `<span class="muted">${esc(rollout.message)}</span>` : "")
  );
}

function newCard() {
  const section = document.createElement("section");
  section.className = "rollout";
  section.innerHTML =
    `<header><span class="facts"></span><span class="actions"></span></header>` +
    `<div class="body"><div class="box"><h4>steps</h4><div></div></div>` +
    `<div class="box"><h4>live verdict</h4><div></div></div>` +
    `<div class="box"><h4>history</h4><div></div></div></div>`;
  const [steps, verdict, history] = section.querySelectorAll(".box > div");
  return { section, facts: section.querySelector(".facts"), actions: section.querySelector(".actions"), steps, verdict, history };
}

const cards = new Map(); // rollout name -> its section and the parts a poll patches
const shown = new WeakMap(); // part -> the HTML it shows

function patch(part, html) {
  if (shown.get(part) === html) return;
  part.innerHTML = html;
  shown.set(part, html);
}

export async function loadRolloutHistories(rollouts) {
  const slow = due("rollouts", SLOW_POLL_MS);
  for (const rollout of rollouts) {
    const moved = `${rollout.phase}/${rollout.step}`;
    if (!slow && state.rolloutMoved.get(rollout.name) === moved) continue;
    const body = await api(`/v1/rollouts/${encodeURIComponent(rollout.name)}/status`);
    state.rolloutHistory.set(rollout.name, body.history || []);
    state.rolloutMoved.set(rollout.name, moved);
  }
}

export function renderRollouts(rollouts) {
  // Each part of a card is rewritten only when it changed: the steps box changes every poll
  // (the time held), and rewriting the whole view with it replaced the buttons under the
  // pointer, so a click pressed before a poll and released after it reached no button.
  const admin = state.role === "admin";
  const container = $("#rollouts");
  if (!rollouts.length) {
    const html = `<div class="empty">No rollouts. Create one with <code>kvpilot apply -f rollout.yaml</code> (see the README's "Progressive rollouts").</div>`;
    if (state.rendered.signatures.rollouts !== html) {
      container.innerHTML = html;
      cards.clear();
      state.rendered.signatures.rollouts = html;
    }
    return;
  }
  if (state.rendered.signatures.rollouts !== "cards") {
    container.innerHTML = "";
    cards.clear();
    state.rendered.signatures.rollouts = "cards";
  }
  const seen = new Set();
  let previous = null;
  for (const rollout of rollouts) {
    seen.add(rollout.name);
    let card = cards.get(rollout.name);
    if (!card) {
      card = newCard();
      card.section.dataset.rollout = rollout.name;
      cards.set(rollout.name, card);
    }
    card.section.dataset.phase = String(rollout.phase ?? "");
    patch(card.facts, factsHtml(rollout));
    patch(card.actions, buttonsHtml(rollout, admin));
    patch(card.steps, stepsHtml(rollout));
    patch(card.verdict, verdictHtml(rollout.verdict));
    patch(card.history, historyHtml(state.rolloutHistory.get(rollout.name)));
    if ((previous ? previous.nextSibling : container.firstChild) !== card.section) {
      if (previous) previous.after(card.section);
      else container.prepend(card.section);
    }
    previous = card.section;
  }
  for (const [name, card] of cards) {
    if (!seen.has(name)) {
      card.section.remove();
      cards.delete(name);
    }
  }
}

export async function commandRollout(button) {
  const { rollout, command } = button.dataset;
  if ((command === "abort" || command === "promote") && !confirm(`${command} rollout ${rollout}?`)) return;
  try {
    await api(`/v1/rollouts/${encodeURIComponent(rollout)}/${command}`, { method: "POST" });
    toast(`${rollout}: ${command} sent; the driving replica applies it within a tick`);
    hooks.poll();
  } catch (error) {
    toast(error.status === 403 ? `Not allowed: ${error.message}` : `Failed: ${error.message}`, true);
  }
}

