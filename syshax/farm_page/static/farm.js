// The Farm page: polls the farm's state (JSON) and redraws its tables. No build step, no
// library. Every value goes in with textContent: a dead letter's reason is anybody's text.
"use strict";

const body = document.body;
// Absolute, from the origin: a page opened as http://user:password@host/... would otherwise
// resolve its fetches with the credentials in the URL, which fetch() refuses.
const absolute = (url) => new URL(url, window.location.origin).href;
const STATE_URL = absolute(body.dataset.stateUrl);
const ACTION_URL = absolute(body.dataset.actionUrl);
const ACTION_HEADER = body.dataset.actionHeader;
const POLL_MS = Math.max(parseInt(body.dataset.pollMs, 10) || 1000, 200);
const HISTORY = Math.round(60000 / POLL_MS); // a minute of stream lengths per stream
const history = {};

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "–" : String(text);
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function fill(tableId, items, draw) {
  const tbody = document.querySelector(`#${tableId} tbody`);
  const rows = items.map((item) => {
    const tr = document.createElement("tr");
    draw(tr, item);
    return tr;
  });
  tbody.replaceChildren(...rows);
}

function seconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  return `${Math.round(s / 60)} min`;
}

function bytes(n) {
  if (n < 2 ** 10) return `${n} B`;
  if (n < 2 ** 20) return `${(n / 2 ** 10).toFixed(1)} KiB`;
  return `${(n / 2 ** 20).toFixed(1)} MiB`;
}

function short(id) {
  return id.length > 18 ? `${id.slice(0, 16)}…` : id;
}

function clock(t) {
  return t ? new Date(t * 1000).toLocaleTimeString() : "?";
}

function spark(values) {
  const bars = "▁▂▃▄▅▆▇█";
  const top = Math.max(...values, 1);
  return values.map((v) => bars[Math.min(Math.floor((v / top) * 7.999), 7)]).join("");
}

function drawStreams(state) {
  fill("streams", state.streams, (tr, s) => {
    tr.id = `stream-${s.name.replace(":", "-")}`;
    const h = (history[s.name] = (history[s.name] || []).concat([s.length]).slice(-HISTORY));
    cell(tr, s.name);
    cell(tr, s.length, "num").dataset.field = "length";
    cell(tr, s.waiting, "num").dataset.field = "waiting";
    cell(tr, s.pending, "num").dataset.field = "pending";
    cell(tr, seconds(s.oldest_pending_age_s), "num");
    cell(tr, s.consumers.map((c) => `${c.name} (${c.pending}, ${seconds(c.idle_s)})`).join(", "));
    cell(tr, spark(h), "spark");
  });
}

function drawWorkers(state) {
  fill("workers", state.workers, (tr, w) => {
    tr.id = `worker-${w.id}`;
    if (w.draining) tr.className = "stale";
    cell(tr, w.id + (w.draining ? " (draining)" : ""));
    cell(tr, w.host);
    cell(tr, w.device_class);
    cell(tr, w.device);
    cell(tr, w.roles);
    cell(tr, w.engine);
    cell(tr, w.model);
    cell(tr, `${w.running} / ${w.capacity}`, "num").dataset.field = "running";
    cell(tr, w.waiting, "num");
    cell(tr, w.step_ms, "num");
    cell(tr, w.decode_tps.toFixed(1), "num");
    cell(tr, seconds(w.heartbeat_age_s), "num");
    cell(tr, `${w.kv_blocks_held} / ${w.kv_blocks}`, "num");
  });
}

function drawModels(state) {
  // A farm of several models: each one's row (broker/model_state.py); hidden for one model.
  const rows = Object.entries(state.per_model || {}).sort(([a], [b]) => a.localeCompare(b));
  document.getElementById("per-model").hidden = rows.length === 0;
  fill("model-rows", rows, (tr, [name, m]) => {
    cell(tr, name || "?");
    cell(tr, m.workers, "num");
    for (const c of ["xpu", "cpu"]) {
      const d = m.devices[c];
      cell(tr, d.decoders ? `${d.running + d.waiting} / ${d.capacity}` : "–", "num");
    }
    cell(tr, m.jobs_waiting, "num");
    cell(tr, `${m.dispatch.xpu} / ${m.dispatch.cpu}`, "num");
  });
}

