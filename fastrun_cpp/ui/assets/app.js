// fastrun-cpp's web page: chat with a served model, and (for an admin key, or a server open on
// loopback) watch the server work. Everything it shows comes from this server's own API, with the
// API's keys: the page holds no data of its own but the conversations kept in this browser.
//
// What a model writes is untrusted: answers are rendered by markdown-it with raw HTML off and
// images off, then sanitized by DOMPurify; everything else a model or a user wrote goes in as
// text (textContent), never as HTML. The server's Content-Security-Policy stops the rest.

import markdownit from "./vendor/markdown-it.mjs";
import DOMPurify from "./vendor/purify.mjs";
import uPlot from "./vendor/uPlot.mjs";
import { createParser } from "./vendor/eventsource-parser.mjs";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "fastrun-key";              // sessionStorage: this tab only
const CONVERSATIONS_STORAGE = "fastrun-conversations";  // localStorage: kept in this browser
const SERVER_POLL_MS = 2000;
const CHART_SAMPLES = 150;                       // 5 minutes at one read every 2 s

// ---------------------------------------------------------------- rendering what a model wrote

const markdown = markdownit({ html: false, linkify: false, typographer: false }).disable(["image"]);
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
});
const SANITIZE = {
  FORBID_TAGS: ["img", "svg", "math", "style", "form", "input", "button", "iframe", "object", "embed",
                "video", "audio", "source", "picture", "link", "meta"],
  FORBID_ATTR: ["style", "srcset", "src", "action", "formaction", "background", "poster"],
  ALLOWED_URI_REGEXP: /^(?:https?:|mailto:|#)/i,
};

function renderMarkdown(element, text) {
  element.replaceChildren(DOMPurify.sanitize(markdown.render(text), { ...SANITIZE, RETURN_DOM_FRAGMENT: true }));
}

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  node.append(...children.filter((child) => child !== null && child !== undefined));
  return node;
}

function showBanner(text) {
  $("banner").textContent = text;
  $("banner").hidden = !text;
}

// ---------------------------------------------------------------- the API, with the tab's key

let keyWaiters = [];  // answers waiting for a key: { resolve, reject }

class APIError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers.Authorization = `Bearer ${key}`;
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method: options.method || (options.body !== undefined ? "POST" : "GET"),
    headers,
    body: options.body !== undefined ? JSON.stringify(options.body) : undefined,
    signal: options.signal,
  });
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      message = body?.error?.message || body?.detail || message;
    } catch { /* not JSON */ }
    if (response.status === 401 && !options.noKeyPrompt) askForKey(message);
    throw new APIError(response.status, message);
  }
  return response;
}

function askForKey(reason) {
  $("key-input").value = "";
  $("key-reason").textContent = reason || "";
  if (!$("key-dialog").open) $("key-dialog").showModal();
}

function waitForKey() {
  return new Promise((resolve, reject) => keyWaiters.push({ resolve, reject }));
}

// The dialog closes with a key entered (answers waiting send again with it) or without one
// (Escape, "Forget key"): answers waiting end with the server's refusal.
$("key-dialog").addEventListener("close", () => {
  const waiters = keyWaiters;
  keyWaiters = [];
  const entered = $("key-dialog").returnValue === "key";
  $("key-dialog").returnValue = "";
  for (const waiter of waiters) {
    if (entered) waiter.resolve();
    else waiter.reject(new APIError(401, "this server needs an API key"));
  }
  if (entered) {
    refreshModels();
    if (!$("server-view").hidden) pollServer();
  }
});

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  $("key-dialog").close(key ? "key" : "");
});
$("key-forget").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_STORAGE);
  $("key-dialog").close("");
});
$("key-button").addEventListener("click", () => askForKey(""));

// ---------------------------------------------------------------- models

let models = [];   // the cards of /v1/models
let modelPoll = null;

function chattable(card) {
  const can = card.capabilities;
  return !can || can.includes("chat") || can.includes("completions");
}

function chosenModel() {
  return models.find((card) => card.id === $("model-select").value) || null;
}

