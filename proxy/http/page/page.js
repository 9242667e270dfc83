// llmproxy's live page: reads /llmproxy/events (server-sent events) with fetch(), so that a
// key can go in a header (an EventSource cannot send one, and a URL gets logged), and draws
// the picture: slots per upstream, the queue, a timeline of finished requests, counters.
// No library, no build step; everything it loads comes from the proxy itself.
"use strict";

const WINDOW_MS = 120000; // the timeline's longest span: the last two minutes
const SPANS = [5000, 10000, 30000, 60000, WINDOW_MS]; // it zooms to the shortest that fits
const MAX_BARS = 400; // the timeline keeps at most this many requests
const KEY = "llmproxy-key";

const state = { picture: null, bars: [], dirty: true };

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function setConn(s, text) { const c = $("conn"); c.dataset.state = s; c.textContent = text || s; }

function headers() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: "Bearer " + key } : {};
}

async function connect() {
  setConn("connecting");
  let resp;
  try {
    resp = await fetch("/llmproxy/events", { headers: headers(), cache: "no-store" });
  } catch (e) {
    return retry("proxy unreachable");
  }
  if (resp.status === 401) {
    sessionStorage.removeItem(KEY);
    $("keyform").hidden = false;
    setConn("error", "key needed");
    return;
  }
  if (!resp.ok || !resp.body) return retry("HTTP " + resp.status);
  $("keyform").hidden = true;
  setConn("live");
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        handle(buf.slice(0, cut));
        buf = buf.slice(cut + 2);
      }
    }
  } catch (e) { /* the connection broke: reconnect below */ }
  retry("disconnected");
}

function retry(why) {
  setConn("error", why + ", retrying");
  setTimeout(connect, 1000);
}

function handle(block) {
  let name = "message", data = "";
  for (const line of block.split("\n")) {
    if (line.startsWith("event: ")) name = line.slice(7);
    else if (line.startsWith("data: ")) data += line.slice(6);
  }
  if (!data) return; // a keepalive comment
  const msg = JSON.parse(data);
  const now = performance.now();
  if (name === "picture") state.picture = msg;
  else if (name === "change") Object.assign(state.picture, msg);
  for (const row of msg.timeline || []) addBar(row, now);
  state.dirty = true;
}

function addBar(row, now) {
  const at = (ago) => (ago === null ? null : now - ago);
  state.bars.push({
    outcome: row.outcome, route: row.route, session: row.session, slot: row.slot,
    upstream: row.upstream, arrived: at(row.arrived_ago_ms), granted: at(row.granted_ago_ms),
    first: at(row.first_byte_ago_ms), ended: at(row.ended_ago_ms),
  });
  if (state.bars.length > MAX_BARS) state.bars.splice(0, state.bars.length - MAX_BARS);
}

function drawCounters(c) {
  $("c-never-sent").textContent = c.never_sent;
  $("c-stopped-early").textContent = c.stopped_early;
  $("c-reused-tokens").textContent = c.reused_tokens;
  $("c-p50").textContent = c.keystroke_ms.p50 ?? "–";
  $("c-p95").textContent = c.keystroke_ms.p95 ?? "–";
  $("c-requests").textContent = c.requests;
}

// Slots grouped by model: an upstream's group is the models it serves (a router's model
// alone, with what the router says of it); one that takes any name is under "any model".
function drawUpstreams(ups) {
  const box = $("upstreams");
  box.replaceChildren();
  const groups = new Map();
  for (const u of ups) {
    const key = u.models.length ? u.models.join(", ") : "";
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(u);
  }
  for (const [key, members] of groups) {
    const status = members.map(u => u.model_status).find(Boolean);
    const title = key ? `model ${key}` : "any model";
    const group = el("div", { class: "model", "data-model": key },
      el("h2", { class: "group" }, title, status ? el("span", { class: "kind" }, ` · ${status}`) : ""));
    drawMembers(group, members);
    box.append(group);
  }
}

