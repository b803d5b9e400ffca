// SpecEM playground: a chat over the server's public endpoints (POST v1/chat/completions with the
// X-SpecEM-Trace header, GET v1/models) that shows how every segment of the answer was chosen.
// Plain JavaScript, no dependencies. Model text only ever goes through textContent (never
// innerHTML), so an answer cannot inject markup.
"use strict";

(function () {
  // Light tints that keep dark text readable; the legend and the segments use the same values.
  const PALETTE = ["#cfe3ff", "#ffd9b3", "#c8f0d0", "#f5c8e0", "#e6d8ff", "#fff1a8", "#c9f2f2", "#e8dcc8"];
  const KEY_STORAGE = "specem-playground-api-key"; // sessionStorage: this tab only, gone when it closes

  const $ = (id) => document.getElementById(id);
  const els = {
    modelInfo: $("model-info"),
    authError: $("auth-error"),
    log: $("log"),
    error: $("error"),
    composer: $("composer"),
    prompt: $("prompt"),
    send: $("send"),
    stop: $("stop"),
    clear: $("clear"),
    status: $("status"),
    legend: $("legend"),
    round: $("round"),
    roundTitle: $("round-title"),
    roundBody: $("round-body"),
    roundClose: $("round-close"),
    apiKey: $("api-key"),
    system: $("system"),
    maxTokens: $("max-tokens"),
    temperature: $("temperature"),
  };

  const state = {
    model: null, // the served model id (GET v1/models)
    colours: new Map(), // member -> colour, in the order members were first seen
    history: [], // the conversation sent with each request (system prompt excluded)
    controller: null, // AbortController of the request in flight
    selected: null, // the selected segment element
  };

  // -- small DOM helpers ---------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "className") node.className = value;
      else if (name === "text") node.textContent = value;
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function fmt(value, digits) {
    return typeof value === "number" && Number.isFinite(value) ? value.toFixed(digits) : "–";
  }

  function colourOf(member) {
    if (!state.colours.has(member)) {
      state.colours.set(member, PALETTE[state.colours.size % PALETTE.length]);
      renderLegend();
    }
    return state.colours.get(member);
  }

  function memberLabel(member) {
    const swatch = el("span", { className: "swatch", "aria-hidden": "true" });
    swatch.style.backgroundColor = colourOf(member);
    return el("span", { className: "member" }, swatch, el("span", { text: member }));
  }

  function renderLegend() {
    els.legend.replaceChildren();
    for (const [member, colour] of state.colours) {
      const swatch = el("span", { className: "swatch", "data-testid": "legend-swatch", "aria-hidden": "true" });
      swatch.style.backgroundColor = colour;
      els.legend.append(
        el("li", { "data-testid": "legend-item", "data-member": member }, swatch, el("span", { text: member })),
      );
    }
  }

  // -- errors --------------------------------------------------------------------------------
  // An OpenAI-style error ({"error": {message, type, param, code}}) as a sentence for people.
  function describeError(status, error, retryAfter) {
    const message = (error && error.message) || "no message";
    const code = (error && error.code) || "";
    const prefix = status ? `Error ${status}${code ? ` (${code})` : ""}: ` : `Error${code ? ` (${code})` : ""}: `;
    if (status === 401 || code === "invalid_api_key") {
      return `Authentication failed — ${message} Enter the server's API key under Settings.`;
    }
    if (code === "context_length_exceeded") {
      return `The conversation is too long for the members' context window — ${message} ` +
        "Start a new chat or shorten the message.";
    }
    if (status === 429 || code === "queue_full") {
      const wait = retryAfter ? ` Retry in about ${retryAfter} s.` : " Retry in a moment.";
      return `The server is busy: every slot is taken and its queue is full.${wait}`;
    }
    if (status === 504 || code === "request_timeout") {
      return `The answer took longer than the server's time limit — ${message}`;
    }
    if (code === "all_members_failed") {
      return `Every member failed — ${message}`;
    }
    const param = error && error.param ? ` (parameter ${error.param})` : "";
    return prefix + message + param;
  }

  function showError(text, code) {
    els.error.textContent = text;
    els.error.dataset.code = code || "";
    els.error.hidden = false;
  }

  function clearError() {
    els.error.hidden = true;
    els.error.textContent = "";
    els.error.dataset.code = "";
  }

  async function errorFrom(response) {
    let error = null;
    try {
      const body = await response.json();
      error = body && body.error ? body.error : null;
    } catch (_) {
      error = { message: response.statusText || "the server's answer is not JSON" };
    }
    return { status: response.status, error, retryAfter: response.headers.get("retry-after") };
  }

  // -- auth and model --------------------------------------------------------------------------
  function headers() {
    const out = { "Content-Type": "application/json" };
    const key = els.apiKey.value.trim();
    if (key) out.Authorization = `Bearer ${key}`;
    return out;
  }

  async function loadModel() {
    els.authError.hidden = true;
    let response;
    try {
      response = await fetch("v1/models", { headers: headers() });
    } catch (exc) {
      els.modelInfo.textContent = `Cannot reach the server (${exc.message}).`;
      return;
    }
    if (!response.ok) {
      const { status, error } = await errorFrom(response);
      els.modelInfo.textContent = "Model unknown until the server accepts the request.";
      els.authError.textContent = describeError(status, error);
      els.authError.dataset.code = (error && error.code) || "";
      els.authError.hidden = false;
      return;
    }
    const body = await response.json();
    const model = body.data && body.data[0];
    if (!model) return;
    state.model = model.id;
    const members = Array.isArray(model.members) ? model.members : [];
    members.forEach(colourOf);
    els.modelInfo.textContent = `Model ${model.id}: ${members.length} member${members.length === 1 ? "" : "s"}`;
  }

  // -- the request -----------------------------------------------------------------------------
  function requestBody(messages) {
    const body = {
      messages,
      stream: true,
      stream_options: { include_usage: true },
    };
    if (state.model) body.model = state.model;
    const maxTokens = els.maxTokens.value.trim();
    if (maxTokens) body.max_tokens = Number.parseInt(maxTokens, 10);
    const temperature = els.temperature.value.trim();
    if (temperature) body.temperature = Number.parseFloat(temperature);
    const specem = {};
    for (const input of document.querySelectorAll("[data-option]")) {
      const raw = input.value.trim();
      if (!raw) continue;
      const kind = input.dataset.kind;
      const value = kind === "int" ? Number.parseInt(raw, 10)
        : kind === "float" ? Number.parseFloat(raw)
        : kind === "bool" ? raw === "true"
        : raw;
      if (input.dataset.topLevel) body[input.dataset.option] = value;
      else specem[input.dataset.option] = value;
    }
    if (Object.keys(specem).length) body.specem = specem;
    return body;
  }

  // Yields the JSON payload of each server-sent event ("[DONE]" ends the stream).
  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }

  function addTurn(role, text) {
    const body = role === "user"
      ? el("div", { className: "text", text })
      : el("div", { className: "answer streaming", "data-testid": "answer", "data-state": "streaming" });
    const turn = el(
      "li",
      { className: `turn ${role}`, "data-testid": `turn-${role}` },
      el("div", { className: "who", text: role === "user" ? "You" : "SpecEM" }),
      body,
    );
    els.log.append(turn);
    turn.scrollIntoView({ block: "end" });
    return { turn, body };
  }

  function addSegment(answer, segments, delta, trace) {
    const span = el("span", {
      className: "segment",
      "data-testid": "segment",
      role: "button",
      tabindex: "0",
      "data-round": trace ? trace.index : "",
      "data-winner": trace ? trace.winner : "",
      "aria-label": trace ? `round ${trace.index}, won by ${trace.winner}: ${delta}` : delta,
      title: trace ? `Round ${trace.index}: ${trace.winner}` : "",
      text: delta,
    });
    if (trace) span.style.backgroundColor = colourOf(trace.winner);
    span.segmentTrace = trace;
    span.answerSegments = segments;
    answer.append(span);
    return span;
  }

  function renderSummary(turn, final, usage, clientFirst, clientTotal) {
    const rows = [];
    if (final) {
      const wins = el("dd", { "data-testid": "summary-wins" });
      for (const [member, count] of Object.entries(final.wins || {})) {
        wins.append(el("span", { "data-member": member, "data-wins": count }, memberLabel(member), ` ${count}  `));
      }
      rows.push(["wins per member", wins]);
      const perRound = final.members_per_round || [];
      rows.push(["drafters per round", el("dd", { "data-testid": "summary-drafters", text: perRound.join(" · ") || "–" })]);
      rows.push(["rounds", el("dd", { "data-testid": "summary-rounds", text: String((final.segments || []).length) })]);
    }
    if (usage && final && final.seconds > 0) {
      const rate = usage.completion_tokens / final.seconds;
      rows.push([
        "tokens/s",
        el("dd", { "data-testid": "summary-tps", text: `${fmt(rate, 1)} (${usage.completion_tokens} tokens in ${fmt(final.seconds, 2)} s on the server)` }),
      ]);
    }
    const firstServer = final && typeof final.first_segment_seconds === "number" ? `, ${fmt(final.first_segment_seconds, 2)} s on the server` : "";
    rows.push([
      "first segment",
      el("dd", { "data-testid": "summary-first", text: `${fmt(clientFirst, 2)} s here${firstServer}` }),
    ]);
    rows.push(["total", el("dd", { text: `${fmt(clientTotal, 2)} s here` })]);
    if (final && final.excluded && final.excluded.length) {
      rows.push([
        "excluded",
        el("dd", { "data-testid": "summary-excluded", text: final.excluded.map((e) => `${e.member} (${e.stage}, round ${e.round})`).join("; ") }),
      ]);
    }
    const dl = el("dl");
    for (const [name, dd] of rows) dl.append(el("dt", { text: name }), dd);
    turn.append(el("div", { className: "summary", "data-testid": "summary" }, dl));
  }

  function setBusy(busy) {
    els.send.disabled = busy;
    els.stop.disabled = !busy;
    els.prompt.disabled = busy;
  }

  async function send(text) {
    clearError();
    const messages = [];
    const system = els.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...state.history, { role: "user", content: text });
    const body = requestBody(messages);
    const asked = addTurn("user", text).turn;
    const { turn, body: answer } = addTurn("assistant");
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    els.status.textContent = "Waiting for the first segment…";
    const started = performance.now();
    let firstAt = null;
    let content = "";
    let final = null;
    let usage = null;
    let finished = false;
    let focusAfter = els.prompt;
    const segments = [];
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST",
        headers: { ...headers(), "X-SpecEM-Trace": "1" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!response.ok) {
        const { status, error, retryAfter } = await errorFrom(response);
        showError(describeError(status, error, retryAfter), error && error.code);
        // refused before it started: the question goes back into the box, to send again
        asked.remove();
        turn.remove();
        els.prompt.value = text;
        if (status === 401) focusAfter = els.apiKey;
        return;
      }
      for await (const chunk of events(response)) {
        if (chunk.error) {
          showError(describeError(null, chunk.error), chunk.error.code);
          break;
        }
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          if (firstAt === null) firstAt = performance.now();
          content += delta;
          segments.push(addSegment(answer, segments, delta, chunk.specem || null));
          els.status.textContent = `Streaming: ${segments.length} segment${segments.length === 1 ? "" : "s"}…`;
        }
        if (choice.finish_reason) {
          final = chunk.specem || null;
          finished = true;
          answer.dataset.finishReason = choice.finish_reason;
        }
      }
    } catch (exc) {
      if (exc.name === "AbortError") showError("Stopped: the server cancels the request after the round in progress.", "stopped");
      else showError(`Cannot reach the server or read its answer (${exc.message}).`, "network");
    } finally {
      state.controller = null;
      setBusy(false);
      answer.classList.remove("streaming");
      answer.dataset.state = finished ? "done" : "stopped";
      els.status.textContent = finished || !turn.isConnected ? "" : "The answer is incomplete.";
      focusAfter.focus();
    }
    if (!turn.isConnected) return;
    if (final) {
      for (const span of segments) span.excluded = final.excluded || [];
      for (const member of final.members || []) colourOf(member);
    }
    const total = (performance.now() - started) / 1000;
    renderSummary(turn, final, usage, firstAt === null ? null : (firstAt - started) / 1000, total);
    if (finished) {
      state.history.push({ role: "user", content: text }, { role: "assistant", content });
    }
  }

  // -- the round panel -------------------------------------------------------------------------
  function showRound(span) {
    const trace = span.segmentTrace;
    if (!trace) return;
    if (state.selected) state.selected.classList.remove("selected");
    state.selected = span;
    span.classList.add("selected");
    els.round.dataset.round = trace.index;
    els.roundTitle.textContent = `Round ${trace.index}: won by `;
    els.roundTitle.append(memberLabel(trace.winner));
    const body = [];

    const candidates = trace.candidates || [];
    const table = el("table", { "data-testid": "candidates" });
    table.append(el("caption", { className: "visually-hidden", text: "Candidates of this round" }));
    table.append(
      el("thead", {}, el("tr", {},
        el("th", { scope: "col", text: "drafter" }),
        el("th", { scope: "col", text: "candidate" }),
        el("th", { scope: "col", className: "num", text: "vote S" }))),
    );
    const tbody = el("tbody");
    candidates.forEach((cand, i) => {
      const won = cand.member === trace.winner; // one candidate per drafter
      tbody.append(el("tr", { "data-testid": "candidate", "data-member": cand.member, className: won ? "won" : "" },
        el("td", {}, el("span", { className: "muted", text: `#${i + 1} ` }), memberLabel(cand.member)),
        el("td", { className: "cand-text", "data-testid": "candidate-text", text: cand.text + (cand.ended ? " ⏹" : "") }),
        el("td", { className: "num", "data-testid": "combined", text: fmt((trace.combined || [])[i], 3) + (won ? " ★" : "") })));
    });
    table.append(tbody);
    body.push(el("h3", { className: "note", text: "Candidates (one per drafter) and the weighted vote" }), table);

    // scores[j][i]: verifier j on candidate i, raw / normalized; w_j the verifier's weight
    const scores = el("table", { "data-testid": "scores" });
    scores.append(el("caption", { className: "visually-hidden", text: "Scores of every verifier" }));
    const head = el("tr", {}, el("th", { scope: "col", text: "verifier" }), el("th", { scope: "col", className: "num", text: "weight" }));
    candidates.forEach((cand, i) => head.append(el("th", { scope: "col", className: "num", text: `#${i + 1} raw / norm` })));
    scores.append(el("thead", {}, head));
    const sbody = el("tbody");
    (trace.verifiers || []).forEach((verifier, j) => {
      const row = el("tr", { "data-testid": "score-row", "data-verifier": verifier },
        el("th", { scope: "row" }, memberLabel(verifier)),
        el("td", { className: "num", "data-testid": "weight", text: fmt((trace.weights || [])[j], 3) }));
      candidates.forEach((_, i) => {
        const raw = ((trace.raw_scores || [])[j] || [])[i];
        const norm = ((trace.normalized || [])[j] || [])[i];
        row.append(el("td", { className: "num" },
          el("span", { "data-testid": "raw-score", text: fmt(raw, 3) }), " / ",
          el("span", { "data-testid": "norm-score", text: fmt(norm, 3) })));
      });
      sbody.append(row);
    });
    scores.append(sbody);
    body.push(el("h3", { className: "note", text: "Every verifier's scores (raw / normalized) and weight" }), scores);

    const excluded = (span.excluded || []).filter((e) => e.round <= trace.index);
    // Model Exit: members that drafted an earlier round of this answer and no longer draft
    const drafting = new Set([...(trace.drafters || []), ...excluded.map((e) => e.member)]);
    const before = new Set();
    for (const other of span.answerSegments || []) {
      const t = other.segmentTrace;
      if (t && t.index < trace.index) for (const m of t.drafters || []) before.add(m);
    }
    const exited = [...before].filter((m) => !drafting.has(m));
    if (exited.length) {
      body.push(el("p", { className: "note", "data-testid": "exited", text: `Not drafting this round (Model Exit): ${exited.join(", ")}` }));
    }
    for (const e of excluded) {
      body.push(el("p", { className: "note", "data-testid": "excluded", text: `Excluded: ${e.member} at ${e.stage} in round ${e.round}: ${e.error}` }));
    }
    body.push(el("p", { className: "note muted", text: `Round time ${fmt(trace.seconds, 3)} s; committed: “${trace.text}”` }));
    els.roundBody.replaceChildren(...body);
    els.round.hidden = false;
    els.round.focus();
  }

  function closeRound() {
    els.round.hidden = true;
    if (state.selected) {
      state.selected.classList.remove("selected");
      state.selected.focus();
      state.selected = null;
    }
  }

  // -- wiring ------------------------------------------------------------------------------------
  els.log.addEventListener("click", (event) => {
    const span = event.target.closest(".segment");
    if (span) showRound(span);
  });
  els.log.addEventListener("keydown", (event) => {
    const span = event.target.closest(".segment");
    if (span && (event.key === "Enter" || event.key === " ")) {
      event.preventDefault();
      showRound(span);
    }
  });
  els.round.addEventListener("keydown", (event) => {
    if (event.key === "Escape") closeRound();
  });
  els.roundClose.addEventListener("click", closeRound);

  els.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = els.prompt.value.trim();
    if (!text || state.controller) return;
    els.prompt.value = "";
    send(text);
  });
  els.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      els.composer.requestSubmit();
    }
  });
  els.stop.addEventListener("click", () => {
    if (state.controller) state.controller.abort();
  });
  els.clear.addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.history = [];
    els.log.replaceChildren();
    clearError();
    closeRound();
    els.prompt.focus();
  });

  els.apiKey.value = sessionStorage.getItem(KEY_STORAGE) || "";
  els.apiKey.addEventListener("change", () => {
    const key = els.apiKey.value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    loadModel();
  });

  loadModel();
})();
