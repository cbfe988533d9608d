// The Fleets & Envoys view: per fleet the versions served, per replica its Envoys with the
// versions ACKed, the clusters warming and the last NACK.

import { $, state } from "./core.js";
import { ago, esc, since } from "./format.js";

const TYPES = [
  ["CDS", "type.googleapis.com/envoy.config.cluster.v3.Cluster"],
  ["EDS", "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"],
  ["LDS", "type.googleapis.com/envoy.config.listener.v3.Listener"],
  ["RDS", "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"],
];


function shortVersion(version) {
  return version ? esc(version.slice(0, 8)) : "—";
}

// After a cluster (listener) change Envoy asks for the endpoints (routes) of the new set: a
// rejected CDS (LDS) leaves EDS (RDS) behind what is served, with nothing wrong of its own.
const LEADER = { EDS: "CDS", RDS: "LDS" };
const FOLLOWS = { EDS: "endpoints of the new clusters", RDS: "routes of the new listeners" };

function isNacked(t) {
  return Boolean(t && t.last_nack && t.version_acked !== t.version_sent);
}

// Clusters an Envoy was sent and has not taken into use yet (kvpilot's status `warming`).
function warmingClusters(envoy) {
  return envoy.warming ? envoy.warming.clusters || [] : [];
}

// Why a cell is behind what the fleet is served, in a few words, and as a sentence.
function waitReason(envoy, name, t) {
  const warming = warmingClusters(envoy);
  if (t.version_sent !== t.version_acked) {
    if (name === "CDS" && envoy.warming) {
      return [
        "warming",
        `sent ${t.version_sent}; the Envoy answers once its new clusters have warmed (their endpoints arrived and each endpoint's first health check completed): ${warming.join(", ")}`,
      ];
    }
    return ["awaiting ACK", `sent ${t.version_sent}; the Envoy has not ACKed it yet`];
  }
  if ((name === "LDS" || name === "RDS") && envoy.warming) {
    return [
      "held: clusters warming",
      "kvpilot sends listeners and routes only once the Envoy has answered the clusters they may name (or its wait for that ran out), so that no request meets a cluster the Envoy does not have yet",
    ];
  }
  const leader = LEADER[name];
  const leaderUrl = leader && TYPES.find(([n]) => n === leader)[1];
  if (leader && isNacked((envoy.types || {})[leaderUrl])) {
    return [
      `waits on ${leader} (rejected)`,
      `the Envoy rejected the new ${leader}, and asks for the ${FOLLOWS[name]} only once it takes it; see its last NACK`,
    ];
  }
  return ["not sent yet", "kvpilot has not sent this version to the Envoy yet"];
}

function typeCell(envoy, name, typeUrl, served) {
  const t = (envoy.types || {})[typeUrl];
  if (!t) return `<td class="version muted">—</td>`;
  const nacked = isNacked(t);
  const inSync = t.version_acked && t.version_acked === t.version_sent && (!served || served === t.version_acked);
  const cls = nacked ? "sync-bad" : inSync ? "sync-ok" : "sync-wait";
  const [why, sentence] = nacked || inSync ? ["", ""] : waitReason(envoy, name, t);
  const title = `sent ${t.version_sent || "—"}\nACKed ${t.version_acked || "—"}${served ? `\nserved ${served}` : ""}${sentence ? `\n${sentence}` : ""}`;
  return (
    `<td class="version ${cls}" data-type="${name}" title="${esc(title)}">${shortVersion(t.version_acked)}` +
    `${t.version_sent !== t.version_acked ? ` <span class="muted">← ${shortVersion(t.version_sent)}</span>` : ""}` +
    `${why ? ` <span class="why" data-why>${esc(why)}</span>` : ""}</td>`
  );
}

// A pill on an Envoy whose new clusters are warming: how many, for how long, and their names.
function warmingPill(envoy, now) {
  if (!envoy.warming) return "";
  const clusters = warmingClusters(envoy);
  const title = `warming: ${clusters.join(", ")}\nroutes and listeners wait for these clusters`;
  const count = `${clusters.length} cluster${clusters.length === 1 ? "" : "s"}`;
  return ` <span class="pill warn" data-warming title="${esc(title)}">warming ${count} · ${ago(now - envoy.warming.since)}</span>`;
}

export function renderFleets(status) {
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
          `<tr data-node="${esc(envoy.node_id)}"><td class="id">${esc(envoy.node_id)}${warmingPill(envoy, now)}</td><td>${esc(envoy.fleet)}</td><td>${esc(envoy.mode)}</td>` +
          `<td class="muted">${esc(envoy.peer)}</td><td class="num">${ago(now - envoy.connected_since)}</td>` +
          TYPES.map(([name, url]) => typeCell(envoy, name, url, versions[url])).join("") +
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

