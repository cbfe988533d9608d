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
import { $, POLL_MS, SLOW_POLL_MS, Unauthorized, api, due, hooks, state } from "./core.js";
import { act, applyFilter, renderEndpoints, resetEndpoints, send } from "./endpoints.js";
import { renderFleets } from "./fleets.js";
import { esc, since } from "./format.js";
import { commandRollout, loadRolloutHistories, renderRollouts } from "./rollouts.js";
import { renderRoutes } from "./routes.js";
import { renderVirtualModels } from "./virtualmodels.js";
import { SPEND_GROUPS, renderSpend } from "./spend.js";

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
  // Service classes shed, diverted or queued now, whichever view is open.
  const restricted = status.restrictedClasses || [];
  if (restricted.length) {
    const worst = restricted.some((c) => c.admitted === 0) ? "bad" : "warn";
    const text = restricted.map((c) => `${c.class} ${c.state} on ${c.route}`).join("; ");
    pills.push(`<a class="pill ${worst}" href="#classes" data-restricted="${restricted.length}" title="${esc(text)}">${restricted.length === 1 ? esc(text) : `${restricted.length} classes restricted`}</a>`);
  }
  // Telemetry routes whose replicas are saturated: their session requests take the tighter
  // bounded load (saturatedHashBalanceFactor) until the batches have room again.
  const saturated = (status.saturation || []).filter((s) => s.saturated);
  if (saturated.length) {
    const text = saturated.map((s) => `${s.route} saturated · batches ${Math.round(s.batchFill * 100)}% full`).join("; ");
    const why = `${text}: session requests take the saturated bounded load`;
    pills.push(`<span class="pill warn" data-saturated="${saturated.length}" title="${esc(why)}">${saturated.length === 1 ? esc(text) : `${saturated.length} routes saturated`}</span>`);
  }
  const invalid = (status.invalidObjects || []).length;
  const errors = (status.diagnostics || []).filter((d) => d.severity === "error").length;
  if (invalid || errors) pills.push(`<span class="pill warn" title="see kvpilot status">${invalid} invalid · ${errors} errors</span>`);
  // Trouble first: a narrow bar clips the end of the row, so that is where the calm pills go.
  const rank = (pill) => (pill.includes('class="pill bad"') ? 0 : pill.includes('class="pill warn"') ? 1 : 2);
  $("#health").innerHTML = pills.sort((a, b) => rank(a) - rank(b)).join("");
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
// polling

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
  if (state.tab === "virtual") renderVirtualModels($("#virtual"), await api("/v1/virtualmodels"), state.rendered.signatures);
  if (state.tab === "spend" && (due("spend", SLOW_POLL_MS) || !state.rendered.signatures.spend)) {
    const window = $("#spend-window").value;
    const views = {};
    for (const name of SPEND_GROUPS) views[name] = await api(`/v1/spend?window=${window}&by=${name}`);
    renderSpend($("#spend"), views, window, state.rendered.signatures);
  }
  if (state.tab === "rollouts") {
    const rollouts = status.rollouts || [];
    await loadRolloutHistories(rollouts);
    renderRollouts(rollouts);
  }
}

hooks.poll = () => poll();

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
  state.tab = ["endpoints", "routes", "fleets", "changes", "rollouts", "classes", "virtual", "spend"].includes(tab) ? tab : "endpoints";
  document.querySelectorAll(".view").forEach((view) => (view.hidden = view.dataset.view !== state.tab));
  document.querySelectorAll("#tabs a").forEach((a) => a.classList.toggle("active", a.dataset.tab === state.tab));
  delete state.slowAt.changes;
  delete state.slowAt.routes;
  delete state.slowAt.rollouts;
  delete state.slowAt.spend;
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
$("#spend-window").addEventListener("change", () => {
  delete state.slowAt.spend;
  hooks.poll();
});
window.addEventListener("hashchange", showTab);
showTab();
if (state.token) signIn(state.token);
else askToken();
