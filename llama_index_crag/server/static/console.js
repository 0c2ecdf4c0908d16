// The decision-trace console. Every value from the server (answers, documents, queries) is put
// into the page as text (textContent), never parsed as markup.
"use strict";

(function () {
  const KEY_STORE = "crag-api-key";
  const ACTION_HELP = {
    correct: "the retrieved passages cleared the upper threshold and were used as they came.",
    ambiguous: "scores fell between the thresholds: the passages were cut into strips and only the strips that scored were kept.",
    incorrect: "retrieval scored under the lower threshold: the question was rewritten and searched again by the fallback.",
    disabled: "correction is switched off: the retrieved passages were used as they came.",
  };
  // A quoted answer opens with this line of the engine's; the answer mode above the answer says it already.
  const QUOTED_HEADER = /^Quoted from the documents \(not generated\):[ \t]*(\r?\n)?/;
  const $ = (id) => document.getElementById(id);
  let pending = null; // the request to replay once an API key is given

  class ApiError extends Error {
    constructor(status, error) {
      super(error && error.message ? error.message : "HTTP " + status);
      this.status = status;
      this.code = (error && error.code) || "http_" + status;
    }
  }

  function el(tag, props, children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props || {})) {
      if (value === null || value === undefined) continue;
      if (name === "text") node.textContent = String(value);
      else if (name === "className") node.className = value;
      else if (name.startsWith("data-") || name.startsWith("aria-") || ["role", "title", "scope"].includes(name)) node.setAttribute(name, String(value));
      else node[name] = value;
    }
    for (const child of children || []) if (child) node.append(child);
    return node;
  }

  // A value of an explanation: numbers to at most four decimals, everything else as it is.
  function plain(value) {
    if (value === null || value === undefined) return "none";
    return typeof value === "number" ? String(Number(value.toFixed(4))) : String(value);
  }

  function fixed(value, digits) {
    return typeof value === "number" ? value.toFixed(digits) : "n/a";
  }

  function origin(source) {
    return !source || source === "retriever" ? "primary" : String(source);
  }

  function clamp01(value) {
    return Math.max(0, Math.min(1, Number(value) || 0));
  }

  // ---- HTTP -------------------------------------------------------------------------------

  function headers(json) {
    const result = {};
    if (json) result["Content-Type"] = "application/json";
    const key = sessionStorage.getItem(KEY_STORE);
    if (key) result["Authorization"] = "Bearer " + key;
    return result;
  }

  async function failure(response) {
    let error = null;
    try {
      error = (await response.json()).error;
    } catch (ignored) {
      error = { message: "HTTP " + response.status + " " + response.statusText };
    }
    return new ApiError(response.status, error);
  }

  async function getJson(path) {
    const response = await fetch(path, { headers: headers(false) });
    if (!response.ok) throw await failure(response);
    return response.json();
  }

  async function postQuery(body, onToken) {
    const response = await fetch("/query", { method: "POST", headers: headers(true), body: JSON.stringify(body) });
    if (!response.ok) throw await failure(response);
    if (!body.stream) return response.json();
    return readEvents(response, onToken);
  }

  // Server-sent events over fetch: `token` events, then one `result` or `error`.
  async function readEvents(response, onToken) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      let text = buffer + decoder.decode(value || new Uint8Array(), { stream: !done });
      const held = !done && text.endsWith("\r") ? "\r" : ""; // maybe half of a CRLF
      text = text.slice(0, text.length - held.length).replace(/\r\n?/g, "\n");
      const blocks = text.split("\n\n");
      buffer = done ? "" : blocks.pop() + held;
      for (const block of blocks) {
        let name = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) name = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (!data.length) continue;
        const payload = JSON.parse(data.join("\n"));
        if (name === "token") onToken(payload.text);
        else if (name === "result") return payload;
        else if (name === "error") throw new ApiError(0, payload);
      }
      if (done) throw new ApiError(0, { message: "the answer stream ended without a result" });
    }
  }

  // ---- state and messages -----------------------------------------------------------------

  function setState(state, message) {
    document.body.dataset.state = state;
    $("status").textContent = message || "";
    $("ask").disabled = state === "busy";
  }

  function showError(error) {
    const box = $("error");
    box.replaceChildren(
      el("strong", { text: "Error" + (error.code ? " (" + error.code + ")" : "") + ": " }),
      document.createTextNode(error.message || String(error)),
    );
    box.hidden = false;
  }

  function askForKey(message) {
    const form = $("auth-form");
    $("auth-message").textContent = message;
    form.hidden = false;
    $("api-key").focus();
  }

  // Run `task`; on 401 ask for the key and keep the task to run again once it is given.
  async function guarded(task) {
    $("error").hidden = true;
    try {
      return await task();
    } catch (error) {
      if (error instanceof ApiError && error.status === 401) {
        const had = sessionStorage.getItem(KEY_STORE);
        sessionStorage.removeItem(KEY_STORE);
        pending = task;
        askForKey(had ? "That key was refused. Enter the server's API key." :
          "This server needs an API key. It is kept in this tab only (session storage).");
        setState("auth", "Waiting for the API key.");
      } else {
        showError(error);
        setState("error", "");
      }
      return null;
    }
  }

  // ---- drawing ----------------------------------------------------------------------------

  function scoreBar(score, thresholds) {
    const fill = el("div", { className: "fill" });
    fill.style.width = (clamp01(score) * 100).toFixed(1) + "%";
    const bar = el("div", {
      className: "bar", "data-testid": "score-bar", role: "img",
      "aria-label": "score " + fixed(score, 3) + " against lower " + fixed(thresholds.lower, 3) + " and upper " + fixed(thresholds.upper, 3),
    }, [fill]);
    for (const which of ["lower", "upper"]) {
      const value = thresholds[which];
      if (typeof value !== "number") continue;
      const mark = el("div", { className: "mark " + which, "data-testid": "threshold-" + which, title: which + " threshold " + fixed(value, 3) });
      mark.style.left = (clamp01(value) * 100).toFixed(1) + "%";
      bar.append(mark);
    }
    return bar;
  }

  function explanationValue(value, depth) {
    if (value === null || typeof value !== "object") return document.createTextNode(plain(value));
    if (Array.isArray(value)) {
      if (value.every((v) => v === null || typeof v !== "object")) {
        return document.createTextNode(value.length ? value.map(plain).join(", ") : "(none)");
      }
      return el("ol", {}, value.map((v) => el("li", {}, [explanationValue(v, depth + 1)])));
    }
    if (depth > 4) return document.createTextNode(JSON.stringify(value));
    const list = el("dl");
    for (const [key, inner] of Object.entries(value)) {
      list.append(el("dt", { text: key }), el("dd", {}, [explanationValue(inner, depth + 1)]));
    }
    return list;
  }

  function candidateRow(node, thresholds) {
    const label = String(node.label || "");
    const row = el("li", {
      className: "candidate", "data-testid": "candidate", "data-node-id": node.node_id,
      "data-label": label, "data-origin": origin(node.source), "data-score": node.score,
    }, [
      el("div", { className: "candidate-head" }, [
        el("span", { className: "tag label", "data-label": label, "data-testid": "candidate-label", text: label }),
        el("span", { className: "tag origin", "data-testid": "candidate-origin", text: origin(node.source) }),
        node.doc_id ? el("span", { className: "doc-id", text: node.doc_id }) : null,
        el("span", { className: "node-id", text: node.node_id }),
        el("span", { className: "score-value", "data-testid": "candidate-score", text: fixed(node.score, 4) }),
      ]),
      scoreBar(node.score, thresholds),
    ]);
    if (node.explanation && typeof node.explanation === "object") {
      row.append(el("details", { className: "explanation", "data-testid": "explanation", open: true }, [
        el("summary", { text: "Why this score" }),
        explanationValue(node.explanation, 0),
      ]));
    }
    return row;
  }

  function stripRow(strip) {
    const kept = Boolean(strip.kept);
    const text = el(kept ? "span" : "del", { className: "strip-text", text: strip.text });
    return el("li", {
      className: "strip", "data-testid": "strip", "data-kept": String(kept), "data-node-id": strip.node_id,
    }, [
      el("span", { className: "score-value", text: fixed(strip.score, 4) }),
      el("span", { className: "tag plain", text: kept ? "kept" : "dropped" }),
      text,
    ]);
  }

  function timingRows(timings) {
    const stages = Object.entries(timings || {}).filter(([name]) => name !== "crag_ms");
    const total = stages.reduce((sum, [, ms]) => sum + (Number(ms) || 0), 0) || 1;
    const rows = stages.map(([stage, ms]) => {
      const fill = el("div", { className: "fill" });
      fill.style.width = ((Number(ms) || 0) / total * 100).toFixed(1) + "%";
      return el("tr", { "data-stage": stage, "data-testid": "timing" }, [
        el("th", { scope: "row", text: stage }),
        el("td", { className: "ms", text: fixed(Number(ms), 1) }),
        el("td", { className: "share" }, [el("div", { className: "bar" }, [fill])]),
      ]);
    });
    if (timings && typeof timings.crag_ms === "number") {
      rows.push(el("tr", { className: "total", "data-stage": "crag_ms", "data-testid": "timing" }, [
        el("th", { scope: "row", text: "correction total", title: "grade + refine + rewrite + fallback + regrade: what plain RAG would not spend" }),
        el("td", { className: "ms", text: fixed(timings.crag_ms, 1) }),
        el("td", { className: "share" }),
      ]));
    }
    return rows;
  }

  function sourceRow(source) {
    const facts = [
      el("span", { className: "tag origin", text: origin(source.origin) }),
      source.label ? el("span", { className: "tag label", "data-label": source.label, text: source.label }) : null,
      source.refined ? el("span", { className: "tag plain", text: "refined strips" }) : null,
      source.doc_id ? el("span", { className: "doc-id", text: source.doc_id }) : null,
      el("span", { className: "node-id", text: source.id }),
      el("span", { className: "score-value", text: "retrieval score " + fixed(source.score, 3) }),
    ];
    const row = el("li", {
      className: "source", "data-testid": "source", "data-origin": origin(source.origin), "data-label": source.label,
    }, [el("div", { className: "candidate-head" }, facts)]);
    if (source.url) {
      let link = null;
      try {
        const url = new URL(String(source.url));
        if (url.protocol === "http:" || url.protocol === "https:") {
          link = el("a", { href: url.href, rel: "noopener noreferrer nofollow", target: "_blank", text: url.href });
        }
      } catch (ignored) {
        link = null;
      }
      row.append(el("div", {}, [link || document.createTextNode(String(source.url))]));
    }
    row.append(el("blockquote", { text: source.excerpt || "" }));
    return row;
  }

  function summaryItems(crag) {
    const t = crag.thresholds || { upper: crag.upper, lower: crag.lower };
    const items = [
      ["Scorer", crag.scorer],
      ["Thresholds", "lower " + fixed(t.lower, 3) + ", upper " + fixed(t.upper, 3) + (typeof t.strip_threshold === "number" ? ", strips " + fixed(t.strip_threshold, 3) : "")],
      ["Aggregate score", fixed(crag.aggregate_score, 3) + (t.aggregation ? " (" + t.aggregation + ")" : "")],
      ["Top score", fixed(crag.top_score, 3)],
    ];
    if (crag.retry_score !== null && crag.retry_score !== undefined) items.push(["Fallback score", fixed(crag.retry_score, 3)]);
    if (crag.strips_kept || crag.strips_dropped) items.push(["Strips", crag.strips_kept + " kept, " + crag.strips_dropped + " dropped"]);
    if (crag.answer_mode) items.push(["Answer mode", crag.answer_mode + (crag.answered_by && crag.answered_by !== crag.answer_mode ? " (answered by " + crag.answered_by + ")" : "")]);
    if (crag.rewrite_source) items.push(["Rewrite", crag.rewrite_source === "keyword" ? "keywords of the question" : "by the LLM"]);
    if (crag.rewrite_error) items.push(["Rewrite failed", crag.rewrite_error]);
    if (crag.fallback_error) items.push(["Fallback failed", crag.fallback_error]);
    const split = crag.split;
    if (split) {
      const found = split.by === "rewrite" ? "found by the LLM's rewrite" : "found in the question's wording";
      items.push(["Question split", split.parts + " parts (" + found + "), " + split.answered + " answered" +
        (split.dropped ? ", " + split.dropped + " dropped" : "")]);
      for (const part of crag.parts || []) {
        items.push(["Part " + part.part, part.question + " (" + (part.abstained ? "not answered" : part.action) + ")"]);
      }
    }
    if (crag.rewrite_parts_refused) items.push(["Rewrite's parts refused", crag.rewrite_parts_refused]);
    return items.flatMap(([term, value]) => [el("dt", { text: term }), el("dd", { text: value })]);
  }

  function drawAnswer(query, text) {
    $("result").hidden = false;
    $("result-query").textContent = query;
    $("answer").textContent = text;
  }

  function webRow(search) {
    const sent = search.sent_query === null || search.sent_query === undefined ?
      "nothing sent" + (search.skipped ? " (" + search.skipped + ")" : search.forbidden ? " (forbidden)" : "") :
      "sent: " + search.sent_query;
    const parts = [
      el("strong", { text: plain(search.provider) }),
      el("span", { className: "web-sent", "data-testid": "web-sent", text: " " + sent }),
      el("div", { className: "muted", text: (search.urls_used || []).length + " page(s) used of " +
        (search.urls_fetched || []).length + " fetched, " + plain(search.bytes_read) + " bytes" +
        (search.error ? "; error: " + search.error : "") }),
    ];
    for (const url of search.urls_used || []) {
      parts.push(el("div", { className: "web-url", text: "used " + url }));
    }
    for (const refusal of search.refused || []) {
      parts.push(el("div", { className: "web-url muted", "data-testid": "web-refused",
        text: "refused " + plain(refusal.url) + ": " + plain(refusal.reason) }));
    }
    return el("li", { "data-testid": "web-search" }, parts);
  }

  // Which way the answer was made, and for a generated one, what its check against the sources found.
  function answerMode(crag) {
    const check = crag.answer_check || null;
    if (crag.answered_by === "extract") {
      const replaced = check && check.outcome === "extract" ? " (the generated answer was not supported by its sources)" : "";
      return ["Quoted from the documents, not generated" + replaced, "quoted"];
    }
    if (crag.answered_by !== "generate") return ["", ""];
    if (!check) return ["Generated (not checked)", "unchecked"];
    if (check.grounded === true) return ["Generated · supported by its sources", "true"];
    if (check.grounded === false) return ["Generated · NOT supported by its sources: " + (check.reason || ""), "false"];
    return ["Generated · not checked: " + (check.reason || check.status), "unchecked"];
  }

  // The answer's text with each unsupported span marked (text nodes only: nothing from the server is HTML).
  function markedAnswer(text, spans) {
    const parts = [];
    let rest = text;
    const wanted = (spans || []).filter((s) => s && rest.includes(s));
    while (rest && wanted.length) {
      let first = -1, span = "";
      for (const s of wanted) {
        const at = rest.indexOf(s);
        if (at >= 0 && (first < 0 || at < first)) { first = at; span = s; }
      }
      if (first < 0) break;
      parts.push(document.createTextNode(rest.slice(0, first)));
      parts.push(el("mark", { className: "unsupported", "data-testid": "unsupported", title: "not in the sources", text: span }));
      rest = rest.slice(first + span.length);
    }
    parts.push(document.createTextNode(rest));
    return parts;
  }

  function drawCheck(result, crag) {
    const [label, grounded] = answerMode(crag);
    $("answer-mode").textContent = result.abstained ? "" : label;
    $("answer-mode").dataset.grounded = grounded;
    const check = crag.answer_check || {};
    if (!result.abstained && crag.answered_by === "generate" && check.grounded === false) {
      $("answer").replaceChildren(...markedAnswer(result.answer || "", check.unsupported));
    }
    const beside = crag.answered_by === "generate" && check.grounded !== true;
    const given = beside ? crag.quotes || [] : [];
    // The strip the answer model withheld is still the best evidence found: shown, said to be weak.
    const qc = crag.quote_check || {};
    const weak = beside && given.length === 0 && qc.passed === false ? qc.withheld || [] : [];
    const quotes = given.length ? given : weak;
    $("evidence").hidden = quotes.length === 0;
    const unnamed = qc.unnamed || [];
    $("evidence-label").textContent = !weak.length
      ? "What the sources say:"
      : unnamed.length
        ? "What the sources say, weakly: they do not name " + unnamed.join(", ") +
          ", which the question asks about; this strip may answer something else:"
        : "What the sources say, weakly: the answer model gives this strip " + Number(qc.grade).toFixed(3) +
          ", under the quote threshold " + Number(qc.threshold).toFixed(3) + "; it may not answer the question:";
    $("evidence").dataset.weak = weak.length ? "true" : "false";
    $("quotes").replaceChildren(...quotes.map((q) => el("li", { "data-testid": "quote", text: "\u201c" + q.text + "\u201d (" + q.source + (q.entry ? ", under " + q.entry : "") + ")" })));
  }

  function draw(result) {
    const crag = result.crag || {};
    const action = String(result.action || crag.action || "");
    const answer = String(result.answer || "");
    drawAnswer(result.query, result.abstained ? "" : crag.answered_by === "extract" ? answer.replace(QUOTED_HEADER, "") : answer);
    drawCheck(result, crag);
    $("result").dataset.queryId = result.id;
    $("action").textContent = action;
    $("action").dataset.action = action;
    $("action-help").textContent = ACTION_HELP[action] || "";
    $("abstention").hidden = !result.abstained;
    $("abstain-reason").textContent = crag.abstain_reason || "no reason given";
    $("summary").replaceChildren(...summaryItems(crag));
    drawTraceViews(crag);
    drawTrace(crag);
    const sources = result.sources || [];
    $("sources").replaceChildren(...sources.map(sourceRow));
    $("sources-empty").hidden = sources.length > 0;
    for (const button of $("recent").querySelectorAll("button")) {
      button.setAttribute("aria-current", String(button.dataset.id === result.id));
    }
  }

  // A split question's response carries each part's whole trace (and, when the LLM's rewrite found the
  // parts, the trace of the question asked whole): one button each, to draw that trace below the summary.
  function traceViews(crag) {
    const split = crag.split;
    if (!split) return [];
    const views = (crag.parts || []).filter((part) => part.trace).map((part) => ({
      name: "Part " + part.part,
      label: "Part " + part.part + ": " + part.question + " (" + (part.abstained ? "not answered" : part.action) + ")",
      trace: part.trace,
    }));
    if (split.whole) {
      views.push({ name: "Asked whole", label: "The question asked whole, before its rewrite found the parts", trace: split.whole });
    }
    return views;
  }

  function drawTraceViews(crag) {
    const views = traceViews(crag);
    $("trace-views").hidden = views.length === 0;
    const first = (crag.parts || []).find((part) => !part.abstained);
    const shown = first ? "Part " + first.part : views.length ? views[0].name : "";
    const buttons = views.map((view) => el("button", {
      type: "button", className: "trace-view", "data-testid": "trace-view", text: view.name,
      onclick: () => showView(view),
    }));
    $("trace-view-buttons").replaceChildren(...buttons);
    const selected = views.find((view) => view.name === shown);
    if (selected) markView(selected);
  }

  function markView(view) {
    for (const button of $("trace-view-buttons").querySelectorAll("button")) {
      button.setAttribute("aria-pressed", String(button.textContent === view.name));
    }
    $("trace-view-label").textContent = "Showing the trace of " + view.label.charAt(0).toLowerCase() + view.label.slice(1);
  }

  function showView(view) {
    markView(view);
    drawTrace(view.trace);
  }

  // The part of the decision trace that belongs to one retrieval: candidates, strips, correction, timings.
  function drawTrace(crag) {
    const thresholds = crag.thresholds || { upper: crag.upper, lower: crag.lower };
    $("candidates").replaceChildren(...(crag.nodes || []).map((node) => candidateRow(node, thresholds)));
    const strips = crag.strips || [];
    $("refinement").hidden = strips.length === 0;
    $("strips").replaceChildren(...strips.map(stripRow));
    const fallback = crag.fallback_sources || [];
    const web = crag.web || [];
    $("correction").hidden = !crag.rewritten_query && !crag.entry_search && fallback.length === 0 && web.length === 0;
    $("entry-search-label").hidden = $("entry-search").hidden = !crag.entry_search;
    $("entry-search").textContent = crag.entry_search || "";
    $("web").hidden = web.length === 0;
    $("web-searches").replaceChildren(...web.map(webRow));
    $("rewritten-query").textContent = crag.rewritten_query || "(not rewritten)";
    $("fallback-sources").replaceChildren(...(fallback.length ? fallback.map((s) =>
      el("span", { className: "tag origin", "data-testid": "fallback-source", text: origin(s) })) :
      [document.createTextNode("(none)")]));
    $("timings").tBodies[0].replaceChildren(...timingRows(crag.timings_ms));
  }

  function drawRecent(queries) {
    $("recent-empty").hidden = queries.length > 0;
    const current = $("result").dataset.queryId;
    $("recent").replaceChildren(...queries.map((q) => el("li", {}, [
      el("button", {
        type: "button", "data-testid": "recent-item", "data-id": q.id, "data-action": q.action,
        "aria-current": String(q.id === current), onclick: () => openPast(q.id),
      }, [
        el("span", { className: "recent-query", text: q.query }),
        el("span", { className: "meta" }, [
          el("span", { className: "tag label", "data-label": q.action, text: q.action }),
          document.createTextNode(" " + (q.abstained ? "abstained · " : "") + "top " + fixed(q.top_score, 3) +
            " · " + fixed(q.elapsed_ms, 0) + " ms"),
        ]),
      ]),
    ])));
  }

  // ---- actions ----------------------------------------------------------------------------

  async function refreshRecent() {
    const data = await getJson("/recent");
    drawRecent(data.queries || []);
  }

  function openPast(id) {
    return guarded(async () => {
      setState("busy", "Loading the saved answer…");
      draw(await getJson("/queries/" + encodeURIComponent(id)));
      setState("done", "");
    });
  }

  function ask(event) {
    event.preventDefault();
    const body = { query: $("query-input").value, explain: $("explain").checked, stream: $("stream").checked };
    if (!body.query.trim()) {
      showError({ code: "empty_query", message: "write a question first" });
      return;
    }
    return guarded(async () => {
      setState("busy", "Retrieving, grading, correcting and generating…");
      let streamed = "";
      const result = await postQuery(body, (token) => {
        streamed += token;
        drawAnswer(body.query, streamed);
      });
      draw(result);
      await refreshRecent();
      setState("done", "Answered in " + fixed(result.elapsed_ms, 0) + " ms.");
    });
  }

  function saveKey(event) {
    event.preventDefault();
    const key = $("api-key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_STORE, key);
    $("api-key").value = "";
    $("auth-form").hidden = true;
    setState("idle", "");
    const task = pending;
    pending = null;
    guarded(async () => {
      await refreshRecent();
      if (task) await task();
    });
  }

  async function showServer() {
    try {
      const health = await (await fetch("/healthz")).json();
      const gen = health.generator || {};
      // The short label; the whole sentence (which model, where, why this one) on hover.
      $("server-info").textContent = "Scorer " + health.scorer + " · generator " + (gen.label || gen.name) +
        (gen.ready ? "" : " (not ready: " + gen.detail + ")") + " · thresholds " +
        fixed(health.thresholds && health.thresholds.lower, 3) + " / " + fixed(health.thresholds && health.thresholds.upper, 3);
      $("server-info").title = "Generator: " + gen.name;
    } catch (ignored) {
      $("server-info").textContent = "";
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("query-form").addEventListener("submit", ask);
    $("auth-form").addEventListener("submit", saveKey);
    $("query-input").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) {
        event.preventDefault();
        $("query-form").requestSubmit();
      }
    });
    showServer();
    guarded(refreshRecent);
  });
})();