async function refreshModels() {
  let list;
  try {
    list = await (await api("/v1/models")).json();
  } catch (error) {
    if (error.status !== 401) showBanner(`Could not list the models: ${error.message}`);
    return;
  }
  showBanner("");
  models = list.data.filter(chattable);
  const select = $("model-select");
  const wanted = select.value || currentConversation()?.model || localStorage.getItem("fastrun-model");
  select.replaceChildren(...models.map((card) => el("option", { value: card.id, text: card.id })));
  if (models.some((card) => card.id === wanted)) select.value = wanted;
  showModelStatus();
}

function showModelStatus() {
  const card = chosenModel();
  const status = $("model-status");
  status.dataset.state = card ? card.status : "";
  status.textContent = card ? (card.error ? `failed: ${card.error}` : card.status) : "no model";
  $("attach-label").hidden = !(card && card.capabilities && card.capabilities.includes("vision"));
  clearTimeout(modelPoll);
  if (card && card.status === "loading") modelPoll = setTimeout(refreshModels, 1000);
}

$("model-select").addEventListener("change", async () => {
  const card = chosenModel();
  if (!card) return;
  localStorage.setItem("fastrun-model", card.id);
  const conversation = currentConversation();
  if (conversation) { conversation.model = card.id; saveConversations(); }
  if (card.status !== "unloaded") { showModelStatus(); return; }
  card.status = "loading";
  showModelStatus();
  try {
    // An admin key (or an open server) loads it now; a user key loads it with the first message.
    await api("/v1/models/load", { body: { model: card.id.split(":")[0] }, noKeyPrompt: true });
  } catch (error) {
    if (error.status === 403) card.status = "unloaded";
    else showBanner(`Could not load ${card.id}: ${error.message}`);
  }
  refreshModels();
});

// ---------------------------------------------------------------- conversations, kept in this browser

let conversations = loadConversations();
let currentId = conversations[0]?.id || null;
let generation = null;  // the AbortController of the answer streaming now

function loadConversations() {
  try {
    const stored = JSON.parse(localStorage.getItem(CONVERSATIONS_STORAGE) || "[]");
    return Array.isArray(stored) ? stored.filter((c) => c && Array.isArray(c.messages)) : [];
  } catch {
    return [];
  }
}

function saveConversations() {
  try {
    localStorage.setItem(CONVERSATIONS_STORAGE, JSON.stringify(conversations));
  } catch {
    // Over the browser's quota: keep the text, drop the images of the stored copy.
    const light = conversations.map((c) => ({
      ...c, messages: c.messages.map((m) => ({ ...m, images: undefined, imagesDropped: m.images?.length || undefined })),
    }));
    try { localStorage.setItem(CONVERSATIONS_STORAGE, JSON.stringify(light)); } catch { /* nothing more to drop */ }
  }
}

function currentConversation() {
  return conversations.find((c) => c.id === currentId) || null;
}

function newConversation() {
  const conversation = { id: crypto.randomUUID(), title: "New chat", model: $("model-select").value, messages: [],
                         updated: Date.now() };
  conversations.unshift(conversation);
  currentId = conversation.id;
  saveConversations();
  return conversation;
}

function renderConversationList() {
  $("conversation-list").replaceChildren(...conversations.map((c) => el("li",
    { "aria-current": String(c.id === currentId) },
    el("button", { type: "button", text: c.title, title: c.title, onclick: () => openConversation(c.id) }),
    el("button", { type: "button", text: "✕", title: "Delete", "aria-label": "delete conversation",
                   onclick: () => deleteConversation(c.id) }),
  )));
}

function openConversation(id) {
  if (generation) generation.abort();
  currentId = id;
  const conversation = currentConversation();
  if (conversation?.model && models.some((card) => card.id === conversation.model)) {
    $("model-select").value = conversation.model;
    showModelStatus();
  }
  renderAll();
}

