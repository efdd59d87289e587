/* kvmem operator page: plain JavaScript, no framework, no build step.
 *
 * Everything shown comes from this server's JSON routes, called with the key in an
 * x-api-key header (never in a URL): GET /v1/status (every 2 s), GET /v1/status/agents
 * (every 4 s), GET /v1/scenarios and /v1/scenarios/{id}; the chat panel streams
 * POST /v1/agents/{id}/messages and forgetting is DELETE /v1/agents/{id}.
 * The key lives in this tab's sessionStorage; /ui#key=KEY stores it and clears the fragment.
 */
"use strict";

(() => {
  const KEY_STORE = "kvmem.apiKey";
  const CHAT_STORE = "kvmem.chats";
  const STATUS_EVERY_MS = 2000;
  const AGENTS_EVERY_MS = 4000;
  const SCENARIOS_EVERY_MS = 8000;
  const MAX_BACKOFF_MS = 10000;
  const TIERS = ["hot", "warm", "remote", "shared", "cold"];
  const TIER_ORDER = { hot: 0, warm: 1, remote: 2, shared: 3, none: 4, cold: 5 };

  const $ = (id) => document.getElementById(id);

  const state = {
    status: null,
    agents: [],
    usage: null,
    sort: { key: "last_used", dir: -1 },
    chats: readChats(),
    chatBusy: false,
    scenarioRun: null,
    timers: [],
    rows: new Map(), // agent id -> its table row (kept, so rows are updated in place, not rebuilt)
    cells: new WeakMap(), // table row -> its cells by name
    generation: 0, // bumped when the key changes: answers to older calls are dropped
    retry: null, // a sign-in retried while the server cannot be reached
  };

  // -- errors and calls -------------------------------------------------------

  class AuthError extends Error {
    constructor(hadKey) {
      super(hadKey ? "The key was not accepted." : "This server needs a key.");
      this.hadKey = hadKey;
    }
  }

  class HttpError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // An agent id as one path segment: "/" and "%" escaped, and dots too, so that an id
  // of "." or ".." is not a dot segment the browser would resolve away.
  function agentSegment(id) {
    return encodeURIComponent(id).replace(/\./g, "%2E");
  }

  function apiUrl(path) {
    // The page lives at <prefix>/ui/: the API is one level up (works behind a path prefix too).
    return new URL("../" + path, new URL("./", location.href));
  }

  async function call(path, options = {}) {
    const headers = new Headers(options.headers || {});
    const key = sessionStorage.getItem(KEY_STORE);
    if (key) headers.set("x-api-key", key);
    const response = await fetch(apiUrl(path), {
      ...options, headers, cache: "no-store", credentials: "omit", redirect: "error",
    });
    if (response.status === 401) throw new AuthError(Boolean(key));
    return response;
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      return (body && body.error && body.error.message) || `HTTP ${response.status}`;
    } catch (_) {
      return `HTTP ${response.status}`;
    }
  }

  async function getJSON(path) {
    const response = await call(path);
    if (!response.ok) throw new HttpError(response.status, await errorText(response));
    return response.json();
  }

  // -- formatting ---------------------------------------------------------------

  const intFormat = new Intl.NumberFormat("en-US");
  const fmtInt = (n) => (n == null ? "–" : intFormat.format(Math.round(n)));

  function fmtBytes(n) {
    if (n == null) return "–";
    if (n < 1024) return `${n} B`;
    const units = ["KiB", "MiB", "GiB", "TiB"];
    let value = n / 1024;
    let unit = 0;
    while (value >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit += 1;
    }
    return `${value >= 100 ? value.toFixed(0) : value.toFixed(1)} ${units[unit]}`;
  }

  function fmtMs(ms) {
    if (ms == null) return "–";
    if (ms < 1) return `${ms.toFixed(2)} ms`;
    if (ms < 1000) return `${ms < 10 ? ms.toFixed(1) : Math.round(ms)} ms`;
    return `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
  }

  function fmtRate(value) {
    if (value == null) return "–";
    if (value === 0) return "0";
    if (value < 0.1) return value.toFixed(3);
    if (value < 10) return value.toFixed(2);
    return value.toFixed(value < 100 ? 1 : 0);
  }

  function fmtAgo(unixSeconds) {
    if (unixSeconds == null) return "–";
    const s = Math.max(0, Date.now() / 1000 - unixSeconds);
    if (s < 5) return "just now";
    if (s < 60) return `${Math.floor(s)} s ago`;
    if (s < 3600) return `${Math.floor(s / 60)} min ago`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
    return `${Math.floor(s / 86400)} d ago`;
  }

  function fmtDuration(seconds) {
    if (seconds == null) return "–";
    const s = Math.floor(seconds);
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
    return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
  }

  const fmtPct = (fraction) => (fraction == null ? "–" : `${(fraction * 100).toFixed(fraction >= 0.995 || fraction === 0 ? 0 : 1)}%`);
  const fmtTime = (unixSeconds) => (unixSeconds == null ? "" : new Date(unixSeconds * 1000).toLocaleString());

  // -- small DOM helpers -------------------------------------------------------------

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value == null || value === false) continue;
      if (name === "class") node.className = value;
      else if (name === "text") node.textContent = value;
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value === true ? "" : value);
    }
    for (const child of children) {
      if (child == null) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  const present = (...nodes) => nodes.filter((n) => n != null);

  function setText(id, text, title) {
    const node = $(id);
    node.textContent = text;
    if (title !== undefined) node.title = title;
  }

  function modelName(tag) {
    // A cache's tag is <model>@<config hash>/<KV format>[+<prompt format>]: the model and the KV format say enough.
    if (!tag) return "–";
    const match = /^(.*)@[^/]*\/([^+]*)/.exec(tag);
    return match ? `${match[1]} · ${match[2]}` : tag;
  }

  function tierBadge(tier) {
    return el("span", { class: `badge tier-${tier}`, text: tier });
  }

  function bar(used, limit, { progress = false } = {}) {
    // A gauge turns amber then red as it fills; a progress bar (progress: true) just fills.
    const fill = el("div", { class: progress ? "bar-fill progress" : "bar-fill" });
    if (!limit) {
      fill.classList.add("off");
      fill.style.width = used ? "100%" : "0";
    } else {
      const pct = Math.min(100, (used / limit) * 100);
      fill.style.width = `${pct.toFixed(1)}%`;
      if (!progress && pct >= 95) fill.classList.add("full");
      else if (!progress && pct >= 80) fill.classList.add("high");
    }
    return el("div", { class: "bar" }, fill);
  }

  // -- sign-in -------------------------------------------------------------------

  function takeKeyFromFragment() {
    // Whether the fragment held a key (stored, and taken out of the address).
    const fragment = location.hash.replace(/^#/, "");
    if (!fragment) return false;
    let key = null;
    for (const part of fragment.split("&")) {
      const [name, ...rest] = part.split("=");
      if (name === "key") {
        try {
          key = decodeURIComponent(rest.join("="));
        } catch (_) {
          key = rest.join("=");
        }
      }
    }
    if (key === null) return false;
    if (key) sessionStorage.setItem(KEY_STORE, key);
    // Out of the address bar (and its history entry) at once.
    history.replaceState(null, "", location.pathname + location.search);
    return true;
  }

  function showSignIn(message) {
    stopPolling();
    $("app").hidden = true;
    $("signin").hidden = false;
    const error = $("signin-error");
    error.hidden = !message;
    error.textContent = message || "";
    $("signin-submit").disabled = false;
    $("signin-key").focus();
  }

  function showApp() {
    $("signin").hidden = true;
    $("app").hidden = false;
    listChats();
  }

  async function signIn(event) {
    event.preventDefault();
    const key = $("signin-key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_STORE, key);
    $("signin-submit").disabled = true;
    await start();
  }

  function forgetView() {
    // Nothing shown under one key stays when the key goes or changes.
    sessionStorage.removeItem(CHAT_STORE);
    state.chats = {};
    state.generation += 1;
    state.scenarioRun = null;
    state.status = null;
    state.agents = [];
    state.usage = null;
    state.rows.forEach((row) => row.remove());
    state.rows.clear();
    $("chat-log").replaceChildren(el("p", { class: "empty", text: "The conversation appears here." }));
    $("chat-turn").replaceChildren();
    $("chat-agent").value = "";
    $("chat-list").replaceChildren();
    $("chat-system").value = "";
    renderAgents();
  }

  function signOut(message) {
    clearTimeout(state.retry);
    sessionStorage.removeItem(KEY_STORE);
    forgetView();
    $("signin-key").value = "";
    showSignIn(message);
  }

  async function start() {
    clearTimeout(state.retry);
    try {
      await refreshStatus();
    } catch (error) {
      if (error instanceof AuthError) {
        if (error.hadKey) sessionStorage.removeItem(KEY_STORE);
        showSignIn(error.hadKey ? "That key was not accepted." : "");
      } else {
        // The server is away (restarting?): try again shortly with the key already given.
        showSignIn(`Cannot reach the server (${error.message}); retrying…`);
        state.retry = setTimeout(start, 3000);
      }
      return;
    }
    showApp();
    startPolling();
  }

  // -- polling -------------------------------------------------------------------

  function every(ms, job) {
    // Run job every ms; after a failure (the server away, a tenant over its rate) wait
    // twice as long each time, up to MAX_BACKOFF_MS, until it succeeds again.
    let timer = null;
    let stopped = false;
    let delay = ms;
    const tick = async () => {
      try {
        await job();
        delay = ms;
      } catch (error) {
        onPollError(error);
        delay = Math.min(Math.max(delay * 2, ms), MAX_BACKOFF_MS);
      }
      if (!stopped) timer = setTimeout(tick, delay);
    };
    timer = setTimeout(tick, ms);
    state.timers.push(() => {
      stopped = true;
      clearTimeout(timer);
    });
  }

  function startPolling() {
    stopPolling();
    refreshAgents().catch(onPollError);
    refreshScenarios().catch(onPollError);
    every(STATUS_EVERY_MS, refreshStatus);
    every(AGENTS_EVERY_MS, refreshAgents);
    every(SCENARIOS_EVERY_MS, refreshScenarios);
  }

  function stopPolling() {
    state.timers.forEach((stop) => stop());
    state.timers = [];
  }

  function onPollError(error) {
    if (error instanceof AuthError) {
      signOut("The key is no longer accepted. Sign in again.");
      return;
    }
    setConnection(false, error);
  }

  function setConnection(ok, error) {
    const conn = $("conn");
    conn.classList.toggle("ok", ok);
    conn.classList.toggle("bad", !ok);
    const limited = error instanceof HttpError && error.status === 429;
    $("conn-text").textContent = ok ? "Live" : limited ? "Rate limited — slowing down" : "Offline — retrying";
    conn.title = ok ? "Figures update every 2 s" : `Last error: ${error && error.message}`;
  }

  // -- status: facts, KPIs, memory, batch, chart ---------------------------------------------

  async function refreshStatus() {
    const generation = state.generation;
    const status = await getJSON("v1/status");
    if (generation !== state.generation) return;
    state.status = status;
    setConnection(true);
    renderStatus(status);
  }

  function renderStatus(s) {
    setText("fact-model", s.model || "none loaded", (s.models || []).join(", "));
    setText("fact-uptime", fmtDuration(s.uptime_s));
    setText("fact-version", s.version);
    const who = s.caller.tenant ? `tenant ${s.caller.tenant}${s.caller.operator ? " · operator" : ""}` : "";
    setText("who", who);
    renderKpis(s.live);
    renderChart(s.live);
    renderMemory(s.memory);
    renderBatch(s.batch);
  }

  function renderKpis(live) {
    const span = live.window_s < 59 ? `last ${Math.round(live.window_s)} s` : "last minute";
    setText("kpi-turns", fmtRate(live.turns_per_s));
    setText("kpi-turns-note", `${fmtInt(live.turns)} turns, ${span}`);
    setText("kpi-tokens", fmtRate(live.tokens_per_s));
    setText("kpi-tokens-note", `generated · ${fmtRate(live.prompt_tokens_per_s)} prompt tok/s`);
    const t = live.ttft_ms;
    setText("kpi-p50", t ? fmtMs(t.p50) : "–");
    setText("kpi-p90", t ? fmtMs(t.p90) : "–");
    setText("kpi-p99", t ? `p99 ${fmtMs(t.p99)}` : "no turns in the window");
    const hits = live.turns ? 1 - (live.hit_rate.cold || 0) : null;
    setText("kpi-hits", fmtPct(hits));
    const tierbar = $("kpi-tierbar");
    const legend = $("kpi-tier-legend");
    tierbar.replaceChildren();
    legend.replaceChildren();
    for (const tier of TIERS) {
      const share = live.hit_rate[tier] || 0;
      if (!share) continue;
      const part = el("span", { class: `t-${tier}`, title: `${tier} ${fmtPct(share)}` });
      part.style.width = `${(share * 100).toFixed(2)}%`;
      tierbar.append(part);
      legend.append(el("span", {}, el("i", { class: `t-${tier}` }), `${tier} ${fmtPct(share)}`));
    }
    if (!legend.childNodes.length) legend.textContent = "by tier: hot · warm · remote · shared";
  }

  function renderChart(live) {
    const svg = $("chart");
    const ns = "http://www.w3.org/2000/svg";
    const W = 600;
    const H = 180;
    const points = live.series || [];
    const maxTokens = Math.max(1, ...points.map((p) => p.tokens_per_s));
    const maxTurns = Math.max(0.1, ...points.map((p) => p.turns_per_s));
    const x = (i) => (points.length > 1 ? (i / (points.length - 1)) * W : 0);
    const y = (v, max) => H - 8 - (v / max) * (H - 24);
    const line = (values, max) => values.map((v, i) => `${i ? "L" : "M"}${x(i).toFixed(1)} ${y(v, max).toFixed(1)}`).join(" ");
    const shape = (tag, attrs) => {
      const node = document.createElementNS(ns, tag);
      for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
      return node;
    };
    const children = [];
    for (const f of [0.25, 0.5, 0.75, 1]) {
      const gy = (H - 8 - f * (H - 24)).toFixed(1);
      children.push(shape("line", { class: "grid", x1: 0, x2: W, y1: gy, y2: gy }));
    }
    if (points.length > 1) {
      const tokens = line(points.map((p) => p.tokens_per_s), maxTokens);
      children.push(shape("path", { class: "area-tokens", d: `${tokens} L${W} ${H - 8} L0 ${H - 8} Z` }));
      children.push(shape("path", { class: "line-tokens", d: tokens }));
      children.push(shape("path", { class: "line-turns", d: line(points.map((p) => p.turns_per_s), maxTurns) }));
    }
    svg.replaceChildren(...children);
    let scale = svg.parentElement.querySelector(".chart-scale");
    if (!scale) {
      scale = el("span", { class: "chart-scale" });
      svg.parentElement.append(scale);
    }
    const peakTokens = Math.max(0, ...points.map((p) => p.tokens_per_s));
    const peakTurns = Math.max(0, ...points.map((p) => p.turns_per_s));
    scale.textContent = `peak ${fmtRate(peakTokens)} tok/s · ${fmtRate(peakTurns)} turns/s`;
  }

  const GAUGES = [
    ["kv_budget", "KV budget", "KV blocks of the sequences running now (budget_mb)"],
    ["hot_tier", "Hot tier", "idle caches kept in RAM (hot_budget_mb)"],
    ["float_pool", "Float pool", "float KV kept beside hot caches for their next turn (keep_float_mb)"],
    ["prefetch", "Prefetch", "caches read ahead at start, not yet taken (prefetch_mb)"],
    ["disk", "Disk", "the volume holding the cache directory"],
  ];

  function gauge(name, help, used, limit, valueText) {
    return el("div", { class: "gauge", title: help, "data-gauge": name },
      el("div", { class: "gauge-top" },
        el("span", { class: "gauge-name", text: name }),
        el("span", { class: "gauge-value", text: valueText })),
      bar(used, limit));
  }

  function renderMemory(memory) {
    const box = $("memory");
    if (!memory) {
      renderUsage();
      return;
    }
    const rows = GAUGES.map(([key, name, help]) => {
      const g = memory[key];
      if (!g) return gauge(name, help, 0, 0, "unavailable");
      const limit = g.limit_bytes;
      const text = limit ? `${fmtBytes(g.used_bytes)} of ${fmtBytes(limit)}` : limit === 0 ? `off` : fmtBytes(g.used_bytes);
      return gauge(name, help, g.used_bytes, limit, text);
    });
    box.replaceChildren(...rows);
    const foot = `Accelerator ${fmtBytes(memory.accelerator_active)} · peak ${fmtBytes(memory.accelerator_peak)} · weights ${fmtBytes(memory.model)}`;
    setText("memory-foot", memory.accelerator_active ? foot : "");
    setText("memory-note", "");
  }

  function renderUsage() {
    // A tenant that is not an operator: its own usage against its limits.
    const box = $("memory");
    const usage = state.usage;
    const rows = [];
    if (usage) {
      rows.push(gauge("Agents", "agents with a cache or a running actor (max_agents)", usage.agents,
        usage.max_agents, usage.max_agents ? `${fmtInt(usage.agents)} of ${fmtInt(usage.max_agents)}` : fmtInt(usage.agents)));
      rows.push(gauge("Disk", "your caches on disk (max_disk_mb)", usage.disk_bytes, usage.max_disk_bytes,
        usage.max_disk_bytes ? `${fmtBytes(usage.disk_bytes)} of ${fmtBytes(usage.max_disk_bytes)}` : fmtBytes(usage.disk_bytes)));
    }
    rows.push(el("p", { class: "operator-only", text: "The server's memory (KV budget, hot tier, float pool, prefetch) is shown to operators." }));
    box.replaceChildren(...rows);
    setText("memory-note", usage ? `tenant ${usage.tenant}` : "");
    setText("memory-foot", "");
  }

  function displayId(tenant, id) {
    const own = state.status && state.status.caller.tenant;
    return tenant && tenant !== own ? `${tenant} / ${id}` : id;
  }

  function renderBatch(batch) {
    const box = $("batch");
    if (!batch) {
      box.replaceChildren(el("p", { class: "operator-only", text: "The batch (every tenant's turns) is shown to operators." }));
      return;
    }
    const stat = (value, label, of) => el("div", { class: "stat" },
      el("div", { class: "stat-value" }, fmtInt(value), of != null ? el("span", { class: "of", text: ` / ${of}` }) : null),
      el("div", { class: "stat-label", text: label }));
    const stats = el("div", { class: "stats" },
      stat(batch.decoding, "rows decoding", batch.max_batch),
      stat(batch.prefilling, "prefilling"),
      stat(batch.queued, "in the prefill queue"),
      stat(batch.waiting_for_memory, "waiting for memory"));
    const list = el("ul", { class: "running" });
    for (const row of batch.turns) {
      const t = row.turn;
      const progress = t.phase === "prefill" ? `${fmtInt(t.tokens_prefilled)} / ${fmtInt(t.tokens_to_prefill)} tok`
        : t.phase === "decode" ? `${fmtInt(t.tokens_generated)} / ${fmtInt(t.max_tokens)} tok` : fmtMs(t.elapsed_ms);
      list.append(el("li", {},
        el("span", { class: "phase", text: t.phase }),
        el("span", { class: "id", text: displayId(row.tenant, t.agent_id) }),
        el("span", { class: "progress", text: progress })));
    }
    if (!batch.turns.length) list.append(el("li", { class: "empty", text: "Idle: no turn on the GPU." }));
    box.replaceChildren(stats, list);
  }

  // -- agents ------------------------------------------------------------------------

  async function refreshAgents() {
    const generation = state.generation;
    const body = await getJSON("v1/status/agents");
    if (generation !== state.generation) return;
    setConnection(true);
    state.agents = body.data;
    state.usage = body.usage;
    renderAgents();
    if (state.status && !state.status.memory) renderUsage();
  }

  const SORT_VALUE = {
    id: (a) => a.id,
    tier: (a) => TIER_ORDER[a.tier] ?? 9,
    cached_tokens: (a) => a.cached_tokens,
    ram_bytes: (a) => a.ram_bytes,
    disk_bytes: (a) => a.disk_bytes,
    model_tag: (a) => a.model_tag || "",
    reused: (a) => (a.last_turn ? a.last_turn.usage.tokens_reused : -1),
    ttft: (a) => (a.last_turn && a.last_turn.usage.tokens_generated ? a.last_turn.usage.ttft_ms : -1),
    last_used: (a) => a.last_used ?? 0,
  };

  function sortedAgents() {
    const value = SORT_VALUE[state.sort.key] || SORT_VALUE.id;
    const dir = state.sort.dir;
    return [...state.agents].sort((a, b) => {
      const va = value(a);
      const vb = value(b);
      const order = typeof va === "string" ? va.localeCompare(vb) : va - vb;
      return order * dir || a.id.localeCompare(b.id);
    });
  }

  function makeRow(id) {
    const cells = {};
    const labels = { tokens: "Tokens", ram: "RAM", disk: "Disk", model: "Model", last: "Last turn", ttft: "TTFT", used: "Last used" };
    const td = (name, cls) => (cells[name] = el("td", { class: `${cls} c-${name}`, "data-label": labels[name] }));
    const tr = el("tr", { "data-agent": id },
      td("id", "id"), td("tier", "tier"), td("tokens", "num"), td("ram", "num"), td("disk", "num"),
      td("model", "model"), td("last", "num"), td("ttft", "num"), td("used", "used"), td("actions", "actions"));
    cells.actions.append(
      el("button", { type: "button", class: "button ghost small chat-with", text: "Chat", onclick: () => chatWith(id) }),
      el("button", { type: "button", class: "button ghost small danger forget", text: "Forget", onclick: () => forget(id) }));
    state.cells.set(tr, cells);
    return tr;
  }

  function fillRow(tr, a) {
    const c = state.cells.get(tr);
    c.id.replaceChildren(...present(a.id, a.live ? el("span", { class: "live-mark", title: "its actor is running" }) : null));
    c.id.title = a.id;
    const badge = tierBadge(a.tier);
    if (a.running) badge.title = `running: ${a.running.phase}`;
    c.tier.replaceChildren(badge);
    c.tier.dataset.tier = a.tier;
    c.tokens.textContent = fmtInt(a.cached_tokens);
    c.ram.textContent = a.ram_bytes ? fmtBytes(a.ram_bytes) : "–";
    c.ram.title = a.ram_bytes ? `Q4 ${fmtBytes(a.ram_bytes - a.float_bytes)} + float ${fmtBytes(a.float_bytes)}` : "not in RAM";
    c.disk.textContent = a.disk_bytes ? fmtBytes(a.disk_bytes) : "–";
    c.disk.title = a.dirty ? "a newer cache is waiting to be saved" : "";
    c.disk.classList.toggle("dim", a.dirty);
    c.model.textContent = modelName(a.model_tag);
    c.model.title = a.model_tag || "";
    const t = a.last_turn, u = t && t.usage;
    c.last.textContent = t ? `${fmtInt(u.tokens_reused)} · ${fmtInt(u.tokens_prefilled)}` : "–";
    c.last.title = t ? `tier ${u.tier}, ${fmtInt(u.tokens_generated)} generated, ${t.finish_reason}` : "no turn since the server started";
    c.ttft.textContent = t && u.tokens_generated ? fmtMs(u.ttft_ms) : "–";
    c.used.textContent = fmtAgo(a.last_used);
    c.used.title = fmtTime(a.last_used);
  }

  function renderAgents() {
    const body = $("agents-body");
    const seen = new Set();
    sortedAgents().forEach((agent, index) => {
      let tr = state.rows.get(agent.id);
      if (!tr) {
        tr = makeRow(agent.id);
        state.rows.set(agent.id, tr);
      }
      fillRow(tr, agent);
      if (body.children[index] !== tr) body.insertBefore(tr, body.children[index] || null);
      seen.add(agent.id);
    });
    for (const [id, tr] of state.rows) {
      if (!seen.has(id)) {
        tr.remove();
        state.rows.delete(id);
      }
    }
    $("agents-empty").hidden = state.agents.length > 0;
    setText("agents-count", state.agents.length ? String(state.agents.length) : "");
    const ram = state.agents.reduce((sum, a) => sum + a.ram_bytes, 0);
    const disk = state.agents.reduce((sum, a) => sum + a.disk_bytes, 0);
    setText("agents-note", state.agents.length ? `${fmtBytes(ram)} in RAM · ${fmtBytes(disk)} on disk` : "");
    for (const th of document.querySelectorAll("#agents th[data-sort]")) {
      const key = th.dataset.sort;
      if (key === state.sort.key) th.setAttribute("aria-sort", state.sort.dir > 0 ? "ascending" : "descending");
      else th.removeAttribute("aria-sort");
    }
    $("agents-sort").value = state.sort.key in SORT_VALUE ? state.sort.key : "last_used";
    const ids = $("agent-ids");
    ids.replaceChildren(...state.agents.map((a) => el("option", { value: a.id })));
  }

  function sortBy(key) {
    if (state.sort.key === key) state.sort.dir = -state.sort.dir;
    else state.sort = { key, dir: key === "id" || key === "model_tag" || key === "tier" ? 1 : -1 };
    renderAgents();
  }

  async function forget(id) {
    const ok = window.confirm(`Forget agent “${id}”?\n\nIts cache is deleted from RAM and disk; its next turn starts cold.`);
    if (!ok) return;
    try {
      const response = await call(`v1/agents/${agentSegment(id)}`, { method: "DELETE" });
      if (!response.ok && response.status !== 404) throw new HttpError(response.status, await errorText(response));
      delete state.chats[id];
      saveChats();
      if ($("chat-agent").value.trim() === id) showConversation(id);
      else listChats();
      await refreshAgents();
    } catch (error) {
      if (error instanceof AuthError) signOut("The key is no longer accepted. Sign in again.");
      else window.alert(`Could not forget ${id}: ${error.message}`);
    }
  }

  // -- chat --------------------------------------------------------------------------

  function readChats() {
    try {
      return JSON.parse(sessionStorage.getItem(CHAT_STORE) || "{}") || {};
    } catch (_) {
      return {};
    }
  }

  function saveChats() {
    try {
      sessionStorage.setItem(CHAT_STORE, JSON.stringify(state.chats));
    } catch (_) {
      /* storage full: the conversation still lives in this page */
    }
  }

  function bubble(role, text) {
    if (role.startsWith("assistant")) {
      const node = el("div", { class: `msg ${role} md` });
      node.replaceChildren(...markdown(text));
      return node;
    }
    return el("div", { class: `msg ${role}`, text });
  }

  // -- markdown, as DOM nodes --------------------------------------------------------
  // A reply is the model's text: it is never parsed as HTML. Its markdown (paragraphs, headings, lists,
  // fenced code, inline code, bold, italics, http(s) links) becomes elements whose text is set as text,
  // so "<img onerror=...>" in a reply shows as those characters and runs nothing.

  function inline(text) {
    const out = [];
    const pattern = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\n]+\*|_[^_\n]+_)|(\[[^\]\n]+\]\((https?:\/\/[^\s)]+)\))/g;
    let last = 0;
    for (const m of text.matchAll(pattern)) {
      if (m.index > last) out.push(document.createTextNode(text.slice(last, m.index)));
      if (m[1]) out.push(el("code", { text: m[1].slice(1, -1) }));
      else if (m[2]) out.push(el("strong", { text: m[2].slice(2, -2) }));
      else if (m[3]) out.push(el("em", { text: m[3].slice(1, -1) }));
      else {
        const label = m[4].slice(1, m[4].indexOf("]("));
        out.push(el("a", { href: m[5], target: "_blank", rel: "noopener noreferrer", text: label }));
      }
      last = m.index + m[0].length;
    }
    if (last < text.length) out.push(document.createTextNode(text.slice(last)));
    return out;
  }

  function markdown(text) {
    const blocks = [];
    const lines = String(text).split("\n");
    let para = [];
    let list = null;
    const endPara = () => {
      if (para.length) blocks.push(el("p", {}, ...inline(para.join("\n"))));
      para = [];
    };
    const endList = () => { list = null; };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*```/);
      if (fence) {
        endPara(); endList();
        const code = [];
        for (i += 1; i < lines.length && !/^\s*```/.test(lines[i]); i++) code.push(lines[i]);
        blocks.push(el("pre", {}, el("code", { text: code.join("\n") })));
        continue;
      }
      const heading = line.match(/^(#{1,3})\s+(.*)$/);
      const bullet = line.match(/^\s*[-*]\s+(.*)$/);
      const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
      if (heading) {
        endPara(); endList();
        blocks.push(el(`h${heading[1].length}`, {}, ...inline(heading[2])));
      } else if (bullet || numbered) {
        endPara();
        const tag = bullet ? "ul" : "ol";
        if (!list || list.tagName.toLowerCase() !== tag) {
          list = el(tag);
          blocks.push(list);
        }
        list.append(el("li", {}, ...inline((bullet || numbered)[1])));
      } else if (!line.trim()) {
        endPara(); endList();
      } else {
        endList();
        para.push(line);
      }
    }
    endPara();
    return blocks;
  }

  function showConversation(id) {
    const log = $("chat-log");
    const history = state.chats[id] || [];
    if (!history.length) {
      log.replaceChildren(el("p", { class: "empty", text: id ? `No messages with ${id} in this tab yet.` : "The conversation appears here." }));
    } else {
      log.replaceChildren(...history.map((m) => bubble(m.role, m.content)));
    }
    log.scrollTop = log.scrollHeight;
    $("chat-turn").replaceChildren();
    listChats();
  }

  // The conversations this tab holds (sessionStorage): one button each, the shown one marked.
  function listChats() {
    const shown = $("chat-agent").value.trim();
    $("chat-list").replaceChildren(...Object.keys(state.chats).sort().map((id) => {
      const turns = state.chats[id].filter((m) => m.role === "user").length;
      return el("button", { type: "button", class: `button ghost small${id === shown ? " current" : ""}`,
                            text: `${id} · ${turns} turn${turns === 1 ? "" : "s"}`, onclick: () => chatWith(id) });
    }));
  }

  function chatWith(id) {
    $("chat-agent").value = id;
    showConversation(id);
    $("chat-input").focus();
    document.querySelector(".card-chat").scrollIntoView({ behavior: "smooth", block: "nearest" });
  }

  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    const flush = (block) => {
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) continue; // a keep-alive comment
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(event, JSON.parse(data.join("\n")));
    };
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        flush(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
      }
    }
    if (buffer.trim()) flush(buffer);
  }

  function showTurn(result) {
    const u = result.usage;
    const item = (label, value) => el("span", {}, `${label} `, el("b", { text: value }));
    $("chat-turn").replaceChildren(
      tierBadge(u.tier),
      item("reused", fmtInt(u.tokens_reused)),
      item("prefilled", fmtInt(u.tokens_prefilled)),
      item("generated", fmtInt(u.tokens_generated)),
      item("TTFT", fmtMs(u.ttft_ms)),
      item("decode", `${fmtRate(u.decode_tps)} tok/s`),
      item("match", u.match));
    $("chat-turn").dataset.tier = u.tier;
  }

  async function sendChat(event) {
    event.preventDefault();
    if (state.chatBusy) return;
    const id = $("chat-agent").value.trim();
    const text = $("chat-input").value.trim();
    const error = $("chat-error");
    error.hidden = true;
    if (!id || !text) return;
    const maxTokens = Math.max(1, Math.min(8192, parseInt($("chat-max").value, 10) || 64));
    const temperature = Math.max(0, Math.min(2, parseFloat($("chat-temperature").value) || 0));
    const topP = Math.max(0.01, Math.min(1, parseFloat($("chat-top-p").value) || 1));
    const system = $("chat-system").value.trim();
    const history = state.chats[id] || [];
    const messages = [...history, { role: "user", content: text }];
    const log = $("chat-log");
    if (!history.length) log.replaceChildren();
    const reply = bubble("assistant streaming", "");
    log.append(bubble("user", text), reply);
    log.scrollTop = log.scrollHeight;
    $("chat-turn").replaceChildren(el("span", { text: "waiting for the first token…" }));
    $("chat-turn").dataset.tier = "";
    $("chat-input").value = "";
    state.chatBusy = true;
    $("chat-send").disabled = true;
    try {
      const response = await call(`v1/agents/${agentSegment(id)}/messages`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ messages, max_tokens: maxTokens, stream: true, temperature, top_p: topP,
                               ...(system ? { system } : {}) }),
      });
      if (!response.ok) throw new HttpError(response.status, await errorText(response));
      let streamed = "";
      let result = null;
      let failure = null;
      await readEvents(response, (name, data) => {
        if (name === "delta") {
          streamed += data.text;
          reply.replaceChildren(...markdown(streamed));
          log.scrollTop = log.scrollHeight;
        } else if (name === "done") {
          result = data;
        } else if (name === "error") {
          failure = (data.error && data.error.message) || "the turn failed";
        }
      });
      if (failure || !result) throw new Error(failure || "the stream ended without a result");
      reply.classList.remove("streaming");
      reply.replaceChildren(...markdown(result.content));
      state.chats[id] = [...messages, { role: "assistant", content: result.content }];
      saveChats();
      listChats();
      showTurn(result);
      refreshAgents().catch(onPollError);
    } catch (err) {
      reply.remove();
      $("chat-input").value = text;
      if (err instanceof AuthError) {
        signOut("The key is no longer accepted. Sign in again.");
        return;
      }
      log.append(bubble("error", `Not sent: ${err.message}`));
      $("chat-turn").replaceChildren();
    } finally {
      state.chatBusy = false;
      $("chat-send").disabled = false;
    }
  }

  // -- scenarios -----------------------------------------------------------------------

  function scenarioNote(text) {
    $("scenario-back").hidden = true;
    $("scenarios").replaceChildren(el("p", { class: "operator-only", text }));
  }

  async function refreshScenarios() {
    if (!state.status) return;
    if (!state.status.caller.operator) {
      scenarioNote("Scenarios are shown to operators.");
      return;
    }
    if (state.scenarioRun) {
      await showRun(state.scenarioRun);
      return;
    }
    const generation = state.generation;
    const response = await call("v1/scenarios");
    if (generation !== state.generation) return;
    if (response.status === 404 || response.status === 405) {
      scenarioNote("This server does not serve scenarios (kvmem serve does).");
      return;
    }
    if (response.status === 403) {
      scenarioNote("Scenarios are shown to operators.");
      return;
    }
    if (!response.ok) throw new HttpError(response.status, await errorText(response));
    renderScenarioList(await response.json());
  }

  function statusBadge(status) {
    return el("span", { class: `status ${status}`, text: status });
  }

  function renderScenarioList(body) {
    $("scenario-back").hidden = true;
    const library = el("ul", { class: "sc-list" });
    for (const s of body.library) {
      library.append(el("li", { "data-scenario": s.name },
        el("div", { class: "grow" },
          el("div", { class: "name", text: s.title || s.name }),
          el("div", { class: "what", text: `${s.name} · ${s.agents} agents · ${s.phases} phases` })),
        el("button", { type: "button", class: "button ghost small", text: "Run", onclick: () => runScenario(s) })));
    }
    const runs = el("ul", { class: "sc-list" });
    for (const r of body.runs) {
      runs.append(el("li", { "data-run": r.id },
        el("button", { type: "button", class: "linkish grow", onclick: () => openRun(r.id) },
          el("div", { class: "name", text: r.title || r.scenario }),
          el("div", { class: "what", text: `${r.id} · ${fmtInt(r.turns_done)} turns · ${fmtAgo(r.started_at)}` })),
        statusBadge(r.status)));
    }
    if (!body.runs.length) runs.append(el("li", { class: "empty", text: "No runs yet." }));
    $("scenarios").replaceChildren(
      el("div", { class: "sc-section" }, el("h3", { text: "Runs" }), runs),
      el("div", { class: "sc-section" }, el("h3", { text: "Shipped scenarios" }), library));
  }

  async function runScenario(s) {
    if (!window.confirm(`Run scenario “${s.title || s.name}”?\n\nIts ${s.agents} agents take turns on this server.`)) return;
    try {
      const response = await call("v1/scenarios", {
        method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ name: s.name }),
      });
      if (!response.ok) throw new HttpError(response.status, await errorText(response));
      const started = await response.json();
      await openRun(started.id);
    } catch (error) {
      if (error instanceof AuthError) signOut("The key is no longer accepted. Sign in again.");
      else window.alert(`Could not start ${s.name}: ${error.message}`);
    }
  }

  async function openRun(id) {
    state.scenarioRun = id;
    try {
      await showRun(id);
    } catch (error) {
      onPollError(error);
    }
  }

  function figure(label, value) {
    return el("div", { class: "stat" }, el("div", { class: "stat-value", text: value }), el("div", { class: "stat-label", text: label }));
  }

  async function showRun(id) {
    const generation = state.generation;
    const run = await getJSON(`v1/scenarios/${encodeURIComponent(id)}`);
    if (state.scenarioRun !== id || generation !== state.generation) return;
    $("scenario-back").hidden = false;
    const report = run.report || {};
    const saved = report.prompt_tokens ? 1 - report.prefilled / report.prompt_tokens : null;
    const speedup = report.cold_wall_s && report.wall_s ? `${(report.cold_wall_s / report.wall_s).toFixed(1)}×` : "–";
    const figures = el("div", { class: "sc-figures" },
      figure("prompt tokens", fmtInt(report.prompt_tokens)),
      figure("prefilled", fmtInt(report.prefilled)),
      figure("prefill saved", fmtPct(saved)),
      figure("generated", fmtInt(report.generated)),
      figure("wall", report.wall_s != null ? `${report.wall_s.toFixed(1)} s` : "–"),
      figure("vs cold", speedup));
    const phases = el("tbody");
    for (const p of run.phases) {
      phases.append(el("tr", {},
        el("td", { text: p.label || p.name }),
        el("td", {}, statusBadge(p.status)),
        el("td", { class: "num" }, `${p.turns_done} / ${p.turns_total}`,
          el("span", { class: "phase-bar" }, bar(p.turns_done, p.turns_total, { progress: true })))));
    }
    const rows = el("tbody");
    for (const r of report.rows || []) {
      rows.append(el("tr", {},
        el("td", { text: r.agent }), el("td", { text: r.phase }),
        el("td", { class: "num", text: fmtInt(r.reused) }), el("td", { class: "num", text: fmtInt(r.prefilled) }),
        el("td", {}, tierBadge(r.first_tier))));
    }
    const table = (head, body) => el("div", { class: "table-wrap" },
      el("table", { class: "table compact" }, el("thead", {}, el("tr", {}, ...head.map(([h, cls]) => el("th", { class: cls, text: h })))), body));
    $("scenarios").replaceChildren(
      el("p", { class: "sc-title", text: run.title || run.scenario }),
      el("p", { class: "sc-sub" }, statusBadge(run.status), `  ${run.id} · ${run.model} · ${run.turns_done} / ${run.turns_total} turns`),
      figures,
      el("div", { class: "sc-section" }, el("h3", { text: "Phases" }), table([["Phase"], ["Status"], ["Turns", "num"]], phases)),
      el("div", { class: "sc-section" }, el("h3", { text: "Working memory" }),
        table([["Agent"], ["Phase"], ["Reused", "num"], ["Prefilled", "num"], ["First tier"]], rows)));
  }

  // -- wiring ------------------------------------------------------------------------

  function wire() {
    $("signin-form").addEventListener("submit", signIn);
    $("signout").addEventListener("click", () => signOut(""));
    for (const th of document.querySelectorAll("#agents th[data-sort]")) {
      th.tabIndex = 0;
      th.addEventListener("click", () => sortBy(th.dataset.sort));
      th.addEventListener("keydown", (e) => {
        if (e.key === "Enter" || e.key === " ") {
          e.preventDefault();
          sortBy(th.dataset.sort);
        }
      });
    }
    $("agents-sort").addEventListener("change", (e) => {
      const key = e.target.value;
      state.sort = { key, dir: key === "id" || key === "tier" ? 1 : -1 };
      renderAgents();
    });
    $("chat-form").addEventListener("submit", sendChat);
    $("chat-input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        $("chat-form").requestSubmit();
      }
    });
    $("chat-agent").addEventListener("change", () => showConversation($("chat-agent").value.trim()));
    $("scenario-back").addEventListener("click", () => {
      state.scenarioRun = null;
      refreshScenarios().catch(onPollError);
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    takeKeyFromFragment();
    wire();
    start();
  });
  // A #key=... link opened on the page already loaded: sign in with that key.
  window.addEventListener("hashchange", () => {
    const before = sessionStorage.getItem(KEY_STORE);
    if (takeKeyFromFragment()) {
      stopPolling();
      if (sessionStorage.getItem(KEY_STORE) !== before) forgetView();
      start();
    }
  });
})();
