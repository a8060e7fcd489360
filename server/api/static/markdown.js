// Safe markdown for model output: text in, DOM nodes out.
//
// Model text is never parsed as HTML. Every piece of it becomes a Text node (createTextNode /
// textContent) inside elements this file creates itself, so `<script>`, `<img onerror=…>` and
// friends show up as the literal characters they are. Links are kept only for http(s) URLs.
// The subset: fenced code blocks (with a Copy button), inline code, headings, bold, italics,
// links, bullet and numbered lists, block quotes, rules and paragraphs. An unclosed fence (the
// usual state while an answer streams) renders as a code block up to the end of the text.
"use strict";

(function () {
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])\s+(.*)$/;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function isBlockStart(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
  }

  function codeBlock(code, lang) {
    const box = el("div", "code");
    const head = el("div", "code-head");
    head.append(el("span", "code-lang", lang || "text"));
    const copy = el("button", "copy", "Copy");
    copy.type = "button";
    copy.setAttribute("aria-label", "Copy code" + (lang ? " (" + lang + ")" : ""));
    head.append(copy);
    const pre = el("pre");
    pre.append(el("code", null, code));
    box.append(head, pre);
    return box;
  }

  // Inline spans, earliest match first. Group numbers are used by `inline` below.
  const INLINE = new RegExp([
    "(`+)([^`]|[^`][\\s\\S]*?[^`])\\1(?!`)",          // 1,2: `code`
    "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*",               // 3: **bold**
    "__(?=\\S)([\\s\\S]*?\\S)__(?!\\w)",                // 4: __bold__
    "\\*(?=[^\\s*])([^*]*?[^\\s*])\\*",                 // 5: *em*
    "(?<!\\w)_(?=[^\\s_])([^_]*?[^\\s_])_(?!\\w)",      // 6: _em_
    "\\[([^\\]\\n]+)\\]\\((https?:\\/\\/[^\\s)]+)\\)",   // 7,8: [text](http://…)
    "(https?:\\/\\/[^\\s<>]*[^\\s<>.,;:!?)\\]'\"])",     // 9: bare URL
  ].join("|"));

  function link(href, text) {
    const a = el("a", null, text);
    a.href = href; // only http(s) reaches here (see INLINE)
    a.target = "_blank";
    a.rel = "noopener noreferrer nofollow";
    return a;
  }

  function textWithBreaks(parent, text) {
    const parts = text.split("\n");
    parts.forEach((p, i) => {
      if (i) parent.append(el("br"));
      if (p) parent.append(document.createTextNode(p));
    });
  }

  function inline(parent, text) {
    while (text) {
      const m = INLINE.exec(text);
      if (!m) { textWithBreaks(parent, text); return; }
      if (m.index) textWithBreaks(parent, text.slice(0, m.index));
      if (m[2] !== undefined) parent.append(el("code", null, m[2]));
      else if (m[3] !== undefined || m[4] !== undefined) inline(parent.appendChild(el("strong")), m[3] ?? m[4]);
      else if (m[5] !== undefined || m[6] !== undefined) inline(parent.appendChild(el("em")), m[5] ?? m[6]);
      else if (m[7] !== undefined) parent.append(link(m[8], m[7]));
      else parent.append(link(m[9], m[9]));
      text = text.slice(m.index + m[0].length);
    }
  }

  function render(src) {
    const out = document.createDocumentFragment();
    const lines = String(src).replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if ((m = FENCE.exec(line))) {
        const fence = m[1];
        const body = [];
        i++;
        while (i < lines.length && !(lines[i].trim().startsWith(fence) && lines[i].trim().replace(/[`~]/g, "") === "")) {
          body.push(lines[i++]);
        }
        i++; // the closing fence (or past the end while the answer is still streaming)
        out.append(codeBlock(body.join("\n"), m[2]));
      } else if (!line.trim()) {
        i++;
      } else if ((m = HEADING.exec(line))) {
        // Model headings sit below the page's own h1/h2, so # becomes h3 and so on.
        const h = el("h" + Math.min(6, m[1].length + 2));
        inline(h, m[2]);
        out.append(h);
        i++;
      } else if (RULE.test(line)) {
        out.append(el("hr"));
        i++;
      } else if (QUOTE.test(line)) {
        const body = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) { body.push(m[1]); i++; }
        const q = el("blockquote");
        q.append(render(body.join("\n")));
        out.append(q);
      } else if ((m = ITEM.exec(line))) {
        const ordered = /\d/.test(m[2]);
        const list = el(ordered ? "ol" : "ul");
        if (ordered && parseInt(m[2], 10) !== 1) list.start = parseInt(m[2], 10);
        while (i < lines.length && (m = ITEM.exec(lines[i])) && /\d/.test(m[2]) === ordered) {
          const item = [m[3]];
          i++;
          // Continuation lines: indented, and not the start of another block.
          while (i < lines.length && /^\s{2,}\S/.test(lines[i]) && !ITEM.test(lines[i])) item.push(lines[i++].trim());
          const li = el("li");
          inline(li, item.join("\n"));
          list.append(li);
        }
        out.append(list);
      } else {
        const para = [];
        while (i < lines.length && lines[i].trim() && (para.length === 0 || !isBlockStart(lines[i]))) para.push(lines[i++]);
        const p = el("p");
        inline(p, para.join("\n"));
        out.append(p);
      }
    }
    return out;
  }

  window.PagewireMarkdown = { render };
})();