function deleteConversation(id) {
  if (generation && id === currentId) generation.abort();
  conversations = conversations.filter((c) => c.id !== id);
  if (currentId === id) currentId = conversations[0]?.id || null;
  saveConversations();
  renderAll();
}

$("new-chat").addEventListener("click", () => {
  if (generation) generation.abort();
  newConversation();
  renderAll();
  $("prompt").focus();
});

// ---------------------------------------------------------------- messages

function renderAll() {
  renderConversationList();
  const conversation = currentConversation();
  const list = $("messages");
  list.replaceChildren();
  if (!conversation) return;
  conversation.messages.forEach((message, index) => list.append(renderMessage(conversation, message, index)));
  list.scrollTop = list.scrollHeight;
}

function statsText(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.completion_tokens !== undefined) parts.push(`${stats.completion_tokens} tokens`);
  if (stats.tokens_per_s) parts.push(`${stats.tokens_per_s.toFixed(1)} tokens/s`);
  if (stats.prompt_tokens !== undefined) parts.push(`prompt ${stats.prompt_tokens} (${stats.cached_tokens || 0} cached)`);
  if (stats.finish_reason) parts.push(stats.finish_reason);
  return parts.join(" · ");
}

function renderMessage(conversation, message, index) {
  const item = el("li", { class: `msg ${message.role}`, "data-index": String(index) });
  if (message.role === "user") {
    if (message.images?.length) {
      item.append(el("div", { class: "images" }, ...message.images.map((url) => el("img", { src: url, alt: "attached image" }))));
    }
    if (message.imagesDropped) item.append(el("div", { class: "note", text: `(${message.imagesDropped} image(s) not kept)` }));
    item.append(el("div", { class: "content", text: message.content }));
    item.append(el("div", { class: "foot" },
      el("button", { type: "button", class: "edit", text: "Edit", onclick: () => editMessage(conversation, index) })));
    return item;
  }
  if (message.reasoning) {
    item.append(el("details", { class: "reasoning" }, el("summary", { text: "Reasoning" }),
      el("div", { text: message.reasoning })));
  }
  const content = el("div", { class: "content" });
  renderMarkdown(content, message.content || "");
  item.append(content);
  if (message.error) item.append(el("div", { class: "error", text: message.error }));
  const foot = el("div", { class: "foot" }, el("span", { class: "stats", text: statsText(message.stats) }));
  if (index === conversation.messages.length - 1 && !message.streaming) {
    foot.append(el("button", { type: "button", class: "regenerate", text: "Regenerate",
                               onclick: () => regenerate(conversation) }));
  }
  item.append(foot);
  return item;
}

function editMessage(conversation, index) {
  if (generation) return;
  const message = conversation.messages[index];
  const item = $("messages").querySelector(`[data-index="${index}"]`);
  const box = el("textarea", { rows: "3", class: "edit-box" });
  box.value = message.content;
  const save = el("button", { type: "button", text: "Send", class: "edit-send", onclick: () => {
    message.content = box.value;
    conversation.messages.splice(index + 1);  // what followed answered the old text
    saveConversations();
    renderAll();
    answer(conversation);
  } });
  const cancel = el("button", { type: "button", class: "quiet", text: "Cancel", onclick: renderAll });
  item.replaceChildren(box, el("div", { class: "row" }, el("span", { class: "grow" }), cancel, save));
  box.focus();
}

function regenerate(conversation) {
  if (generation) return;
  const last = conversation.messages[conversation.messages.length - 1];
  if (last?.role === "assistant") conversation.messages.pop();
  answer(conversation);
}

// ---------------------------------------------------------------- sending and streaming

let pendingImages = [];  // data URLs of the images attached to the next message

$("attach").addEventListener("change", async () => {
  for (const file of $("attach").files) {
    pendingImages.push(await new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    }));
  }
  $("attach").value = "";
  $("attachments").replaceChildren(...pendingImages.map((url) => el("img", { src: url, alt: "attachment" })));
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value;
  if (generation || (!text.trim() && !pendingImages.length)) return;
  const conversation = currentConversation() || newConversation();
  conversation.messages.push({ role: "user", content: text, images: pendingImages.length ? pendingImages : undefined });
  if (conversation.title === "New chat") conversation.title = text.trim().slice(0, 60) || "Image";
  pendingImages = [];
  $("attachments").replaceChildren();
  $("prompt").value = "";
  renderAll();
  answer(conversation);
});

