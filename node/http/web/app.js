// exo-node's page: a chat with this node's OpenAI-compatible API, and a live view of the cluster behind it.
// Plain JS with no build step and nothing loaded from elsewhere (nodes may have no internet).
// Text from the API is only ever set as textContent, never parsed as HTML.
"use strict";

const $ = (selector) => document.querySelector(selector);
const KEY_STORAGE = "exo-node-api-key";
const POLL_MS = 1000;
const RATE_WINDOW_MS = 5000; // rates are averaged over this much of each node's own clock
const COLORS = ["#2f6fde", "#d9480f", "#2b8a3e", "#862e9c", "#c2255c", "#0b7285", "#e67700", "#5f3dc4"];

const state = {
  key: localStorage.getItem(KEY_STORAGE) || "",
  history: [], // the conversation sent with each request
  controller: null, // AbortController of the request in flight
  samples: new Map(), // node id -> recent status snapshots, for rates
  known: null, // node ids seen at the last poll, for join/leave events
};

class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

// -- talking to the API ------------------------------------------------------------------------------------------
async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (state.key) headers.Authorization = `Bearer ${state.key}`;
  const response = await fetch(path, { ...options, headers });
  if (!response.ok) {
    const body = await response.json().catch(() => null);
    const message = body?.error?.message || `${response.status} ${response.statusText}`;
    if (response.status === 401) askForKey(state.key ? "The API key was refused: " + message : message);
    throw new ApiError(message, response.status);
  }
  return response;
}

function askForKey(message) {
  $("#key-message").textContent = message;
  if (!$("#key-form").hidden) return; // already asking: don't steal the focus every poll
  $("#key-form").hidden = false;
  $("#key-input").focus();
}

// Server-sent events of a streamed completion: yields each `data:` payload.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

// -- chat --------------------------------------------------------------------------------------------------------
function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  const span = document.createElement("span");
  span.className = "text";
  span.textContent = text;
  div.append(span);
  $("#messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function setMeta(div, text) {
  const meta = div.querySelector(".meta") || div.appendChild(document.createElement("span"));
  meta.className = "meta";
  meta.textContent = text;
}

function showError(message) {
  addMessage("error", message).dataset.error = "true";
}

function requestBody(history) {
  const body = { model: $("#model").value, messages: history, stream: true,
                 stream_options: { include_usage: true } };
  const temperature = $("#temperature").value.trim();
  const maxTokens = $("#max-tokens").value.trim();
  const stop = $("#stop").value.split("|").filter((s) => s.length > 0);
  if (temperature !== "") body.temperature = Number(temperature);
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  if (stop.length) body.stop = stop;
  return body;
}

async function send(text) {
  const history = state.history; // "New chat" may replace it while this answer streams
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  const out = div.querySelector(".text");
  div.dataset.state = "streaming";
  div.dataset.chunks = "0";
  const controller = (state.controller = new AbortController());
  setBusy(true);
  const started = performance.now();
  let firstAt = null, finish = null, usage = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody(history)), signal: controller.signal,
    });
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(chunk.error.message); // an error after the stream started
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      if (choice.delta?.content) {
        firstAt ??= performance.now();
        out.textContent += choice.delta.content;
        div.dataset.chunks = String(Number(div.dataset.chunks) + 1);
        div.scrollIntoView({ block: "end" });
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    if (!finish) throw new ApiError("the answer broke off: the connection to the node was lost");
    div.dataset.state = "done";
    div.dataset.finish = finish || "";
    history.push({ role: "assistant", content: out.textContent });
    setMeta(div, describe(usage, started, firstAt, finish));
  } catch (error) {
    if (error.name === "AbortError") {
      div.dataset.state = "stopped";
      setMeta(div, "stopped");
      history.push({ role: "assistant", content: out.textContent });
    } else {
      div.dataset.state = "failed";
      if (!out.textContent) div.remove();
      history.pop(); // the question goes unanswered: let it be asked again
      showError(error instanceof ApiError ? error.message : `request failed: ${error.message}`);
    }
  } finally {
    if (state.controller === controller) state.controller = null;
    setBusy(false);
  }
}

function describe(usage, started, firstAt, finish) {
  const seconds = (performance.now() - started) / 1000;
  const parts = [];
  if (usage) parts.push(`${usage.completion_tokens} tokens`);
  parts.push(`${seconds.toFixed(2)} s`);
  if (firstAt !== null) parts.push(`first token ${((firstAt - started) / 1000).toFixed(2)} s`);
  if (usage && usage.completion_tokens > 1 && firstAt !== null) {
    const decode = (performance.now() - firstAt) / 1000;
    if (decode > 0) parts.push(`${((usage.completion_tokens - 1) / decode).toFixed(1)} tok/s`);
  }
  if (finish) parts.push(`finish: ${finish}`);
  return parts.join(" · ");
}

