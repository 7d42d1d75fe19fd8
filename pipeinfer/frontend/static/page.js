// pipeinfer's live page: polls GET /state every second and draws the cluster; the chat streams from
// POST /v1/chat/completions (stream: true), read with fetch + ReadableStream. Plain JavaScript, no network
// beyond this server.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, polling: false, chat: [], abort: null };

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function authHeaders() {
  const key = $("chat-key").value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

function fmt(x, digits) {
  if (x === null || x === undefined) return "n/a";
  return typeof x === "number" ? x.toFixed(digits === undefined ? 0 : digits) : String(x);
}

function ago(t) {
  const s = Math.max(0, Date.now() / 1000 - t);
  return s < 60 ? `${s.toFixed(0)} s ago` : s < 3600 ? `${(s / 60).toFixed(0)} min ago` : `${(s / 3600).toFixed(1)} h ago`;
}

// ------------------------------------------------------------------ the numbers
function drawNumbers(s) {
  const a = s.activity, load = s.load;
  $("tps").textContent = fmt(a.tokens_per_s, a.tokens_per_s < 10 ? 1 : 0);
  const peak = Math.max(...a.history, 0);
  $("tps-sub").textContent = `last 60 s · peak ${peak}/s`;
  const w = 300, h = 40, n = a.history.length, top = Math.max(peak, 1);
  $("spark-line").setAttribute("points", a.history.map((v, i) =>
    `${(i * w / Math.max(n - 1, 1)).toFixed(1)},${(h - 2 - (v / top) * (h - 4)).toFixed(1)}`).join(" "));
  $("acceptance").textContent = a.acceptance === null ? "n/a" : `${Math.round(a.acceptance * 100)}%`;
  $("acc-sub").textContent = a.drafted ? `${a.accepted} of ${a.drafted} drafted (last 20 requests)` : "no draft tokens yet";
  $("inflight").textContent = fmt(load.runs_in_flight);
  $("part-sub").textContent = load.partitions ? `${load.partitions - load.partitions_free} of ${load.partitions} KV partitions in use` : "";
  $("generating").textContent = fmt(load.generating);
  $("par-sub").textContent = s.parallel ? `up to ${s.parallel} at once` : "";
  $("queued").textContent = fmt(load.queued);
  const pc = load.prompt_cache;
  $("cache-sub").textContent = !pc ? "" : (pc.enabled ? `prompt cache: ${pc.tokens} tokens in ${pc.entries} entries` : "prompt cache off") +
    ` · cells used ${pc.cells_used} of ${pc.cells}`;
  $("done").textContent = fmt(a.requests_done);
  $("tok-sub").textContent = `${a.tokens_total} tokens streamed`;
  $("reforms").textContent = fmt(s.reforms);
  $("lost-sub").textContent = s.lost.length ? `${s.lost.length} rank(s) lost` : "no rank lost";
}

// ------------------------------------------------------------------ the cluster
function layerBar(layers, nLayers) {
  const NS = $("spark").namespaceURI;  // SVG's, from the page's own <svg>
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("viewBox", "0 0 100 8");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("class", "layerbar");
  const bg = document.createElementNS(NS, "rect");
  bg.setAttribute("x", 0); bg.setAttribute("y", 0); bg.setAttribute("width", 100); bg.setAttribute("height", 8);
  bg.setAttribute("class", "bg");
  svg.appendChild(bg);
  if (layers && nLayers) {
    const r = document.createElementNS(NS, "rect");
    r.setAttribute("x", 100 * layers[0] / nLayers); r.setAttribute("y", 0);
    r.setAttribute("width", 100 * (layers[1] - layers[0]) / nLayers); r.setAttribute("height", 8);
    r.setAttribute("class", "fg");
    svg.appendChild(r);
  }
  return svg;
}

function bytes(n) {
  return n >= 1e9 ? `${(n / 1e9).toFixed(2)} GB` : n >= 1e6 ? `${(n / 1e6).toFixed(1)} MB` : n >= 1e3 ? `${(n / 1e3).toFixed(1)} kB` : `${n} B`;
}

// a stage's busy share (its last few seconds) with a bar, and its counters since it started
function stageBlock(st) {
  const box = el("div", "stage");
  const pct = st.busy_share === null ? null : Math.round(st.busy_share * 100);
  box.appendChild(el("div", "busy-share", pct === null ? "busy n/a" : `busy ${pct}%`));
  const bar = el("div", "busybar"), fill = el("div", "fill");
  fill.style.width = `${pct || 0}%`;
  bar.appendChild(fill);
  box.appendChild(bar);
  box.appendChild(el("div", "stage-sub", `${st.n_decoded} runs · ${st.n_tokens} tokens · cancelled ${st.n_cancelled_before} + ${st.n_cancelled_mid} mid`));
  box.appendChild(el("div", "stage-sub", `busy ${fmt(st.t_busy_s, 1)} s · idle ${fmt(st.t_idle_s, 1)} s · sent ${bytes(st.bytes_sent)}`));
  return box;
}

function rankCard(r, nLayers) {
  const card = el("div", "rank" + (r.lost ? " lost" : "") + (r.draft ? " has-draft" : "") + (r.role === "draft" ? " draft-rank" : ""));
  if (r.rank !== null) card.dataset.rank = r.rank;
  if (r.lost) {
    card.appendChild(el("div", "rank-title", "LOST"));
    card.appendChild(el("div", "reason", r.reason));
    return card;
  }
  const title = el("div", "rank-title", `rank ${r.rank}`);
  if (r.head) title.appendChild(el("span", "tag head", "head"));
  if (r.role === "draft") title.appendChild(el("span", "tag", "draft rank"));
  card.appendChild(title);
  if (r.layers) {
    card.appendChild(el("div", "layers", `layers ${r.layers[0]}–${r.layers[1] - 1}`));
    card.appendChild(el("div", "layers-n", `${r.layers[1] - r.layers[0]} of ${nLayers} layers`));
    card.appendChild(layerBar(r.layers, nLayers));
  } else if (r.role !== "draft") {
    card.appendChild(el("div", "layers unknown", "layers n/a"));
  }
  card.appendChild(el("div", "threads", r.threads ? `${r.threads} thread${r.threads > 1 ? "s" : ""}` : "threads n/a"));
  if (r.pid) card.appendChild(el("div", "pid", `pid ${r.pid}`));
  if (r.stage) card.appendChild(stageBlock(r.stage));
  if (r.draft) {
    const d = r.draft;
    card.appendChild(el("div", "draft", `✎ draft: ${d.kind}${d.threads ? ` · ${d.threads} thr` : ""}`));
    card.appendChild(el("div", "draft-where", d.where));
  }
  return card;
}

function drawCluster(s) {
  const c = s.cluster, box = $("hosts");
  const live = c.ranks.filter((r) => !r.lost).length;
  $("cluster-sub").textContent = `${c.hosts.length} host${c.hosts.length === 1 ? "" : "s"} · ${live} rank${live === 1 ? "" : "s"}` +
    (c.n_layers ? ` · ${c.n_layers} layers` : "") + (c.supervised ? " · supervised" : "") +
    (c.stale ? " · showing the last job while the pipeline re-forms" : "");
  box.replaceChildren();
  if (!c.hosts.length) box.appendChild(el("div", "empty", "no cluster information from this generator"));
  for (const h of c.hosts) {
    const hb = el("div", "host" + (h.lost ? " lost" : "") + (c.stale ? " stale" : ""));
    hb.dataset.host = h.name;
    const head = el("div", "host-title");
    head.appendChild(el("span", "host-name", h.name));
    if (h.mem_gib !== null) head.appendChild(el("span", "host-mem", `${h.mem_gib} GiB free at start`));
    hb.appendChild(head);
    if (h.lost) hb.appendChild(el("div", "host-lost", "host lost: " + h.reason));
    const ranks = el("div", "host-ranks");
    for (const r of h.ranks) ranks.appendChild(rankCard(r, c.n_layers));
    hb.appendChild(ranks);
    box.appendChild(hb);
  }
  $("busy-note").textContent = s.busy === null ? "Per-stage busy share: no stage has reported yet." : "Per-stage " + s.busy_note + ".";
}

function drawLogs(s) {
  const ev = $("events");
  ev.replaceChildren();
  if (!s.events.length) ev.appendChild(el("li", "empty", "none"));
  for (const e of s.events) {
    const li = el("li", /fatal|lost|re-forming/.test(e.line) ? "bad" : "");
    li.appendChild(el("span", "when", ago(e.at)));
    li.appendChild(el("span", "line", e.line));
    ev.appendChild(li);
  }
  const tb = $("recent");
  tb.replaceChildren();
  if (!s.activity.recent.length) {
    const tr = el("tr"), td = el("td", "empty", "none yet");
    td.colSpan = 6; tr.appendChild(td); tb.appendChild(tr);
  }
  for (const r of s.activity.recent) {
    const tr = el("tr");
    for (const v of [r.id.slice(0, 8), r.tokens, fmt(r.tokens_per_s, 1), `${fmt(r.ttft_s, 2)} s`,
                     r.acceptance === null ? "n/a" : `${Math.round(r.acceptance * 100)}%`, r.finish])
      tr.appendChild(el("td", "", v));
    tb.appendChild(tr);
  }
}

function drawHeader(s) {
  state.model = s.model;
  $("model").textContent = s.model;
  $("meta").textContent = [s.cluster.mode && `mode ${s.cluster.mode}`, `${s.n_ranks} rank${s.n_ranks === 1 ? "" : "s"}`,
    `context ${s.n_ctx}`, `up ${Math.round(s.uptime_s)} s`].filter(Boolean).join(" · ");
  const pill = $("status");
  pill.textContent = s.status === "ok" ? (s.phase === "serving" ? "OK · serving" : `OK · ${s.phase}`) : `${s.status.toUpperCase()} · ${s.phase}`;
  pill.className = "pill " + s.status;
  const banner = $("banner");
  let msg = "";
  if (s.error) msg = `The pipeline failed: ${s.error}`;
  else if (s.phase === "re-forming") msg = "A rank was lost: the pipeline is re-forming on the hosts left; requests in flight resume after it.";
  else if (s.lost.length) msg = `Degraded: lost ${s.lost.join("; ")}`;
  banner.hidden = !msg;
  banner.textContent = msg;
  banner.className = "banner " + (s.error ? "error" : "degraded");
}

async function poll() {
  try {
    const r = await fetch("/state", { headers: authHeaders(), cache: "no-store" });
    if (r.status === 401) throw new Error("this server needs an API key: enter it below the chat");
    if (!r.ok) throw new Error(`GET /state: ${r.status}`);
    const s = await r.json();
    drawHeader(s); drawNumbers(s); drawCluster(s); drawLogs(s);
    document.body.dataset.updated = String(s.time);
  } catch (e) {
    const pill = $("status");
    pill.textContent = "unreachable";
    pill.className = "pill error";
    const banner = $("banner");
    banner.hidden = false; banner.className = "banner error";
    banner.textContent = `No state from the server: ${e.message}`;
  }
}

// ------------------------------------------------------------------ the chat
function addMessage(role, text) {
  const m = el("div", "msg " + role);
  m.appendChild(el("div", "who", role === "user" ? "you" : role));
  const body = el("div", "text", text);
  m.appendChild(body);
  $("chat-log").appendChild(m);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return m;
}

async function send(text) {
  const max = parseInt($("chat-max").value, 10) || 64;
  const temp = parseFloat($("chat-temp").value) || 0;
  state.chat.push({ role: "user", content: text });
  addMessage("user", text);
  const msg = addMessage("assistant", "");
  const out = msg.querySelector(".text");
  msg.classList.add("streaming");
  const controller = new AbortController();
  state.abort = controller;
  $("chat-send").disabled = true; $("chat-stop").disabled = false;
  const t0 = performance.now();
  let tFirst = null, pieces = 0, answer = "", finish = null, failure = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify({ model: state.model, messages: state.chat, stream: true, max_tokens: max, temperature: temp }),
    });
    if (!r.ok) {
      let why = `${r.status}`;
      try { why += ": " + (await r.json()).error.message; } catch (_) { /* not JSON */ }
      throw new Error(why);
    }
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "", over = false;
    while (!over) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut); buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") { over = true; break; }
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          for (const ch of chunk.choices || []) {
            const piece = (ch.delta && ch.delta.content) || "";
            if (piece) {
              if (tFirst === null) tFirst = performance.now();
              answer += piece; pieces += 1;
              out.textContent = answer;
              $("chat-log").scrollTop = $("chat-log").scrollHeight;
            }
            if (ch.finish_reason) finish = ch.finish_reason;
          }
        }
      }
    }
  } catch (e) {
    failure = e.name === "AbortError" ? "stopped" : e.message;
  }
  msg.classList.remove("streaming");
  if (failure && failure !== "stopped") msg.appendChild(el("div", "error", failure));
  state.chat.push({ role: "assistant", content: answer });
  const secs = (performance.now() - t0) / 1000;
  $("chat-stats").textContent = `${pieces} pieces in ${secs.toFixed(2)} s` +
    (tFirst !== null ? ` · first after ${((tFirst - t0) / 1000).toFixed(2)} s` : "") + (finish ? ` · ${finish}` : "") +
    (failure ? ` · ${failure}` : "");
  msg.dataset.done = failure ? "error" : "ok";
  state.abort = null;
  $("chat-send").disabled = false; $("chat-stop").disabled = true;
}

function setupChat() {
  const key = sessionStorage.getItem("pipeinfer-key");
  if (key) $("chat-key").value = key;
  $("chat-key").addEventListener("change", () => sessionStorage.setItem("pipeinfer-key", $("chat-key").value.trim()));
  $("chat-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("chat-input").value.trim();
    if (!text || state.abort) return;
    $("chat-input").value = "";
    send(text);
  });
  $("chat-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("chat-form").requestSubmit(); }
  });
  $("chat-stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("chat-new").addEventListener("click", () => { state.chat = []; $("chat-log").replaceChildren(); $("chat-stats").textContent = ""; });
}

setupChat();
poll();
setInterval(poll, 1000);