$("stop").addEventListener("click", () => generation?.abort());

function number(id) {
  const value = $(id).value;
  return value === "" ? undefined : Number(value);
}

function apiMessages(conversation) {
  const messages = [];
  const system = $("system-prompt").value;
  if (system.trim()) messages.push({ role: "system", content: system });
  for (const message of conversation.messages) {
    if (message.role === "assistant") {
      if (!message.error || message.content) messages.push({ role: "assistant", content: message.content || "" });
    } else if (message.images?.length) {
      messages.push({ role: "user", content: [
        ...message.images.map((url) => ({ type: "image_url", image_url: { url } })),
        { type: "text", text: message.content },
      ] });
    } else {
      messages.push({ role: "user", content: message.content });
    }
  }
  return messages;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

async function answer(conversation) {
  const model = $("model-select").value;
  if (!model) { showBanner("No model to answer: the server lists none."); return; }
  conversation.model = model;
  const body = {
    model, messages: apiMessages(conversation), stream: true, stream_options: { include_usage: true },
    temperature: number("temperature"), top_p: number("top-p"), max_tokens: number("max-tokens"), seed: number("seed"),
  };
  const message = { role: "assistant", content: "", reasoning: "", streaming: true, stats: {} };
  conversation.messages.push(message);
  conversation.updated = Date.now();
  renderAll();
  const item = $("messages").lastElementChild;
  const content = item.querySelector(".content");
  const stats = item.querySelector(".stats");
  const controller = new AbortController();
  generation = controller;
  setBusy(true);
  const started = performance.now();
  let firstToken = null;
  let drawPending = false;
  const draw = () => {
    drawPending = false;
    renderMarkdown(content, message.content);
    if (message.reasoning) {
      let reasoning = item.querySelector(".reasoning div");
      if (!reasoning) {
        reasoning = el("div");
        item.prepend(el("details", { class: "reasoning" }, el("summary", { text: "Reasoning" }), reasoning));
      }
      reasoning.textContent = message.reasoning;
    }
    $("messages").scrollTop = $("messages").scrollHeight;
  };
  try {
    let response;
    for (;;) {
      try {
        response = await api("/v1/chat/completions", { body, signal: controller.signal });
        break;
      } catch (error) {
        if (error.status !== 401) throw error;
        await waitForKey();  // the key dialog is open: send again with the key entered
      }
    }
    if (chosenModel()?.status !== "loaded") refreshModels();  // it loaded for this answer
    const decoder = new TextDecoder();
    const parser = createParser({
      onEvent(event) {
        if (event.data === "[DONE]") return;
        const chunk = JSON.parse(event.data);
        if (chunk.error) throw new Error(chunk.error.message || "the stream ended with an error");
        const choice = chunk.choices?.[0];
        if (choice) {
          const delta = choice.delta || {};
          const piece = (delta.content || "") + (delta.reasoning_content || delta.reasoning || "");
          if (piece && firstToken === null) firstToken = performance.now();
          message.content += delta.content || "";
          message.reasoning += delta.reasoning_content || delta.reasoning || "";
          if (choice.finish_reason) message.stats.finish_reason = choice.finish_reason;
        }
        if (chunk.usage) {
          message.stats.prompt_tokens = chunk.usage.prompt_tokens;
          message.stats.cached_tokens = chunk.usage.prompt_tokens_details?.cached_tokens || 0;
          message.stats.completion_tokens = chunk.usage.completion_tokens;
        }
        if (!drawPending) { drawPending = true; requestAnimationFrame(draw); }
      },
    });
    const reader = response.body.getReader();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      parser.feed(decoder.decode(value, { stream: true }));
    }
  } catch (error) {
    if (error.name === "AbortError") message.stats.finish_reason = "stopped";
    else message.error = error.message;
  } finally {
    const ended = performance.now();
    if (message.stats.completion_tokens && firstToken !== null && ended > firstToken) {
      // Tokens after the first, over the time they took: what the stream delivered.
      message.stats.tokens_per_s = Math.max(0, message.stats.completion_tokens - 1) / ((ended - firstToken) / 1000);
    }
    message.stats.seconds = (ended - started) / 1000;
    delete message.streaming;
    if (!message.reasoning) delete message.reasoning;
    generation = null;
    setBusy(false);
    saveConversations();
    if (currentId === conversation.id) renderAll();
  }
}