function setBusy(busy) {
  $("#send").disabled = busy;
  $("#stop-button").disabled = !busy;
}

async function loadModels() {
  try {
    const models = await (await api("/v1/models")).json();
    const select = $("#model");
    select.replaceChildren(...models.data.map((m) => new Option(m.id, m.id)));
  } catch (error) {
    if (error.status !== 401) showError(`cannot list models: ${error.message}`); // 401: the key form asks
  }
}

// -- cluster view ------------------------------------------------------------------------------------------------
const gib = (bytes) => `${(bytes / 2 ** 30).toFixed(1)} GiB`;
const mib = (bytes) => `${(bytes / 2 ** 20).toFixed(1)} MiB`;

// Rate of a counter over the last few seconds of the node's own clock (status.uptime_ms), so a peer's status that
// arrives late through a health check still gives the right rate.
function rate(nodeId, key, per = "uptime_ms") {
  const samples = state.samples.get(nodeId) || [];
  if (samples.length < 2) return null;
  const a = samples[0], b = samples[samples.length - 1];
  const span = per === "uptime_ms" ? (b.uptime_ms - a.uptime_ms) / 1000 : (b[per] || 0) - (a[per] || 0);
  return span > 0 ? ((b[key] || 0) - (a[key] || 0)) / span : null;
}

function remember(node) {
  const status = node.status || {};
  if (status.uptime_ms === undefined) return;
  const samples = state.samples.get(node.node_id) || [];
  const last = samples[samples.length - 1];
  if (last && status.uptime_ms < last.uptime_ms) samples.length = 0; // the node restarted
  if (!last || status.uptime_ms > last.uptime_ms) samples.push({ ...status });
  while (samples.length > 2 && samples[samples.length - 1].uptime_ms - samples[1].uptime_ms >= RATE_WINDOW_MS) {
    samples.shift();
  }
  state.samples.set(node.node_id, samples);
}

function layerRanges(topology) {
  // node id -> "start:end" as the entry would plan a request now; a node's loaded shards otherwise
  const ranges = new Map();
  for (const step of topology.plan || []) ranges.set(step.node_id, `${step.start}:${step.end}`);
  for (const node of topology.nodes) {
    if (!ranges.has(node.node_id) && node.pinned) ranges.set(node.node_id, `${node.pinned[0]}:${node.pinned[1]}`);
  }
  return ranges;
}

function drawLayers(topology, ranges, colors) {
  const n = topology.model.n_layers;
  const bar = $("#layers");
  const segments = [...ranges].map(([id, r]) => ({ id, start: Number(r.split(":")[0]), end: Number(r.split(":")[1]) }))
    .sort((x, y) => x.start - y.start);
  const parts = [];
  let at = 0;
  for (const s of segments) {
    if (s.start > at) parts.push(segment(null, at, s.start, n));
    parts.push(segment(s.id, s.start, s.end, n, colors.get(s.id)));
    at = Math.max(at, s.end);
  }
  if (at < n) parts.push(segment(null, at, n, n));
  bar.replaceChildren(...parts);
}

function segment(nodeId, start, end, n, color) {
  const div = document.createElement("div");
  div.className = nodeId ? "segment" : "segment uncovered";
  div.style.flex = String(end - start);
  if (color) div.style.background = color;
  const layers = end - start === 1 ? `layer ${start}` : `layers ${start}–${end - 1}`;
  div.textContent = `${nodeId || "not covered"} · ${start === end - 1 ? start : `${start}–${end - 1}`}`;
  div.title = `${nodeId || "not covered"}: ${layers} of ${n}`;
  if (nodeId) div.dataset.nodeId = nodeId;
  return div;
}

function batchSizes(status) {
  return Object.entries(status)
    .filter(([k]) => k.startsWith("sample_batch_size_"))
    .map(([k, v]) => [Number(k.slice("sample_batch_size_".length)), v])
    .sort((a, b) => a[0] - b[0])
    .map(([size, count]) => `${size}×${count}`).join(" ") || "–";
}

// Which of the model's files a node holds: all of them, or (a node that fetches its layers from a peer) what its
// fetch is doing, else the layers it has verified so far.
function files(availability) {
  const a = availability || { complete: true };
  if (a.complete) return "whole model";
  if (a.note) return a.note;
  const runs = (a.layers || []).map(([s, e]) => (e - s === 1 ? `${s}` : `${s}–${e - 1}`));
  return runs.length ? `layers ${runs.join(", ")} (fetched)` : "none yet";
}