function drawDispatcher(state) {
  const d = state.dispatcher;
  document.getElementById("dispatch-counts").textContent = Object.entries(d.counts)
    .map(([c, n]) => `${n} to ${c}`)
    .join(", ");
  fill("decisions", d.decisions, (tr, x) => {
    cell(tr, clock(x.at));
    cell(tr, x.model || "");
    cell(tr, x.device);
    cell(tr, x.rule);
    cell(tr, x.reason, "reason");
  });
  fill("itl", state.itl_tails, (tr, t) => {
    if (!t.fresh) tr.className = "stale";
    cell(tr, t.device_class);
    cell(tr, t.gateway);
    cell(tr, t.ratio.toFixed(2), "num");
    cell(tr, t.gaps, "num");
    cell(tr, seconds(t.age_s), "num");
  });
  const kv = state.kv;
  document.getElementById("kv-count").textContent = `${kv.count} held`;
  fill("leases", kv.held, (tr, l) => {
    cell(tr, short(l.owner)).title = l.owner;
    cell(tr, l.worker);
    cell(tr, l.store);
    cell(tr, l.tokens, "num");
    cell(tr, bytes(l.bytes), "num");
    cell(tr, seconds(l.age_s), "num");
    cell(tr, seconds(l.expires_in_s), "num");
  });
}

function actionButton(td, letter, action, label, cls) {
  const b = document.createElement("button");
  b.className = `btn btn-sm ${cls} mr-1`;
  b.textContent = label;
  b.dataset.action = action;
  b.addEventListener("click", () => act(letter, action));
  td.appendChild(b);
}

function drawDead(state) {
  const dead = state.dead_letters;
  let count = `${dead.length} in the stream`;
  if (state.rabbitmq_dead !== null && state.rabbitmq_dead !== undefined) {
    // broker.jobs amqp: RabbitMQ's letters are counted, not read (reading takes them)
    count += `; ${state.rabbitmq_dead} in RabbitMQ's dead-letter queue (syshax dead-letters list)`;
  }
  document.getElementById("dead-count").textContent = count;
  fill("dead", dead.entries, (tr, d) => {
    tr.id = `dead-${d.id}`;
    cell(tr, d.id);
    cell(tr, seconds(d.age_s), "num");
    cell(tr, d.stream.split(":").slice(-2).join(":"));
    cell(tr, d.request_id || "(undecodable)");
    cell(tr, d.reason, "reason");
    const td = cell(tr, "");
    if (d.requeueable) actionButton(td, d, "requeue", "Requeue", "btn-outline-primary");
    actionButton(td, d, "drop", "Drop", "btn-outline-danger");
  });
}

function message(id, text) {
  const el = document.getElementById(id);
  el.textContent = text || "";
  el.hidden = !text;
}

async function act(letter, action) {
  const what = `${action} dead letter ${letter.id} (request ${letter.request_id || "?"})`;
  if (!window.confirm(`Really ${what}?`)) return;
  const url = ACTION_URL.replace("ENTRY", encodeURIComponent(letter.id)).replace("ACTION", action);
  try {
    const res = await fetch(url, {
      method: "POST",
      credentials: "same-origin",
      headers: { [ACTION_HEADER]: action },
    });
    const reply = await res.json();
    message("flash", res.ok ? `${letter.id}: ${reply.message}` : `${letter.id}: ${reply.error}`);
  } catch (err) {
    message("flash", `${what} failed: ${err}`);
  }
  refresh();
}

async function refresh() {
  try {
    const res = await fetch(STATE_URL, { cache: "no-store", credentials: "same-origin" });
    const state = await res.json();
    if (!res.ok) throw new Error(state.error || res.statusText);
    message("error", "");
    document.getElementById("models").textContent = state.models.join(", ") || "–";
    drawStreams(state);
    drawWorkers(state);
    drawModels(state);
    drawDispatcher(state);
    drawDead(state);
    const updated = document.getElementById("updated");
    updated.textContent = `updated ${clock(state.now)}`;
    updated.dataset.now = state.now;
  } catch (err) {
    message("error", `Could not read the farm's state: ${err.message || err}`);
  }
}

let busy = false;
async function tick() {
  if (!busy && document.getElementById("autorefresh").checked) {
    busy = true;
    await refresh();
    busy = false;
  }
}

refresh();
setInterval(tick, POLL_MS);