// ---------------------------------------------------------------- the operator view

const samples = [];  // reads of /v1/server/status: { time, totals }
let serverTimer = null;
let charts = null;

function totals(status) {
  const sum = { prompt: 0, cached: 0, generated: 0, slot: 0, host: 0, disk: 0, miss: 0, busy: 0, waiting: 0 };
  for (const model of Object.values(status.models)) {
    sum.busy += model.busy_slots || 0;
    sum.waiting += model.waiting || 0;
    const s = model.stats;
    if (!s) continue;
    sum.prompt += s.prompt_tokens; sum.cached += s.cached_tokens; sum.generated += s.generated_tokens;
    sum.slot += s.slot_hits; sum.host += s.host_hits; sum.disk += s.disk_hits; sum.miss += s.misses;
  }
  return sum;
}

function bytes(n) {
  if (n === undefined || n === null) return "";
  return n >= 2 ** 30 ? `${(n / 2 ** 30).toFixed(2)} GiB` : `${(n / 2 ** 20).toFixed(0)} MiB`;
}

function cells(...values) {
  return values.map((value) => value instanceof Node ? el("td", {}, value)
    : el("td", { class: typeof value === "number" ? "num" : "", text: value === undefined || value === null ? "" : String(value) }));
}

function fillTable(id, rows, empty) {
  const body = $(id).querySelector("tbody");
  body.replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { colspan: "9", class: "note", text: empty }))]));
}

function modelButton(id, status) {
  const unload = status === "loaded";
  return el("button", { type: "button", class: "quiet", text: unload ? "Unload" : "Load", onclick: async () => {
    try {
      await api(unload ? "/v1/models/unload" : "/v1/models/load", { body: { model: id } });
    } catch (error) {
      showBanner(`${unload ? "Unload" : "Load"} ${id}: ${error.message}`);
    }
    pollServer();
    refreshModels();
  } });
}

function drawServer(status) {
  fillTable("server-models", Object.entries(status.models).map(([id, m]) => {
    const memory = m.memory?.reported_by_llama_cpp || m.memory?.estimate;
    const s = m.stats;
    return el("tr", { "data-model": id }, ...cells(
      id, m.status || m.state, m.slots !== undefined ? `${m.busy_slots} / ${m.slots}` : "", m.waiting ?? "",
      memory ? bytes(memory.ram_bytes + memory.gpu_bytes) : "",
      m.keep_alive_s === -1 ? "for good" : (m.keep_alive_left_s !== undefined ? `${m.keep_alive_left_s} s` : ""),
      s ? `${s.slot_hits} / ${s.host_hits} / ${s.disk_hits} / ${s.misses}` : "",
      modelButton(id, m.status)));
  }), "no models");
  fillTable("server-batches", status.batches.map((b) => el("tr", {}, ...cells(
    b.id, b.account, b.status, b.endpoint,
    `${b.request_counts.completed} / ${b.request_counts.failed} / ${b.request_counts.total}`, b.lines_in_flight))),
    "no batch has work left");
  fillTable("server-background", status.background_responses.map((r) => el("tr", {}, ...cells(
    r.id, r.account, r.model, r.status, r.events))), "none queued or running");
  fillTable("server-usage", Object.entries(status.usage).map(([account, u]) => el("tr", {}, ...cells(
    account, u.requests, u.prompt_tokens, u.cached_tokens, u.completion_tokens, u.batch_requests))),
    "no use recorded (an open server counts no accounts)");
  drawCharts();
}