function drawMembers(box, ups) {
  for (const u of ups) {
    const tiles = el("div", { class: "tiles" });
    for (const s of u.slots) {
      const tile = el("div", { class: "tile", "data-state": s.state, "data-slot": s.id },
        el("div", { class: "st" }, `slot ${s.id} · ${s.state}`));
      if (s.session) {
        tile.append(el("div", {}, "session ", el("code", {}, s.session)));
        tile.append(el("div", {}, `${s.cls} · ${s.route}`));
        const tokens = s.tokens === null || s.tokens === undefined ? "" : ` · ${s.tokens} tokens`;
        tile.append(el("div", { class: "mute" }, `${(s.age_ms / 1000).toFixed(1)} s${tokens}`));
      }
      tiles.append(tile);
    }
    const health = u.healthy ? "" : " · out of rotation";
    box.append(el("div", { class: "upstream", "data-name": u.name },
      el("h2", {}, u.name, " ", el("span", { class: "kind" },
        `${u.kind} · ${u.permits.free}/${u.permits.total} permits free${health}`)),
      tiles));
  }
}

function drawQueue(q) {
  const list = $("queue");
  $("queue-max").textContent = `(at most ${q.max})`;
  list.replaceChildren();
  if (!q.places.length) list.append(el("li", { class: "empty" }, "empty"));
  q.places.forEach((p, i) => {
    const text = p.kind === "held"
      ? `${i + 1}. held for ${p.session}`
      : `${i + 1}. ${p.session} ${p.route} ${(p.age_ms / 1000).toFixed(1)} s`;
    list.append(el("li", { "data-kind": p.kind }, text));
  });
}

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function drawTimeline(now) {
  const box = $("timeline");
  const width = box.clientWidth || 800, height = box.clientHeight || 260;
  const bars = state.bars.filter((b) => now - b.ended < WINDOW_MS);
  const rows = Math.max(1, Math.floor((height - 16) / 7));
  const shown = bars.slice(-rows);
  const oldest = shown.length ? now - shown[0].arrived : 0;
  const span = SPANS.find((s) => oldest <= s * 0.95) || WINDOW_MS;
  $("window").textContent = span >= 60000 ? `${span / 60000} min` : `${span / 1000} s`;
  const x = (t) => Math.max(0, width - ((now - t) / span) * width);
  const step = span / 5;
  const parts = [];
  for (let ms = 0; ms <= span; ms += step) {
    const s = ms / 1000;
    const gx = width - (ms / span) * width;
    parts.push(svg("line", { class: "axis", x1: gx, x2: gx, y1: 0, y2: height - 12 }));
    const label = svg("text", { x: Math.max(2, gx - 24), y: height - 2 });
    label.textContent = s ? `-${+s.toFixed(2)} s` : "now";
    parts.push(label);
  }
  shown.forEach((b, i) => {
    const y = (shown.length - 1 - i) * 7 + 2;
    const wait = b.granted ?? b.ended;
    const g = svg("g", { class: `bar ${b.outcome}`, "data-outcome": b.outcome });
    const title = svg("title", {});
    title.textContent = `${b.outcome} ${b.route} session ${b.session}` +
      (b.slot === null ? "" : ` slot ${b.slot}`) + ` ${Math.round(b.ended - b.arrived)} ms`;
    g.append(title);
    g.append(svg("rect", { x: x(b.arrived), y, width: Math.max(1, x(wait) - x(b.arrived)),
      height: 5, class: "wait" }));
    if (b.granted !== null) {
      const first = b.first ?? b.granted;
      g.append(svg("rect", { x: x(b.granted), y, width: Math.max(1, x(first) - x(b.granted)),
        height: 5, class: "head" }));
      g.append(svg("rect", { x: x(first), y, width: Math.max(1.5, x(b.ended) - x(first)),
        height: 5, class: "run" }));
    } else {
      g.append(svg("rect", { x: x(b.ended) - 1.5, y, width: 3, height: 5, class: "run" }));
    }
    parts.push(g);
  });
  box.replaceChildren(...parts);
}

function frame() {
  const p = state.picture;
  if (p && state.dirty) {
    drawCounters(p.counters);
    drawUpstreams(p.upstreams);
    drawQueue(p.queue);
    state.dirty = false;
  }
  drawTimeline(performance.now());
  setTimeout(frame, 250);
}

document.addEventListener("DOMContentLoaded", () => {
  $("keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, $("key").value.trim());
    $("key").value = "";
    connect();
  });
  connect();
  frame();
});
