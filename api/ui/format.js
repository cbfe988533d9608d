// Formatting shared by the console's views: escaping, numbers, ages and durations.

export function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

export function num(value, digits = 0) {
  if (value === null || value === undefined) return "—";
  return Number(value).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

export function ago(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "—";
  if (seconds < 1) return "now";
  if (seconds < 90) return `${Math.round(seconds)}s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)}m`;
  if (seconds < 172800) return `${Math.round(seconds / 3600)}h`;
  return `${Math.round(seconds / 86400)}d`;
}

export function since(epoch) {
  if (!epoch) return "—";
  const text = ago(Date.now() / 1000 - epoch);
  return text === "now" ? "just now" : `${text} ago`;
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  return seconds < 90 ? `${Math.floor(seconds)}s` : ago(seconds);
}

export function isoTime(epoch) {
  return epoch ? new Date(epoch * 1000).toISOString() : "";
}

export function interval(seconds) {
  // A configured interval as it is written in a policy: 200ms, 1s, 1.5s, 2m.
  if (seconds === null || seconds === undefined) return "—";
  if (seconds < 1) return `${Math.round(seconds * 1000)}ms`;
  if (seconds < 90) return `${Number(seconds.toFixed(2))}s`;
  return ago(seconds);
}