function chartData() {
  const time = [], generated = [], evaluated = [], cached = [], slot = [], host = [], disk = [], miss = [];
  const busy = [], waiting = [];
  for (let i = 1; i < samples.length; i++) {
    const a = samples[i - 1], b = samples[i];
    const seconds = b.time - a.time;
    if (seconds <= 0) continue;
    time.push(b.time);
    generated.push((b.totals.generated - a.totals.generated) / seconds);
    evaluated.push(((b.totals.prompt - b.totals.cached) - (a.totals.prompt - a.totals.cached)) / seconds);
    cached.push((b.totals.cached - a.totals.cached) / seconds);
    slot.push(b.totals.slot - a.totals.slot);
    host.push(b.totals.host - a.totals.host);
    disk.push(b.totals.disk - a.totals.disk);
    miss.push(b.totals.miss - a.totals.miss);
    busy.push(b.totals.busy);
    waiting.push(b.totals.waiting);
  }
  return { tokens: [time, generated, evaluated, cached], cache: [time, slot, host, disk, miss],
           slots: [time, busy, waiting] };
}

function drawCharts() {
  const data = chartData();
  const width = () => Math.max(300, ($("chart-tokens").parentElement.clientWidth || 600) - 10);
  if (!charts) {
    const axes = [{}, { size: 60 }];
    charts = {
      tokens: new uPlot({ width: width(), height: 200, axes, series: [{},
        { label: "generated", stroke: "#2b5fd9" }, { label: "prompt evaluated", stroke: "#d49b00" },
        { label: "prompt from cache", stroke: "#2e9d57" }] }, data.tokens, $("chart-tokens")),
      cache: new uPlot({ width: width(), height: 200, axes, series: [{},
        { label: "slot", stroke: "#2e9d57" }, { label: "host RAM", stroke: "#2b5fd9" },
        { label: "disk", stroke: "#8e44ad" }, { label: "miss", stroke: "#b3261e" }] }, data.cache, $("chart-cache")),
      slots: new uPlot({ width: width(), height: 200, axes, series: [{},
        { label: "slots busy", stroke: "#2b5fd9" }, { label: "requests waiting", stroke: "#b3261e" }] },
        data.slots, $("chart-slots")),
    };
    window.addEventListener("resize", () => {
      for (const chart of Object.values(charts)) chart.setSize({ width: width(), height: 200 });
    });
  } else {
    for (const [name, chart] of Object.entries(charts)) chart.setData(data[name]);
  }
}

async function pollServer() {
  clearTimeout(serverTimer);
  if ($("server-view").hidden) return;
  try {
    const status = await (await api("/v1/server/status", { noKeyPrompt: true })).json();
    $("server-note").hidden = true;
    $("server-body").hidden = false;
    samples.push({ time: status.time, totals: totals(status) });
    if (samples.length > CHART_SAMPLES) samples.shift();
    drawServer(status);
  } catch (error) {
    $("server-note").hidden = false;
    $("server-note").textContent = error.status === 403 || error.status === 401
      ? "The operator view needs an admin key (fastrun-cpp keys admin ACCOUNT): use “API key” above."
      : `Could not read the server's status: ${error.message}`;
    $("server-body").hidden = error.status === 403 || error.status === 401;
  }
  serverTimer = setTimeout(pollServer, SERVER_POLL_MS);
}

function showTab(name) {
  $("chat-view").hidden = name !== "chat";
  $("server-view").hidden = name !== "server";
  $("tab-chat").setAttribute("aria-selected", String(name === "chat"));
  $("tab-server").setAttribute("aria-selected", String(name === "server"));
  if (name === "server") pollServer();
  else clearTimeout(serverTimer);
}

$("tab-chat").addEventListener("click", () => showTab("chat"));
$("tab-server").addEventListener("click", () => showTab("server"));

// ---------------------------------------------------------------- start

renderAll();
refreshModels();
