// fulcrum's page: a chat playground on the server's own OpenAI API, and a live view of the
// scheduler from /dashboard/state. Plain JavaScript, no dependencies, charts on canvas.
"use strict";

const $ = (id) => document.getElementById(id);
const store = {
  get: (key, fallback) => JSON.parse(localStorage.getItem("fulcrum." + key) || "null") ?? fallback,
  set: (key, value) => localStorage.setItem("fulcrum." + key, JSON.stringify(value)),
};

// ------------------------------------------------------------------ API access
let keyWaiters = [];
// Cancelled: refusals ask no more (the dashboard's poll re-opened it every second) until a
// key is saved from the "API key" button.
let keyDeclined = false;

function askForKey() {
  $("key-dialog").classList.remove("hidden");
  $("key-input").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

function closeKeyDialog(saved) {
  keyDeclined = !saved;
  $("key-dialog").classList.add("hidden");
  keyWaiters.forEach((resolve) => resolve(saved));
  keyWaiters = [];
}

async function api(path, options = {}, retry = true) {
  const headers = Object.assign({ "Content-Type": "application/json" }, options.headers || {});
  const key = store.get("apiKey", "");
  if (key) headers["Authorization"] = "Bearer " + key;
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (response.status === 401 && retry && !keyDeclined && (await askForKey())) return api(path, options, false);
  return response;
}

// ------------------------------------------------------------------ tabs
function show(view) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === view);
  $("playground").classList.toggle("hidden", view !== "playground");
  $("dashboard").classList.toggle("hidden", view !== "dashboard");
  store.set("view", view);
  if (view === "dashboard") poll();
}

// ------------------------------------------------------------------ playground
let conversations = store.get("conversations", []);
let current = store.get("current", null);
let modelName = null;

function conversation() {
  let found = conversations.find((c) => c.id === current);
  if (!found) {
    found = { id: String(Date.now()), title: "New chat", messages: [] };
    conversations.unshift(found);
    current = found.id;
  }
  return found;
}

function save() {
  store.set("conversations", conversations.slice(0, 50));
  store.set("current", current);
}

function renderConversations() {
  const list = $("conversations");
  list.innerHTML = "";
  for (const c of conversations) {
    const item = document.createElement("li");
    item.textContent = c.title;
    item.classList.toggle("active", c.id === current);
    item.onclick = () => { current = c.id; save(); renderAll(); };
    list.appendChild(item);
  }
}

function messageElement(message) {
  const box = document.createElement("div");
  box.className = "message " + message.role;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role;
  box.appendChild(role);
  if (message.reasoning) box.appendChild(reasoningElement(message.reasoning));
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = message.content;
  box.appendChild(content);
  if (message.stats) {
    const stats = document.createElement("div");
    stats.className = "reply-stats";
    stats.textContent = message.stats;
    box.appendChild(stats);
  }
  return box;
}

// A reasoning model's thinking (the server's --reasoning-parser), folded away once done.
function reasoningElement(text) {
  const box = document.createElement("details");
  box.className = "reasoning";
  const summary = document.createElement("summary");
  summary.textContent = "thinking";
  const body = document.createElement("div");
  body.className = "reasoning-text";
  body.textContent = text;
  box.append(summary, body);
  return box;
}

function renderMessages() {
  const box = $("messages");
  box.innerHTML = "";
  for (const m of conversation().messages) box.appendChild(messageElement(m));
  box.scrollTop = box.scrollHeight;
}

function renderAll() { renderConversations(); renderMessages(); }

function requestMessages(c) {
  const system = $("system-prompt").value.trim();
  const history = c.messages.filter((m) => !m.error).map((m) => ({ role: m.role, content: m.content }));
  return system ? [{ role: "system", content: system }, ...history] : history;
}