function nodeCard(node, index, range, color, nLayers) {
  const status = node.status || {};
  const card = document.createElement("div");
  card.className = "node";
  card.dataset.nodeId = node.node_id;
  card.dataset.layers = range || "";
  card.style.borderLeftColor = color;
  const title = document.createElement("div");
  title.className = "title";
  const name = document.createElement("span");
  name.textContent = node.node_id + (index === 0 ? " (this node)" : "");
  const badge = document.createElement("span");
  badge.className = node.active_requests > 0 ? "badge busy" : "badge";
  badge.textContent = node.active_requests > 0 ? `busy: ${node.active_requests} in flight` : "idle";
  title.append(name, badge);
  const tokps = rate(node.node_id, "step_positions");
  const rows = rate(node.node_id, "step_rows", "steps");
  const [start, end] = range ? range.split(":").map(Number) : [null, null];
  const fields = [
    ["layers", range ? `${end - start === 1 ? start : `${start}–${end - 1}`} of ${nLayers}` : "none"],
    ["address", node.address],
    ["engine", node.capabilities.engine],
    ["device", node.capabilities.device || "CPU"],
    ["memory", node.capabilities.device
      ? `${gib(node.capabilities.memory_bytes)} on the GPU, ${gib(node.capabilities.host_memory_bytes || 0)} host`
      : gib(node.capabilities.memory_bytes)],
    ["in flight", String(node.active_requests)],
    ["tok/s", tokps === null ? "–" : tokps.toFixed(1)],
    ["rows/step", rows === null ? "–" : rows.toFixed(2)],
    ["KV cache", mib(status.kv_cache_bytes || 0)],
    ["files", files(node.availability)],
    ["loaded", node.loaded.join(", ") || "nothing yet"],
    ["sample batches", batchSizes(status)],
  ];
  const dl = document.createElement("dl");
  for (const [label, value] of fields) {
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = label;
    dd.textContent = value;
    dd.dataset.field = label;
    dl.append(dt, dd);
  }
  card.append(title, dl);
  return card;
}

function logEvent(text) {
  const li = document.createElement("li");
  li.textContent = `${new Date().toLocaleTimeString()} ${text}`;
  $("#events").prepend(li);
}

function renderCluster(topology) {
  const ids = topology.nodes.map((n) => n.node_id);
  if (state.known === null) logEvent(`${ids.length} node(s): ${ids.join(", ")}`);
  else {
    for (const id of ids) if (!state.known.has(id)) logEvent(`${id} joined`);
    for (const id of state.known) if (!ids.includes(id)) { logEvent(`${id} left`); state.samples.delete(id); }
  }
  state.known = new Set(ids);
  topology.nodes.forEach(remember);
  const colors = new Map(ids.map((id, i) => [id, COLORS[i % COLORS.length]]));
  const ranges = layerRanges(topology);
  drawLayers(topology, ranges, colors);
  $("#nodes").replaceChildren(...topology.nodes.map((n, i) =>
    nodeCard(n, i, ranges.get(n.node_id), colors.get(n.node_id), topology.model.n_layers)));
  const generated = ids.map((id) => rate(id, "sample_items") || 0).reduce((a, b) => a + b, 0);
  $("#summary").textContent = `${topology.model.id} · ${topology.model.n_layers} layers · ${ids.length} node(s) · ` +
    `${generated.toFixed(1)} tok/s generated`;
  const error = $("#cluster-error");
  error.hidden = !topology.plan_error;
  error.textContent = topology.plan_error ? `no plan: ${topology.plan_error}` : "";
}

async function poll() {
  try {
    renderCluster(await (await api("/v1/topology")).json());
  } catch (error) {
    const el = $("#cluster-error");
    el.hidden = false;
    el.textContent = `cluster view: ${error.message}`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

// -- wiring ------------------------------------------------------------------------------------------------------
function start() {
  $("#composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("#prompt").value;
    if (!text.trim() || state.controller) return;
    $("#prompt").value = "";
    send(text);
  });
  $("#prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("#composer").requestSubmit();
    }
  });
  $("#stop-button").addEventListener("click", () => state.controller?.abort());
  $("#clear").addEventListener("click", () => {
    state.controller?.abort();
    state.history = [];
    $("#messages").replaceChildren();
  });
  $("#key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.key = $("#key-input").value.trim();
    localStorage.setItem(KEY_STORAGE, state.key);
    $("#key-form").hidden = true;
    loadModels();
  });
  loadModels();
  poll();
}

start();
