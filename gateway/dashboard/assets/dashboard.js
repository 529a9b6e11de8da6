// genq dashboard: one EventSource on /dashboard/events; per section (models, queues, workers,
// jobs, batches) each frame carries the rows that changed ({key: row}) and, when it changed,
// the order of the rows' keys: the page keeps the rows and shows those the order names. Ages
// tick locally between frames, on the gateway's clock. Every value goes in as text
// (textContent), never as HTML.
"use strict";

const view = { rows: {}, order: {}, offsetMs: 0, lastFrame: 0, source: null };
const $ = (id) => document.getElementById(id);
const STALE_BEATS_S = 10;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c ?? ""));
  return node;
}

const td = (text, cls) => el("td", cls ? { class: cls } : {}, text);
const badge = (text) => el("span", { class: `badge s-${text}` }, text);
const nowS = () => (Date.now() + view.offsetMs) / 1000;

function age(at) {
  if (!at) return "–";
  const s = Math.max(0, nowS() - at);
  if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${Math.floor(s / 3600)} h`;
  return `${Math.floor(s / 86400)} d`;
}

const secs = (v) => (v == null ? "–" : v < 1 ? `${Math.round(v * 1000)} ms` : `${v.toFixed(2)} s`);
// An id without the prefix every id of its kind shares (batch_), cut to its first 8
// characters; the whole id is the element's title.
const ID_PREFIX = /^(batch_|file-)/;
const shortId = (id) => {
  const own = id.replace(ID_PREFIX, "");
  return own.length > 12 ? own.slice(0, 8) + "…" : own;
};

// Tokens: prompt → completion; a running job's so far, marked as still growing.
function tokens(j) {
  if (j.completion_tokens != null) return `${j.prompt_tokens ?? 0} → ${j.completion_tokens}`;
  if (j.tokens_so_far != null) return `${j.prompt_tokens ?? "?"} → ${j.tokens_so_far}…`;
  return "–";
}

function fill(table, rows, render, empty) {
  const body = $(table).tBodies[0];
  const cols = $(table).tHead.rows[0].cells.length;
  body.replaceChildren(...(rows.length ? rows.map(render)
    : [el("tr", { class: "empty" }, el("td", { colSpan: cols }, empty))]));
}

function meter(label, used, total, text) {
  const pct = total > 0 ? Math.min(100, (100 * used) / total) : 0;
  const bar = el("span");
  bar.style.width = `${pct}%`;
  return el("div", { class: "meter" }, label, el("div", { class: "bar" }, bar), text);
}

const render = {
  models(rows) {
    fill("models", rows, (m) => el("tr", { "data-model": m.name },
      td(m.name), td(m.simulated ? `${m.engine ?? "–"} (simulated)` : m.engine ?? "no card"),
      td(m.workers, "num"), td(m.max_seq_len ?? "–", "num wide"), td(m.max_batch ?? "–", "num wide")),
      "no model announced yet");
  },
  queues(rows) {
    fill("queues", rows, (q) => el("tr", { "data-queue": `${q.model}:${q.priority}`,
      "data-waiting": q.lag, "data-pending": q.pending },
      td(q.model), td(q.priority), td(q.lag, "num"), td(q.pending, "num"), td(q.length, "num wide")),
      "no queues");
  },
  workers(rows) {
    const box = $("workers");
    if (!rows.length) {
      box.replaceChildren(el("p", { class: "muted" }, "no live worker"));
      return;
    }
    box.replaceChildren(...rows.map((w) => {
      const state = w.engine_down ? "down" : w.draining ? "draining" : "live";
      const kv = w.kv_total > 0
        ? meter("KV pages", w.kv_used, w.kv_total, `${w.kv_used}/${w.kv_total}`)
        : meter("KV pages", 0, 0, "not paged");
      return el("div", { class: "card", "data-worker-id": w.id, "data-active": w.active },
        el("div", { class: "title" }, el("code", { title: w.id }, w.id), badge(state)),
        el("div", { class: "muted" }, `${w.model} · ${w.engine} · GPU ${w.gpu ?? "–"} · ${w.host}`),
        meter("batch", w.active, w.capacity, `${w.active}/${w.capacity}`),
        kv,
        el("div", { class: "meter" }, "tokens/s", el("span"), w.tokens_per_s.toFixed(1)),
        el("div", { class: "meter" }, "heartbeat", el("span"),
          el("span", { class: "age", "data-at": w.beat_at ?? "" }, age(w.beat_at))),
        w.engine_down ? el("div", { class: "bad" }, w.engine_down) : "");
    }));
  },
  jobs(rows) {
    fill("jobs", rows, (j) => el("tr", { "data-job-id": j.id, "data-status": j.status },
      td(el("code", { title: j.id }, shortId(j.id))), td(badge(j.status)), td(j.model ?? "–", "wide"),
      td(j.priority ?? "–", "wide"),
      td(tokens(j), "num"),
      td(secs(j.ttft_s), "num"), td(secs(j.queue_s), "num wide"),
      td(el("span", { class: "age", "data-at": j.created_at }, age(j.created_at)), "num")),
      "no job yet");
  },
  batches(rows) {
    fill("batches", rows, (b) => {
      const done = b.completed + b.failed;
      return el("tr", { "data-batch-id": b.id },
        td(el("code", { title: b.id }, shortId(b.id))), td(badge(b.status)), td(b.model ?? "–", "wide"),
        td(meter("", done, b.total, `${done}/${b.total}${b.failed ? ` (${b.failed} failed)` : ""}`)),
        td(el("span", { class: "age", "data-at": b.created_at }, age(b.created_at)), "num wide"));
    }, "no batch");
  },
};

function apply(frame) {
  view.offsetMs = frame.now * 1000 - Date.now();
  view.lastFrame = Date.now();
  for (const name of Object.keys(render)) {
    const part = frame[name];
    if (part === undefined) continue;
    const rows = (view.rows[name] ||= {});
    Object.assign(rows, part.rows || {});
    if (part.order) {
      view.order[name] = part.order;
      const kept = new Set(part.order);
      for (const key of Object.keys(rows)) if (!kept.has(key)) delete rows[key];
    }
    render[name]((view.order[name] || []).map((key) => rows[key]).filter(Boolean));
  }
  document.body.dataset.round = frame.round;
  setState(frame.error ? "error" : "live", frame.error ? `gateway: ${frame.error}` : "");
  tick();
}

function setState(state, error) {
  document.body.dataset.state = state;
  $("status").textContent = { live: "live", error: "degraded", offline: "reconnecting…",
    loading: "connecting…", login: "locked" }[state];
  $("error").hidden = !error;
  $("error").textContent = error || "";
}

function tick() {
  for (const node of document.querySelectorAll(".age[data-at]")) {
    const at = Number(node.dataset.at);
    node.textContent = age(at);
    const stale = at > 0 && node.closest(".card") !== null && nowS() - at > STALE_BEATS_S;
    node.classList.toggle("stale", stale);
  }
  if (view.lastFrame) $("updated").textContent =
    `updated ${((Date.now() - view.lastFrame) / 1000).toFixed(1)} s ago`;
}

function connect() {
  $("login").hidden = true;
  $("main").hidden = false;
  const source = new EventSource("/dashboard/events");
  view.source = source;
  source.addEventListener("update", (e) => apply(JSON.parse(e.data)));
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED) {
      view.source = null;
      checkAccess(); // refused (logged out, key revoked): the login form, else retry
    } else {
      setState("offline", "");
    }
  };
}

async function checkAccess() {
  let r;
  try {
    r = await fetch("/dashboard/session", { credentials: "same-origin" });
  } catch {
    setState("offline", "");
    setTimeout(checkAccess, 2000);
    return;
  }
  if (!r.ok) {
    setState("error", `gateway answered ${r.status}`);
    setTimeout(checkAccess, 2000);
    return;
  }
  const session = await r.json();
  $("logout").hidden = !(session.login && session.authorized);
  if (session.authorized) connect();
  else showLogin("");
}

function showLogin(message) {
  setState("login", "");
  $("main").hidden = true;
  $("login").hidden = false;
  $("login-error").hidden = !message;
  $("login-error").textContent = message;
  $("key").focus();
}

async function login(event) {
  event.preventDefault();
  const r = await fetch("/dashboard/login", {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ key: $("key").value }),
  });
  $("key").value = "";
  if (r.ok) checkAccess();
  else showLogin(r.status === 401 ? "not an admin key" : `login failed (${r.status})`);
}

async function logout() {
  if (view.source) view.source.close();
  view.source = null;
  await fetch("/dashboard/logout", { method: "POST", credentials: "same-origin" });
  $("logout").hidden = true;
  checkAccess();
}

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", login);
  $("logout").addEventListener("click", logout);
  setInterval(tick, 1000);
  checkAccess();
});
