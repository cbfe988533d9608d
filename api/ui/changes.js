// The Changes view: revisions of the policy objects from etcd's history, newest first, each with
// its diff and who made it: the audit log's entry for the REST write at that revision, or the
// rollout whose step wrote it.

import { esc, isoTime, since } from "./format.js";

function diffHtml(diff) {
  return diff
    .split("\n")
    .filter((line) => !line.startsWith("---") && !line.startsWith("+++"))
    .map((line) => {
      const cls = line.startsWith("+") ? "add" : line.startsWith("-") ? "del" : line.startsWith("@@") ? "hunk" : "";
      return cls ? `<span class="${cls}">${esc(line)}</span>` : esc(line);
    })
    .join("\n");
}

function authorHtml(item, audited) {
  if (!audited) return `<span class="author muted">no audit log on this kvpilot</span>`;
  const author = item.author;
  if (!author) {
    return (
      `<span class="author muted" data-actor="" title="etcd has the revision but the audit log has no entry for it">` +
      `author unknown: written past the REST API (etcdctl, a restore) or its audit entry was pruned</span>`
    );
  }
  return (
    `<span class="author" data-actor="${esc(author.actor)}">by <b>${esc(author.actor)}</b>` +
    ` <span class="muted" title="${esc(isoTime(author.at))}">${since(author.at)}</span>` +
    (author.operation ? ` <span class="muted">· ${esc(author.operation)}</span>` : "") +
    (author.replica ? ` <span class="muted">· driven by <span class="mono">${esc(author.replica)}</span></span>` : "") +
    `</span>`
  );
}

export function changesSource(data) {
  return (
    `From etcd's revision history (kept until compaction): every write to a Pool, RoutingPolicy, Fleet or Rollout, however it was made. ` +
    (data.authors
      ? `Who made a change and when come from the audit log, which records every write through the REST API (and so the CLI), or from the rollout whose step wrote it.`
      : `etcd records no author or time; the revision orders them.`) +
    (data.compacted ? " Older revisions have been compacted away." : "")
  );
}

export function changesHtml(data) {
  return (
    data.items
      .map(
        (item) =>
          `<article class="change" data-revision="${item.revision}"><header><b>${esc(item.kind)}/${esc(item.name)}</b>` +
          `<span class="pill">${esc(item.change)}</span>${authorHtml(item, Boolean(data.authors))}` +
          `<span class="muted">revision ${item.revision} · version ${item.version}</span></header>` +
          (item.change === "created"
            ? `<details><summary class="muted">the object as created (${item.diff.split("\n").length - 4} lines)</summary><pre>${diffHtml(item.diff)}</pre></details>`
            : `<pre>${diffHtml(item.diff)}</pre>`) +
          `</article>`,
      )
      .join("") || `<div class="empty">No changes recorded.</div>`
  );
}
