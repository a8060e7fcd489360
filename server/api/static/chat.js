// pagewire chat page: conversations in localStorage, answers streamed over the /v1/ws protocol
// (docs/websocket.md), with reconnect-and-resume so a dropped socket loses and repeats nothing.
// This file owns the state, the socket and the chat actions; what the page shows is built by
// chat_view.js (loaded before it), which calls back into the actions passed to it.
//
// An answer in progress is a "generation" stored on its assistant message (`msg.gen`):
//   key         idempotency key, chosen here before the first send
//   req         the generate frame's body (kind, messages, params, detach), kept for re-sending
//   request_id  the server's id, known once `accepted` arrived
//   seq         the seq of the last delta whose text is in msg.content (and its thinking in
//               msg.reasoning: a reasoning model's `reasoning_content`, shown folded)
//   state       sending → queued → streaming → done | cancelled | interrupted | error
//               (busy: refused with a retry hint, waiting to try again)
// msg.content and gen.seq are always saved together, so after a reload or a reconnect the page
// knows exactly which text it already shows.
"use strict";

(function () {
  const STORE = "pagewire.chat.v1";
  const OPEN = new Set(["sending", "queued", "streaming"]);
  const $ = (id) => document.getElementById(id);

  // -- persisted state -------------------------------------------------------------------------
  const DEFAULTS = { temperature: 0.7, top_p: 1, max_tokens: 1024, theme: "auto" };
  let state = load();
  let saveTimer = null;

  function load() {
    try {
      const s = JSON.parse(localStorage.getItem(STORE));
      if (s && s.convs && Array.isArray(s.order)) {
        s.settings = Object.assign({}, DEFAULTS, s.settings);
        return s;
      }
    } catch (e) { /* unreadable: start fresh */ }
    return { convs: {}, order: [], current: null, settings: Object.assign({}, DEFAULTS) };
  }

  // Deltas save at most every 200 ms; state changes that matter (accepted, done, …) save at once.
  function save(now) {
    if (now) {
      clearTimeout(saveTimer);
      saveTimer = null;
      write();
    } else if (!saveTimer) {
      saveTimer = setTimeout(() => { saveTimer = null; write(); }, 200);
    }
  }

  function write() {
    try { localStorage.setItem(STORE, JSON.stringify(state)); } catch (e) { setConn("cannot save: " + e.message, true); }
  }

  function uid() {
    const b = crypto.getRandomValues(new Uint8Array(12)); // works without a secure context, unlike randomUUID
    return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
  }

  const current = () => state.convs[state.current] || null;
  const openMsg = (conv) => conv.messages.find((m) => m.gen && (OPEN.has(m.gen.state) || m.gen.state === "busy")) || null;

  // The page's DOM (chat_view.js): the sidebar, the messages, the composer, the connection line.
  const { renderSidebar, renderAll, renderConv, paint, setConn, copyText, applyTheme, closeMenu } =
    window.PagewireChatView({ state, OPEN, current, openMsg, save, deleteConv, regenerate, resend });

  function newConv() {
    const conv = { id: uid(), title: "New chat", system: "", created: Date.now(), messages: [] };
    state.convs[conv.id] = conv;
    state.order.unshift(conv.id);
    state.current = conv.id;
    save(true);
    return conv;
  }

  // -- the API key -----------------------------------------------------------------------------
  // Kept in its own localStorage entry (not in the conversation record). Browsers cannot set
  // headers on a WebSocket, so it travels as the subprotocol `pagewire-key.<key>` next to
  // `pagewire` (docs/websocket.md); fetches send it as `Authorization: Bearer`.
  const KEY_STORE = "pagewire.apikey";
  let authRefused = null;   // the server's message when it refused the key; no reconnect loop then
  const apiKey = () => { try { return localStorage.getItem(KEY_STORE) || ""; } catch (e) { return ""; } };
  const authHeaders = () => (apiKey() ? { Authorization: "Bearer " + apiKey() } : {});

  function setApiKey(key) {
    try {
      if (key) localStorage.setItem(KEY_STORE, key); else localStorage.removeItem(KEY_STORE);
    } catch (e) { setConn("cannot save the API key: " + e.message, true); }
    authRefused = null;
    const old = ws;
    ws = null;
    live.clear();
    if (old) old.close();
    connect();            // at once, with the new key
  }

  function showAuthRefused() {
    setConn((apiKey() ? "API key refused: " : "This server needs an API key: ") + authRefused +
            " Enter a key under Settings.", true);
  }

  // -- the socket ------------------------------------------------------------------------------
  let ws = null;
  let attempt = 0;          // reconnect attempts since the last successful open
  let reconnectAt = 0;
  let reconnectTimer = null;
  let nextCid = 0;
  const live = new Map();   // client id on the current socket → {conv, msg}
  const cidOf = new WeakMap(); // msg → its client id on the current socket
  const timing = new WeakMap(); // msg → {sent, first} (performance.now(); this page's life only)

  function connect() {
    clearTimeout(reconnectTimer);
    reconnectTimer = null;
    setConn("connecting…", true);
    const key = apiKey();
    let sock;
    try {
      sock = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/v1/ws",
                           key ? ["pagewire", "pagewire-key." + key] : undefined);
    } catch (e) { // a key with characters no subprotocol may carry (spaces, quotes…)
      authRefused = "it contains characters an API key cannot have.";
      showAuthRefused();
      return;
    }
    ws = sock;
    sock.onopen = () => {
      attempt = 0;
      setConn("connected", false);
      loadModel();
      reattachAll();
    };
    sock.onmessage = (ev) => onFrame(JSON.parse(ev.data));
    sock.onclose = () => {   // always follows onerror
      if (ws !== sock) return;
      ws = null;
      live.clear();          // client ids are per connection; new ones are chosen on resume
      if (authRefused !== null) { showAuthRefused(); return; } // retrying cannot help; a new key reconnects
      scheduleReconnect();
    };
  }

  // Backoff 0.5 s, 1 s, 2 s, … up to 15 s, with ±25 % jitter so many tabs do not return in step.
  function scheduleReconnect() {
    const delay = Math.min(15000, 500 * 2 ** attempt) * (0.75 + Math.random() * 0.5);
    attempt++;
    reconnectAt = Date.now() + delay;
    reconnectTimer = setTimeout(connect, delay);
    tick();
  }

  function send(frame) {
    if (!ws || ws.readyState !== WebSocket.OPEN) return false;
    ws.send(JSON.stringify(frame));
    return true;
  }

  // After every (re)connect: pick up each answer that has not ended, in every conversation.
  function reattachAll() {
    for (const id of state.order) {
      const conv = state.convs[id];
      for (const msg of conv.messages) if (msg.gen && OPEN.has(msg.gen.state)) attach(conv, msg);
    }
  }

  // Put one open generation on the current socket under a fresh client id.
  function attach(conv, msg) {
    const g = msg.gen;
    if (!ws || ws.readyState !== WebSocket.OPEN) return; // reattachAll() does it on the next open
    const cid = "c" + ++nextCid;
    live.set(cid, { conv, msg });
    cidOf.set(msg, cid);
    if (g.request_id) {
      // RESUME. The server sends every delta with seq > after_seq, then follows the request live,
      // then its done/error. msg.content holds exactly the deltas up to g.seq (they are saved
      // together), so nothing is missed and nothing is shown twice. If the request finished
      // meanwhile the server replays the rest from memory or from the ledger, with the same seq
      // numbers; if the server restarted mid-answer, the ledger says so and we get
      // `error {code: "interrupted"}`.
      g.resumes = (g.resumes || 0) + 1;
      send({ type: "resume", request_id: g.request_id, after_seq: g.seq, id: cid });
    } else {
      // Not acknowledged yet (the socket dropped before `accepted`, or a retry after a 429):
      // send the same generate again. Its idempotency key makes the server return the original
      // request, replayed from seq 1, if the first send was committed, so an answer is never
      // generated twice.
      if (!timing.has(msg)) timing.set(msg, { sent: performance.now() });
      send(Object.assign({ type: "generate", id: cid, idempotency_key: g.key }, g.req));
    }
    if (g.cancel) send({ type: "cancel", id: cid }); // Stop was pressed while the socket was down
  }

  function onFrame(f) {
    if (f.type === "error" && f.id === undefined && f.code === "invalid_api_key") {
      authRefused = f.message + ".";  // the server closes with 1008 next
      showAuthRefused();
      return;
    }
    if (f.type === "error" && f.id === undefined) {
      // slow_consumer is followed by a close; the reconnect resumes every request.
      if (f.code !== "slow_consumer") setConn(f.message, true);
      return;
    }
    const entry = live.get(f.id);
    if (!entry) return;
    const { conv, msg } = entry;
    const g = msg.gen;
    if (f.type === "accepted") {
      g.request_id = f.request_id;
      if (g.state === "sending") g.state = "queued";
      save(true);
    } else if (f.type === "delta") {
      // Seqs grow by one per delta (a merged delta carries the newest). Anything at or below
      // g.seq is already in msg.content: drop it rather than show it twice.
      if (f.seq <= g.seq) return;
      const t = timing.get(msg);
      if (t && t.first === undefined) {
        t.first = performance.now();
        if (!g.resumes) msg.stats.ttft_ms = Math.round(t.first - t.sent);
      }
      msg.content += f.text;
      if (f.reasoning_content) msg.reasoning = (msg.reasoning || "") + f.reasoning_content;
      g.seq = f.seq;
      g.state = "streaming";
      save(false);
    } else if (f.type === "done") {
      live.delete(f.id);
      delete g.req; // only needed to re-send; the history is in the conversation already
      g.state = f.finish_reason === "cancelled" ? "cancelled" : "done";
      msg.stats.finish_reason = f.finish_reason;
      msg.stats.usage = f.usage;
      const t = timing.get(msg);
      const n = f.usage ? f.usage.completion_tokens : 0;
      // Decode speed over what this page watched live; a resumed answer has no honest figure.
      if (t && t.first !== undefined && !g.resumes && n > 1) {
        const secs = (performance.now() - t.first) / 1000;
        if (secs > 0) msg.stats.tok_s = (n - 1) / secs;
      }
      save(true);
    } else if (f.type === "error") {
      live.delete(f.id);
      onError(conv, msg, f);
    }
    paint(conv, msg);
  }

  function onError(conv, msg, f) {
    const g = msg.gen;
    if (g.cancel && !g.request_id) {
      g.state = "cancelled"; // Stop was pressed before the server took it; do not retry
    } else if (f.retry_after_ms !== undefined && !g.request_id) {
      // Refused before acceptance (429 overloaded, starting, shutting down): nothing was
      // committed, so try the same generate again when the server says to.
      g.state = "busy";
      g.code = f.code;
      g.error = f.message;
      g.retryAt = Date.now() + f.retry_after_ms;
      scheduleRetry(conv, msg);
    } else if (f.code === "interrupted") {
      g.state = "interrupted";
      g.error = "Interrupted: the server stopped before this answer finished.";
    } else if (f.code === "request_not_found" && g.request_id) {
      g.state = "interrupted";
      g.error = "Interrupted: the server no longer knows this request (restarted with another ledger?).";
    } else {
      g.state = "error";
      g.error = (f.param ? f.param + ": " : "") + f.message + " (" + f.code + ")";
    }
    if (f.usage) msg.stats.usage = f.usage;
    if (g.state !== "busy") delete g.req;
    save(true);
  }

  const retryTimers = new WeakMap();
  function scheduleRetry(conv, msg) {
    clearTimeout(retryTimers.get(msg));
    retryTimers.set(msg, setTimeout(() => {
      if (msg.gen.state !== "busy") return;
      msg.gen.state = "sending";
      save(true);
      attach(conv, msg);
      paint(conv, msg);
    }, Math.max(0, msg.gen.retryAt - Date.now())));
  }

  // -- chat actions ----------------------------------------------------------------------------
  function num(id, parse) {
    const v = parse($(id).value);
    return Number.isFinite(v) ? v : undefined;
  }

  function startGeneration(conv) {
    const history = conv.messages.filter((m) => m.content).map((m) => ({ role: m.role, content: m.content }));
    const messages = conv.system.trim() ? [{ role: "system", content: conv.system }].concat(history) : history;
    const s = state.settings;
    const params = {};
    if (s.temperature !== undefined) params.temperature = s.temperature;
    if (s.top_p !== undefined) params.top_p = s.top_p;
    if (s.max_tokens !== undefined) params.max_tokens = s.max_tokens;
    // detach: a dropped socket must not cancel the answer; Stop cancels it explicitly.
    const msg = {
      role: "assistant", content: "", stats: {},
      gen: { key: uid(), req: Object.assign({ kind: "chat", messages, params, detach: true },
                                            s.model ? { model: s.model } : {}),
             request_id: null, seq: 0, state: "sending" },
    };
    conv.messages.push(msg);
    save(true);
    renderConv();
    attach(conv, msg);
  }

  function sendMessage(text) {
    if (!text.trim()) return;
    const conv = current() || newConv();
    if (openMsg(conv)) return;
    if (!conv.messages.length) conv.title = text.trim().split("\n")[0].slice(0, 60);
    conv.messages.push({ role: "user", content: text });
    $("input").value = "";
    renderSidebar();
    startGeneration(conv);
  }

  function stop(conv) {
    const msg = conv && openMsg(conv);
    if (!msg) return;
    const g = msg.gen;
    if (g.state === "busy") { // never accepted: nothing runs on the server
      clearTimeout(retryTimers.get(msg));
      g.state = "cancelled";
      delete g.req;
      save(true);
      paint(conv, msg);
      return;
    }
    g.cancel = true;
    save(true);
    const cid = cidOf.get(msg);
    if (cid && live.has(cid)) send({ type: "cancel", id: cid }); // the server answers with done(cancelled)
  }

  function regenerate(conv) {
    if (openMsg(conv)) return;
    while (conv.messages.length && conv.messages[conv.messages.length - 1].role === "assistant") conv.messages.pop();
    if (!conv.messages.length) return;
    startGeneration(conv);
  }

  function resend(conv, index, text) {
    if (openMsg(conv) || !text.trim()) return;
    conv.messages = conv.messages.slice(0, index);
    conv.messages.push({ role: "user", content: text });
    if (index === 0) conv.title = text.trim().split("\n")[0].slice(0, 60);
    renderSidebar();
    startGeneration(conv);
  }

  function deleteConv(id) {
    const conv = state.convs[id];
    if (!conv || !confirm('Delete "' + conv.title + '"?')) return;
    stop(conv);
    delete state.convs[id];
    state.order = state.order.filter((x) => x !== id);
    if (state.current === id) state.current = state.order[0] || null;
    save(true);
    renderAll();
  }

  // -- timers and the model list ---------------------------------------------------------------
  // Once a second: the reconnect countdown and each "retrying in N s".
  function tick() {
    if (!ws && reconnectTimer) setConn("disconnected: reconnecting in " + Math.max(0, Math.ceil((reconnectAt - Date.now()) / 1000)) + " s", true);
    const conv = current();
    if (conv) for (const m of conv.messages) if (m.gen && m.gen.state === "busy") paint(conv, m);
  }

  async function loadModel() {
    try {
      const r = await fetch("/v1/models", { headers: authHeaders() });
      const data = (await r.json()).data;
      const m = data[0];
      $("model").textContent = m.id + (m.max_model_len ? " · " + m.max_model_len + " ctx" : "");
      // Several models served: a picker (an unloaded one loads on demand at its first message).
      const pick = $("model-pick");
      if (data.length > 1) {
        pick.replaceChildren(...data.map((d) => {
          const o = document.createElement("option");
          o.value = d.id;
          o.textContent = d.id + (d.loaded === false ? " (loads on first use)" : "");
          return o;
        }));
        const s = state.settings;
        if (!data.some((d) => d.id === s.model)) s.model = undefined;
        pick.value = s.model || m.id;
        pick.hidden = false;
        $("model").hidden = true;
      }
    } catch (e) { $("model").textContent = ""; }
  }

  // -- wiring ----------------------------------------------------------------------------------
  function init() {
    const s = state.settings;
    $("temperature").value = s.temperature ?? "";
    $("top-p").value = s.top_p ?? "";
    $("max-tokens").value = s.max_tokens ?? "";
    $("theme").value = s.theme;
    applyTheme();
    const setting = (id, key, parse) => $(id).addEventListener("change", () => { s[key] = num(id, parse); save(true); });
    setting("temperature", "temperature", parseFloat);
    setting("top-p", "top_p", parseFloat);
    setting("max-tokens", "max_tokens", (v) => parseInt(v, 10));
    $("theme").addEventListener("change", () => { s.theme = $("theme").value; applyTheme(); save(true); });
    $("model-pick").addEventListener("change", () => { s.model = $("model-pick").value; save(true); });
    $("api-key").value = apiKey();
    $("api-key").addEventListener("change", () => setApiKey($("api-key").value.trim()));
    $("system").addEventListener("input", () => {
      const conv = current() || newConv();
      conv.system = $("system").value;
      save(false);
      if (conv.messages.length === 0) renderSidebar();
    });
    $("new-chat").addEventListener("click", () => { newConv(); renderAll(); closeMenu(); $("input").focus(); });
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); sendMessage($("input").value); });
    $("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); sendMessage($("input").value); }
    });
    $("stop").addEventListener("click", () => stop(current()));
    document.addEventListener("keydown", (e) => {
      if (e.key !== "Escape") return;
      if ($("sidebar").classList.contains("open")) closeMenu();
      else stop(current());
    });
    $("menu").addEventListener("click", () => {
      const open = $("sidebar").classList.toggle("open");
      $("menu").setAttribute("aria-expanded", String(open));
    });
    $("close-menu").addEventListener("click", () => { closeMenu(); $("menu").focus(); });
    $("messages").addEventListener("click", (e) => {
      const b = e.target.closest(".copy");
      if (b) copyText(b.closest(".code").querySelector("code").textContent, b);
    });
    window.addEventListener("pagehide", () => save(true));
    window.addEventListener("online", () => { if (!ws) connect(); }); // network back: skip the wait
    setInterval(tick, 1000);
    // Refusals that were waiting to retry when the page was closed wait out the rest of their time.
    for (const id of state.order) for (const m of state.convs[id].messages) if (m.gen && m.gen.state === "busy") scheduleRetry(state.convs[id], m);
    if (!current() && state.order.length) state.current = state.order[0];
    renderAll();
    connect();
    $("input").focus();
  }

  init();
})();
