// pagewire chat page, the view: every DOM node the page builds for conversations and messages
// (the sidebar's list, each message's body, folded thinking, notice, stats and actions, the
// edit box), repaints batched to one per animation frame, the composer's Send/Stop, the
// connection line, the theme and the mobile menu. Model text goes through markdown.js only.
// chat.js owns the state, the socket and the actions; it builds this view with
// `PagewireChatView(app)`, passing what the view reads and the actions its buttons call.
"use strict";

window.PagewireChatView = function (app) {
  const { state, OPEN, current, openMsg, save, deleteConv, regenerate, resend } = app;
  const $ = (id) => document.getElementById(id);
  const md = window.PagewireMarkdown;

  const nodes = new WeakMap(); // msg → its <article>
  const openThinking = new WeakSet(); // messages whose folded thinking the reader opened
  const dirty = new Set();
  let frame = 0;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function button(text, label, onClick) {
    const b = el("button", null, text);
    b.type = "button";
    if (label) b.setAttribute("aria-label", label);
    b.addEventListener("click", onClick);
    return b;
  }

  function renderSidebar() {
    const list = $("conv-list");
    list.replaceChildren();
    for (const id of state.order) {
      const conv = state.convs[id];
      const li = el("li");
      if (id === state.current) li.setAttribute("aria-current", "true");
      const open = button(conv.title, null, () => { state.current = id; save(true); renderAll(); closeMenu(); });
      open.className = "open";
      const del = button("✕", "Delete conversation " + conv.title, () => deleteConv(id));
      del.className = "del";
      li.append(open, del);
      list.append(li);
    }
  }

  function renderAll() {
    renderSidebar();
    renderConv();
  }

  function renderConv() {
    const conv = current();
    $("conv-title").textContent = conv ? conv.title : "New chat";
    $("system").value = conv ? conv.system : "";
    const box = $("messages");
    box.replaceChildren();
    if (conv) conv.messages.forEach((m, i) => box.append(messageNode(conv, m, i)));
    updateComposer();
    box.scrollTop = box.scrollHeight;
  }

  function messageNode(conv, msg, index) {
    const art = el("article", "msg " + msg.role);
    art.dataset.index = index;
    nodes.set(msg, art);
    fillMessage(conv, msg, art);
    return art;
  }

  // (Re)build one message's contents: body, notice, stats and actions.
  function fillMessage(conv, msg, art) {
    const g = msg.gen;
    const streaming = g && OPEN.has(g.state);
    art.dataset.state = g ? g.state : "sent";
    if (g) art.dataset.seq = g.seq;
    art.setAttribute("aria-busy", streaming ? "true" : "false");
    const body = el("div", "body");
    const parts = [el("div", "role", msg.role === "user" ? "You" : "Assistant"), body];
    if (msg.role === "user") {
      body.textContent = msg.content;
    } else {
      if (msg.reasoning) parts.splice(1, 0, thinkingNode(msg, streaming && !msg.content));
      body.append(md.render(msg.content));
      if (!msg.content && g && (g.state === "sending" || g.state === "queued")) {
        body.append(el("p", "status-" + g.state, g.state === "queued" ? "Queued: waiting for a free slot in the model…" : "Sending…"));
      }
      if (streaming) cursorTarget(body).append(Object.assign(el("span", "cursor"), { ariaHidden: "true" }));
      if (g && (g.state === "busy" || g.state === "interrupted" || g.state === "error")) {
        const note = el("div", "notice", g.state === "busy" ? busyText(g) : g.error);
        note.setAttribute("role", g.state === "busy" ? "status" : "alert");
        parts.push(note);
      }
    }
    parts.push(metaNode(conv, msg));
    art.replaceChildren(...parts);
  }

  // A reasoning model's thinking: folded under "Thinking" (open on click). Repaints rebuild the
  // node, so whether the reader opened it is kept per message.
  function thinkingNode(msg, thinking) {
    const d = el("details", "thinking");
    d.open = openThinking.has(msg);
    d.addEventListener("toggle", () => { if (d.open) openThinking.add(msg); else openThinking.delete(msg); });
    d.append(el("summary", null, thinking ? "Thinking…" : "Thinking"), md.render(msg.reasoning));
    return d;
  }

  // The deepest last block, so the typing cursor sits right after the last character.
  function cursorTarget(body) {
    let t = body.lastElementChild;
    if (!t) return body;
    if (t.classList.contains("code")) return t.querySelector("code");
    while (t.lastElementChild && /^(UL|OL|LI|BLOCKQUOTE)$/.test(t.tagName)) t = t.lastElementChild;
    return t.tagName === "HR" ? body : t;
  }

  function busyText(g) {
    const s = Math.max(0, Math.ceil((g.retryAt - Date.now()) / 1000));
    const what = g.code === "overloaded" ? "Server busy (429)" : "Server unavailable (" + g.code + ")";
    return what + ": " + g.error + " Retrying in " + s + " s.";
  }

  function metaNode(conv, msg) {
    const meta = el("div", "meta");
    const last = conv.messages[conv.messages.length - 1] === msg;
    const busy = !!openMsg(conv);
    if (msg.role === "assistant") {
      const s = msg.stats || {};
      const bits = [];
      if (s.ttft_ms !== undefined) bits.push("TTFT " + s.ttft_ms + " ms");
      if (s.tok_s !== undefined) bits.push(s.tok_s.toFixed(1) + " tok/s");
      if (s.usage) bits.push(s.usage.prompt_tokens + " prompt + " + s.usage.completion_tokens + " tokens" +
        (s.usage.cached_tokens ? " (" + s.usage.cached_tokens + " cached)" : ""));
      if (s.finish_reason) bits.push(s.finish_reason === "length" ? "stopped at max tokens" : s.finish_reason);
      if (msg.gen && msg.gen.resumes) bits.push("resumed ×" + msg.gen.resumes);
      if (bits.length) meta.append(el("span", "stats", bits.join(" · ")));
      const actions = el("span", "actions");
      if (msg.content) actions.append(button("Copy", "Copy this answer", (e) => copyText(msg.content, e.target)));
      if (last && !busy) actions.append(button("Regenerate", "Regenerate this answer", () => regenerate(conv)));
      meta.append(actions);
    } else if (!busy) {
      const actions = el("span", "actions");
      actions.append(button("Edit", "Edit and resend this message", () => editMessage(conv, msg)));
      meta.append(actions);
    }
    return meta;
  }

  function editMessage(conv, msg) {
    const art = nodes.get(msg);
    const index = conv.messages.indexOf(msg);
    const area = el("textarea");
    area.value = msg.content;
    area.setAttribute("aria-label", "Edit message");
    const go = () => resend(conv, index, area.value);
    area.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); go(); }
      if (e.key === "Escape") { e.stopPropagation(); renderConv(); }
    });
    const row = el("div");
    const ok = button("Send", "Send the edited message", go);
    ok.className = "primary";
    row.append(ok, button("Cancel", "Cancel editing", () => renderConv()));
    const box = el("div", "edit-box");
    box.append(area, row);
    art.replaceChildren(el("div", "role", "You (editing)"), box);
    area.focus();
  }

  // Repaint changed messages once per animation frame, however many deltas arrived.
  function paint(conv, msg) {
    if (conv !== current()) return;
    dirty.add(msg);
    if (!frame) frame = requestAnimationFrame(flush);
  }

  function flush() {
    frame = 0;
    const box = $("messages");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 60;
    const conv = current();
    for (const msg of dirty) {
      const art = nodes.get(msg);
      if (conv && art && art.isConnected) fillMessage(conv, msg, art);
    }
    dirty.clear();
    // The previous message's actions (Edit) depend on whether an answer is open.
    if (conv) conv.messages.forEach((m) => { const a = nodes.get(m); if (a && a.isConnected && !a.querySelector(".edit-box")) a.lastElementChild.replaceWith(metaNode(conv, m)); });
    updateComposer();
    if (atBottom) box.scrollTop = box.scrollHeight;
  }

  function updateComposer() {
    const conv = current();
    const open = !!(conv && openMsg(conv));
    $("send").hidden = open;
    $("stop").hidden = !open;
  }

  function setConn(text, down) {
    const c = $("conn");
    c.textContent = text;
    c.classList.toggle("down", !!down);
  }

  async function copyText(text, btn) {
    try {
      await navigator.clipboard.writeText(text);
    } catch (e) { // no clipboard API (plain http on a LAN address): the old way
      const t = el("textarea");
      t.value = text;
      document.body.append(t);
      t.select();
      document.execCommand("copy");
      t.remove();
    }
    const was = btn.textContent;
    btn.textContent = "Copied";
    setTimeout(() => { btn.textContent = was; }, 1500);
  }

  function applyTheme() {
    const t = state.settings.theme;
    if (t === "light" || t === "dark") document.documentElement.dataset.theme = t;
    else delete document.documentElement.dataset.theme;
  }

  function closeMenu() {
    $("sidebar").classList.remove("open");
    $("menu").setAttribute("aria-expanded", "false");
  }

  return { renderSidebar, renderAll, renderConv, paint, setConn, copyText, applyTheme, closeMenu };
};