function samplingBody() {
  const body = {
    temperature: parseFloat($("temperature").value),
    top_p: parseFloat($("top-p").value),
    max_tokens: parseInt($("max-tokens").value, 10),
  };
  const stop = $("stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) body.stop = stop;
  if ($("seed").value !== "") body.seed = parseInt($("seed").value, 10);
  if (modelName) body.model = modelName;
  return body;
}

// OpenAI's server-sent events: "data: {json}" blocks separated by blank lines.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send() {
  const text = $("chat-input").value.trim();
  if (!text) return;
  const c = conversation();
  if (!c.messages.length) c.title = text.slice(0, 40);
  c.messages.push({ role: "user", content: text });
  $("chat-input").value = "";
  const reply = { role: "assistant", content: "", reasoning: "" };
  c.messages.push(reply);
  save();
  renderAll();
  const replyBox = $("messages").lastChild;
  const content = replyBox.querySelector(".content");
  let thinking = null;
  const sent = performance.now();
  let first = null, last = null, chunks = 0, usage = null;
  $("send").disabled = true;
  try {
    const body = Object.assign(samplingBody(), {
      messages: requestMessages(c).slice(0, -1), stream: true, stream_options: { include_usage: true } });
    const response = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body) });
    if (!response.ok) throw new Error((await response.json()).error?.message || response.statusText);
    for await (const event of events(response)) {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      const delta = event.choices?.[0]?.delta || {};
      const thought = delta.reasoning ?? delta.reasoning_content;
      // The finishing event is the last token's even without text (EOS, a stop string):
      // a TPOT ending at the last text misses a gap and reads low on short replies.
      const finished = Boolean(event.choices?.[0]?.finish_reason);
      if (delta.content || thought || finished) {
        const now = performance.now();
        if (first === null) first = now;
        last = now;
        if (delta.content || thought) chunks += 1;
      }
      if (thought) {
        if (thinking === null) {
          replyBox.insertBefore(reasoningElement(""), content);
          thinking = replyBox.querySelector(".reasoning");
          thinking.open = true;
        }
        reply.reasoning += thought;
        thinking.querySelector(".reasoning-text").textContent = reply.reasoning;
      }
      if (delta.content) {
        reply.content += delta.content;
        content.textContent = reply.content;
      }
      $("messages").scrollTop = $("messages").scrollHeight;
    }
    const tokens = usage ? usage.completion_tokens : chunks;
    const parts = [];
    if (first !== null) parts.push(`TTFT ${(first - sent).toFixed(0)} ms`);
    if (tokens > 1 && last > first) parts.push(`TPOT ${((last - first) / (tokens - 1)).toFixed(1)} ms`);
    if (last !== null) parts.push(`${(tokens / ((last - sent) / 1000)).toFixed(1)} tokens/s`);
    parts.push(`${tokens} tokens`);
    reply.stats = parts.join(" · ");
  } catch (error) {
    reply.error = true;
    reply.stats = "error: " + error.message;
  } finally {
    $("send").disabled = false;
    save();
    renderMessages();
  }
}

async function showPrompt() {
  const box = $("rendered-prompt");
  if (!box.classList.contains("hidden")) { box.classList.add("hidden"); return; }
  const messages = requestMessages(conversation());
  const tokenized = await api("/tokenize", { method: "POST", body: JSON.stringify({ messages }) });
  const body = await tokenized.json();
  if (!tokenized.ok) { box.textContent = body.error?.message || "error"; box.classList.remove("hidden"); return; }
  const text = await api("/detokenize", { method: "POST",
    body: JSON.stringify({ tokens: body.tokens, skip_special_tokens: false }) });
  box.textContent = `${body.count} tokens:\n` + (await text.json()).prompt;
  box.classList.remove("hidden");
}

// ------------------------------------------------------------------ dashboard
const HISTORY = 120;  // steps and polls kept for the charts
let lastStep = -1, stepsSeen = 0, steps = [], polls = [], polling = null, run = null;

function fmt(value, digits = 0) { return value === null || value === undefined ? "-" : value.toFixed(digits); }
function triple(p) { return p ? `${fmt(p.median)} / ${fmt(p.p90)} / ${fmt(p.p99)}` : "-"; }

async function poll() {
  clearTimeout(polling);
  if ($("dashboard").classList.contains("hidden") || document.hidden) return;
  try {
    const response = await api(`/dashboard/state?since=${lastStep}`);
    if (response.ok) update(await response.json());
  } finally {
    polling = setTimeout(poll, 1000);
  }
}

