// What every view of the console shares: the page's state, the REST API with the signed-in
// token, the toast, and when a slow view is due to be read again.

export const POLL_MS = 1000;
export const SLOW_POLL_MS = 5000;
export const $ = (selector) => document.querySelector(selector);
export const state = {
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

export function toast(message, bad = false) {
  const box = $("#toast");
  box.textContent = message;
  box.className = bad ? "toast bad" : "toast";
  box.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => (box.hidden = true), bad ? 8000 : 3500);
}

export class Unauthorized extends Error {}

export async function api(path, options = {}) {
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

export function due(name, every) {
  const now = Date.now();
  if ((state.slowAt[name] || 0) + every > now) return false;
  state.slowAt[name] = now;
  return true;
}

// Set by the page: poll once more now (after an action, so its effect shows at once).
export const hooks = { poll() {} };
