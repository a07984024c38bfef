// The chat page and engine dashboard of `jaxinfer serve` (see serve/page.py).
//
// Chat: streams /v1/chat/completions (SSE read from fetch's ReadableStream), keeps the
// conversation, and renders the answer as a small markdown subset (paragraphs, **bold**, `code`,
// ``` fenced blocks, lists) built from DOM nodes and textContent only: model text never becomes
// HTML. Stop aborts the fetch, which closes the connection; the server then aborts the request and
// frees its KV pages. Each answer shows its time to first token and tokens/s.
// Dashboard: polls /v1/engine/stats (the numbers of /metrics) and draws output tokens/s.
// API key: on a 401 the page asks for it and keeps it in sessionStorage (this tab) only.
"use strict";

(() => {
  const KEY_STORAGE = "jaxinfer.apiKey";
  const POLL_MS = 1000;
  const CHART_SECONDS = 300;

  const $ = (id) => document.getElementById(id);

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // -- the API key ---------------------------------------------------------------------------

  let keyPrompt = null; // the pending request for a key, shared by every caller that got a 401

  function askKey(message) {
    if (keyPrompt) return keyPrompt;
    keyPrompt = new Promise((resolve) => {
      const form = $("key-form");
      $("key-message").textContent = message;
      form.hidden = false;
      $("key-input").focus();
      form.onsubmit = (event) => {
        event.preventDefault();
        const key = $("key-input").value.trim();
        if (!key) return;
        sessionStorage.setItem(KEY_STORAGE, key);
        $("key-input").value = "";
        form.hidden = true;
        keyPrompt = null;
        resolve();
      };
    });
    return keyPrompt;
  }

  // fetch() of this server's API with the key, asking for one (and retrying) on a 401
  async function api(path, init = {}) {
    for (;;) {
      const headers = Object.assign({}, init.headers);
      const key = sessionStorage.getItem(KEY_STORAGE);
      if (key) headers.Authorization = "Bearer " + key;
      const response = await fetch(path, Object.assign({}, init, {
        headers, credentials: "same-origin", cache: "no-store", redirect: "error"}));
      if (response.status !== 401) return response;
      await askKey(key ? "That API key was refused. API key:" : "This server needs an API key.");
    }
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
    } catch (e) { /* not JSON */ }
    return `HTTP ${response.status}`;
  }

  // -- markdown, as DOM nodes ---------------------------------------------------------------

  // `code` and **bold** inside one block, as text nodes and elements
  function appendInline(parent, text) {
    const pattern = /`([^`\n]+)`|\*\*([^*\n][^\n]*?)\*\*/g;
    let last = 0;
    for (const match of text.matchAll(pattern)) {
      if (match.index > last) parent.append(document.createTextNode(text.slice(last, match.index)));
      if (match[1] !== undefined) parent.append(el("code", null, match[1]));
      else parent.append(el("strong", null, match[2]));
      last = match.index + match[0].length;
    }
    if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
  }

  // The nodes of `text`: ``` fenced blocks (an unclosed one runs to the end, as while streaming),
  // "- " / "* " / "1. " list items, and paragraphs split by blank lines.
  function markdownNodes(text) {
    const nodes = [];
    const lines = text.split("\n");
    let paragraph = [];
    let list = null;
    const endParagraph = () => {
      if (paragraph.length) {
        const p = el("p");
        appendInline(p, paragraph.join("\n"));
        nodes.push(p);
      }
      paragraph = [];
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = /^\s*```\s*([\w+.#-]*)\s*$/.exec(line);
      if (fence) {
        endParagraph();
        list = null;
        const code = [];
        for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
        const pre = el("pre");
        const codeNode = el("code", null, code.join("\n"));
        if (fence[1]) pre.dataset.lang = fence[1];
        pre.append(codeNode);
        nodes.push(pre);
        continue;
      }
      const item = /^\s*(?:([-*+])|(\d+)[.)])\s+(.*)$/.exec(line);
      if (item) {
        endParagraph();
        const ordered = item[1] === undefined;
        if (!list || list.ordered !== ordered) {
          list = {ordered, node: el(ordered ? "ol" : "ul")};
          if (ordered && item[2] !== "1") list.node.start = parseInt(item[2], 10);
          nodes.push(list.node);
        }
        const li = el("li");
        appendInline(li, item[3]);
        list.node.append(li);
        continue;
      }
      if (line.trim() === "") {
        endParagraph();
        list = null;
        continue;
      }
      list = null;
      paragraph.push(line);
    }
    endParagraph();
    return nodes;
  }

  // -- the conversation ---------------------------------------------------------------------

  const conversation = []; // {role, content} of the turns so far
  let controller = null; // the running answer's AbortController
  let epoch = 0; // counts "New chat"s: an answer that ends after one does not join the new chat
  let modelName = null;

  function addMessage(role, text) {
    const node = el("div", `message ${role}`);
    node.append(el("div", "role", role));
    const body = el("div", "body");
    if (role === "user") body.textContent = text;
    node.append(body);
    $("messages").append(node);
    scrollDown();
    return {node, body};
  }

  function scrollDown() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
  }

  // the `data:` payloads of an SSE stream
  async function* sseData(stream) {
    const reader = stream.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const {value, done} = await reader.read();
        if (done) return;
        buffer += decoder.decode(value, {stream: true});
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const data = block.split("\n").filter((l) => l.startsWith("data:"))
            .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
          if (data) yield data;
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  function requestBody() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({role: "system", content: system});
    messages.push(...conversation);
    const body = {messages, stream: true, stream_options: {include_usage: true}};
    if (modelName) body.model = modelName;
    const temperature = parseFloat($("temperature").value);
    if (Number.isFinite(temperature)) body.temperature = temperature;
    const maxTokens = parseInt($("max-tokens").value, 10);
    if (Number.isFinite(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
    return body;
  }

  async function send(text) {
    const myEpoch = epoch;
    conversation.push({role: "user", content: text});
    addMessage("user", text);
    const answer = addMessage("assistant", "");
    answer.node.classList.add("streaming");
    controller = new AbortController();
    setBusy(true);
    const t0 = performance.now();
    let tFirst = null;
    let content = "";
    let deltas = 0;
    let usage = null;
    let finish = null;
    let error = null;
    try {
      const response = await api("/v1/chat/completions", {
        method: "POST", headers: {"Content-Type": "application/json"},
        body: JSON.stringify(requestBody()), signal: controller.signal});
      if (!response.ok) {
        error = await errorMessage(response);
      } else {
        for await (const data of sseData(response.body)) {
          if (data === "[DONE]") break;
          const chunk = JSON.parse(data);
          if (chunk.error) {
            error = chunk.error.message || "error";
            break;
          }
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            const delta = choice.delta && choice.delta.content;
            if (delta) {
              if (tFirst === null) tFirst = performance.now();
              content += delta;
              deltas++;
              answer.body.replaceChildren(...markdownNodes(content));
              scrollDown();
            }
            if (choice.finish_reason) finish = choice.finish_reason;
          }
        }
      }
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else error = String(e.message || e);
    }
    const tEnd = performance.now();
    controller = null;
    setBusy(false);
    answer.node.classList.remove("streaming");
    answer.node.classList.add(finish === "stopped" ? "stopped" : "done");
    if (myEpoch === epoch) {
      if (content) conversation.push({role: "assistant", content});
      else if (error) conversation.pop(); // the turn failed: leave it out of the next request
    }
    answer.node.append(answerStats({t0, tFirst, tEnd, usage, deltas, finish, error}));
  }

  function answerStats({t0, tFirst, tEnd, usage, deltas, finish, error}) {
    const node = el("div", error ? "answer-stats error" : "answer-stats");
    if (error) {
      node.textContent = error;
      return node;
    }
    const parts = [];
    if (tFirst !== null) {
      const ttft = tFirst - t0;
      node.dataset.ttftMs = ttft.toFixed(1);
      parts.push(`first token ${ttft.toFixed(0)} ms`);
      const tokens = usage ? usage.completion_tokens : deltas;
      const seconds = (tEnd - tFirst) / 1000;
      if (tokens > 1 && seconds > 0) {
        const rate = (tokens - 1) / seconds;
        node.dataset.tokensPerS = rate.toFixed(2);
        parts.push(`${rate.toFixed(1)} tokens/s`);
      }
      parts.push(`${usage ? "" : "≈"}${tokens} tokens`);
    }
    if (finish) parts.push(finish);
    node.textContent = parts.join(" · ");
    return node;
  }

  // -- the dashboard ------------------------------------------------------------------------

  const rates = []; // {t (s), rate (tokens/s)} of the last CHART_SECONDS
  let previous = null;

  function show(id, value, text) {
    const node = $(id);
    node.dataset.value = value === null || value === undefined ? "" : String(value);
    node.textContent = text;
  }

  const count = (v) => (v === null || v === undefined ? "–" : String(Math.round(v)));
  const percent = (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(1)} %`);

  function showStats(stats) {
    if (!modelName && stats.model) {
      modelName = stats.model;
      $("model").textContent = stats.model;
    }
    $("stats-state").textContent = stats.ready ? "ready" : "warming up";
    show("stat-running", stats.requests.running, count(stats.requests.running));
    show("stat-waiting", stats.requests.waiting, count(stats.requests.waiting));
    show("stat-kv-used", stats.kv_pages.used, count(stats.kv_pages.used));
    show("stat-kv-cached", stats.kv_pages.cached, count(stats.kv_pages.cached));
    show("stat-kv-total", stats.kv_pages.total, count(stats.kv_pages.total));
    show("stat-prefix-hit", stats.prefix_cache.hit_rate, percent(stats.prefix_cache.hit_rate));
    const spec = stats.speculative;
    show("stat-spec", spec.acceptance_rate,
      spec.draft_tokens ? `${percent(spec.acceptance_rate)} of ${count(spec.draft_tokens)}` : "no drafts");
    show("stat-generated", stats.tokens.generated, count(stats.tokens.generated));
    if (previous && stats.time > previous.time) {
      const rate = Math.max(0, (stats.tokens.generated - previous.tokens.generated) / (stats.time - previous.time));
      rates.push({t: stats.time, rate});
      while (rates.length && rates[0].t < stats.time - CHART_SECONDS) rates.shift();
      show("stat-tps", rate, rate.toFixed(1));
      drawChart(stats.time);
    }
    previous = stats;
  }

  function drawChart(now) {
    const canvas = $("tps-chart");
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || canvas.width;
    const height = canvas.clientHeight || canvas.height;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const g = canvas.getContext("2d");
    g.scale(ratio, ratio);
    g.clearRect(0, 0, width, height);
    const top = Math.max(1, ...rates.map((p) => p.rate)) * 1.15;
    // the time drawn: since the first sample, at least a minute, at most CHART_SECONDS
    const span = Math.min(CHART_SECONDS, Math.max(60, rates.length ? now - rates[0].t : 0));
    const x = (t) => width - ((now - t) / span) * width;
    const y = (rate) => height - 16 - (rate / top) * (height - 24);
    g.strokeStyle = "#dde1e7";
    g.beginPath();
    g.moveTo(0, y(0));
    g.lineTo(width, y(0));
    g.stroke();
    g.fillStyle = "#6b7280";
    g.font = "11px system-ui, sans-serif";
    g.fillText(`${(top / 1.15).toFixed(1)} tok/s`, 4, 12);
    g.fillText(span >= 120 ? `-${Math.round(span / 60)} min` : `-${Math.round(span)} s`, 4, height - 3);
    g.fillText("now", width - 24, height - 3);
    if (rates.length < 2) return;
    g.beginPath();
    rates.forEach((p, i) => (i ? g.lineTo(x(p.t), y(p.rate)) : g.moveTo(x(p.t), y(p.rate))));
    g.strokeStyle = "#2f6fde";
    g.lineWidth = 1.5;
    g.stroke();
    g.lineTo(x(rates[rates.length - 1].t), y(0));
    g.lineTo(x(rates[0].t), y(0));
    g.closePath();
    g.fillStyle = "rgba(47, 111, 222, 0.12)";
    g.fill();
  }

  async function pollStats() {
    try {
      const response = await api("/v1/engine/stats");
      if (response.ok) showStats(await response.json());
      else $("stats-state").textContent = await errorMessage(response);
    } catch (e) {
      $("stats-state").textContent = "unreachable";
    }
    setTimeout(pollStats, POLL_MS);
  }

  // -- wiring -------------------------------------------------------------------------------

  function start() {
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      const text = $("input").value.trim();
      if (!text || controller) return;
      $("input").value = "";
      send(text);
    });
    $("input").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => controller && controller.abort());
    $("clear").addEventListener("click", () => {
      if (controller) controller.abort();
      epoch++;
      conversation.length = 0;
      $("messages").replaceChildren();
    });
    pollStats();
  }

  start();
})();