function update(state) {
  if (state.run !== run) {  // another engine (fulcrum demo runs several): start over
    if (run !== null && lastStep >= 0) { run = state.run; lastStep = -1; steps = []; return; }
    run = state.run;
  }
  for (const s of state.steps) {
    steps.push(s);
    lastStep = s.step;
    stepsSeen += 1;
  }
  steps = steps.slice(-HISTORY);
  polls.push({ running: state.queues.running, waiting: state.queues.waiting,
               kv: 100 * state.kv.usage, hits: 100 * (state.kv.prefix_cache_hit_rate || 0) });
  polls = polls.slice(-HISTORY);
  const config = state.config;
  // Behind a data-parallel router: one replica's numbers, which must not pass for the server's.
  const replica = state.data_parallel ? ` · replica ${state.data_parallel.engine} of ${state.data_parallel.size} (its numbers alone; /metrics has all)` : "";
  $("model-name").textContent = `${config.model} · ${config.policy} policy · budget ${config.max_num_batched_tokens} tokens${replica}`;
  $("q-running").textContent = state.queues.running;
  $("q-waiting").textContent = state.queues.waiting;
  $("q-preempted").textContent = state.queues.preempted;
  $("kv-usage").textContent = `${(100 * state.kv.usage).toFixed(1)}%`;
  $("kv-blocks").textContent = `${state.kv.blocks_used} / ${state.kv.blocks_total} blocks`;
  const hits = state.kv.prefix_cache_hit_rate;
  $("hit-rate").textContent = hits === null ? "-" : `${(100 * hits).toFixed(0)}%`;
  $("throughput").textContent = fmt(state.throughput.tokens_per_s);
  $("ttft").textContent = triple(state.latency.ttft_ms);
  $("tpot").textContent = triple(state.latency.tpot_ms);
  const share = state.latency.slo_met_share;
  $("slo-share").textContent = share === null ? "-" : `${(100 * share).toFixed(0)}%`;
  $("slo-targets").textContent = `targets: TTFT ${fmt(config.slo_ttft_ms)} ms, TPOT ${fmt(config.slo_tpot_ms)} ms`;
  $("step-count").textContent = stepsSeen;
  drawSteps(config.max_num_batched_tokens);
  drawLines($("chart-queues"), [[polls.map((p) => p.running), "#2f9e44"], [polls.map((p) => p.waiting), "#d6336c"]]);
  drawLines($("chart-time"), [[steps.map((s) => s.wall_ms), "#1d2430"], [steps.map((s) => s.predicted_ms), "#9b59b6"]]);
  drawLines($("chart-cache"), [[polls.map((p) => p.kv), "#0c8599"], [polls.map((p) => p.hits), "#f08c00"]]);
  const body = $("requests-table").querySelector("tbody");
  body.innerHTML = "";
  for (const r of state.requests) {
    const row = document.createElement("tr");
    for (const cell of [r.id, r.state, r.age_s.toFixed(1), r.prompt_tokens, r.computed_tokens, r.output_tokens]) {
      const td = document.createElement("td");
      td.textContent = cell;
      row.appendChild(td);
    }
    body.appendChild(row);
  }
}

function axes(context, width, height, top) {
  context.clearRect(0, 0, width, height);
  context.fillStyle = "#7a8596";
  context.font = "11px system-ui";
  context.fillText(top.toFixed(0), 2, 12);
  context.fillText("0", 2, height - 2);
}

function drawSteps(budget) {
  const canvas = $("chart-steps"), context = canvas.getContext("2d");
  const { width, height } = canvas;
  const top = Math.max(budget, ...steps.map((s) => s.prefill + s.decode), 1);
  axes(context, width, height, top);
  const bar = (width - 40) / HISTORY, scale = (height - 16) / top;
  steps.forEach((s, i) => {
    const x = 36 + i * bar, decode = s.decode * scale, prefill = s.prefill * scale;
    context.fillStyle = "#2f6fde";
    context.fillRect(x, height - decode, Math.max(bar - 1, 1), decode);
    context.fillStyle = "#e07b1a";
    context.fillRect(x, height - decode - prefill, Math.max(bar - 1, 1), prefill);
  });
  context.strokeStyle = "#1d2430";
  context.setLineDash([4, 3]);
  context.beginPath();
  context.moveTo(36, height - budget * scale);
  context.lineTo(width, height - budget * scale);
  context.stroke();
  context.setLineDash([]);
  canvas.dataset.points = steps.length;
}

function drawLines(canvas, series) {
  const context = canvas.getContext("2d");
  const { width, height } = canvas;
  const top = Math.max(1, ...series.flatMap(([values]) => values));
  axes(context, width, height, top);
  const step = (width - 40) / HISTORY, scale = (height - 16) / top;
  for (const [values, color] of series) {
    context.strokeStyle = color;
    context.beginPath();
    values.forEach((v, i) => {
      const x = 36 + i * step, y = height - v * scale;
      if (i) context.lineTo(x, y); else context.moveTo(x, y);
    });
    context.stroke();
  }
  canvas.dataset.points = Math.max(0, ...series.map(([values]) => values.length));
}

async function fireLoad() {
  const response = await api("/dashboard/load", { method: "POST" });
  const body = await response.json();
  $("load-status").textContent = response.ok
    ? `load started: one ${body.long_tokens}-token prompt, ${body.short_requests} of ${body.short_tokens} tokens every ${body.interval_s} s`
    : (body.error?.message || body.error || response.statusText);
}

// ------------------------------------------------------------------ wiring
async function start() {
  for (const tab of document.querySelectorAll(".tab")) tab.onclick = () => show(tab.dataset.view);
  $("new-chat").onclick = () => { current = null; conversation(); save(); renderAll(); };
  $("send").onclick = send;
  $("chat-input").onkeydown = (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } };
  $("show-prompt").onclick = showPrompt;
  $("fire-load").onclick = fireLoad;
  $("key-button").onclick = askForKey;
  $("key-save").onclick = () => { store.set("apiKey", $("key-input").value); closeKeyDialog(true); };
  $("key-cancel").onclick = () => closeKeyDialog(false);
  document.addEventListener("visibilitychange", poll);
  conversation();
  renderAll();
  show(store.get("view", "playground"));
  const models = await api("/v1/models");
  if (models.ok) {
    modelName = (await models.json()).data[0].id;
    if (!$("model-name").textContent) $("model-name").textContent = modelName;
  }
}

start();
