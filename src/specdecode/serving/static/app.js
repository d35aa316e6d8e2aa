// The page at GET /: streams a chat answer token by token, each token coloured by how it was made (an
// accepted draft guess, by depth, or the target's own token), with live figures and a plain-vs-speculative
// race. Model text only ever goes into the page through textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const DEPTH_BANDS = 8; // depths 8 and beyond share the last colour
const MAX_GAMMA = 16;
const KEY_STORAGE = "specdecode.apiKey";

class ApiError extends Error {
  constructor(message, status = 0) {
    super(message);
    this.status = status;
  }
}

// ---- errors: one visible box; `source` says who may clear it ("request", "poll", "auth")

let errorSource = null;

function showError(message, source) {
  const box = $("error");
  box.textContent = message;
  box.hidden = false;
  errorSource = source;
}

function clearError(source) {
  if (errorSource !== source) return;
  $("error").hidden = true;
  $("error").textContent = "";
  errorSource = null;
}

function report(err, source) {
  if (err.status === 401) {
    $("api-key").classList.add("needed");
    showError(err.message, "auth");
  } else if (source !== "poll" || errorSource === null || errorSource === "poll") {
    showError(err.message, source); // a failing poll never hides a request's error
  }
}

// ---- HTTP

function apiKey() {
  return $("api-key").value.trim();
}

async function api(path, options = {}) {
  const headers = { "Content-Type": "application/json" };
  if (apiKey()) headers.Authorization = `Bearer ${apiKey()}`;
  let response;
  try {
    response = await fetch(path, { ...options, headers });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(`Cannot reach the server (${err.message}).`);
  }
  if (!response.ok) throw await errorFrom(response);
  return response;
}

async function errorFrom(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json(); // OpenAI's shape: {"error": {"message": ...}}
    if (body && body.error && body.error.message) message = body.error.message;
  } catch {
    // not JSON: keep the status line
  }
  if (response.status === 401) {
    message = `This server needs an API key: type it in the "API key" field at the top. (${message})`;
  }
  return new ApiError(message, response.status);
}

// Server-sent events from a fetch() body: yields each event's data. An event ends at a blank line, and
// one may arrive split across reads (or several in one read), so text is buffered until its blank line.
async function* serverSentEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (value) buffer = (buffer + decoder.decode(value, { stream: true })).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, end).split("\n");
      buffer = buffer.slice(end + 2);
      const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
      if (data.length) yield data.join("\n");
    }
    if (done) return;
  }
}

// ---- one streamed chat answer

function tokenSpan(record) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = record.text;
  span.dataset.source = record.source;
  if (record.kind) span.dataset.kind = record.kind;
  if (record.depth != null) span.dataset.depth = record.depth;
  if (record.source === "draft") {
    span.dataset.band = Math.min(record.depth, DEPTH_BANDS);
    span.title = `accepted guess at depth ${record.depth} (token ${record.token})`;
  } else {
    span.title = `target's own token: ${record.kind} (token ${record.token})`;
  }
  return span;
}

// Streams `body` into `output` (one span per token); `onProgress(run)` after every chunk. Resolves with the
// run once [DONE] arrives; rejects on an HTTP error, a mid-stream error chunk or a stream cut short.
async function streamChat(body, output, signal, onProgress) {
  const run = { started: performance.now(), seconds: 0, text: "", tokens: 0, accepted: 0, rounds: 0, usage: null };
  run.done = false; // true once [DONE] arrived
  run.state = "streaming"; // then "done", "error" or "stopped"
  output.replaceChildren();
  output.dataset.state = "streaming";
  onProgress(run);
  try {
    const response = await api("v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal });
    for await (const data of serverSentEvents(response)) {
      if (data === "[DONE]") {
        run.seconds = (performance.now() - run.started) / 1000;
        run.done = true;
        run.state = output.dataset.state = "done";
        onProgress(run);
        return run;
      }
      let chunk;
      try {
        chunk = JSON.parse(data);
      } catch {
        throw new ApiError(`The server sent a chunk that is not JSON: ${data.slice(0, 200)}`);
      }
      if (chunk.error) throw new ApiError(chunk.error.message || "The server stopped the answer with an error.");
      if (chunk.usage) run.usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (choice) {
        const text = (choice.delta && choice.delta.content) || "";
        if (choice.sources) {
          for (const record of choice.sources) {
            output.append(tokenSpan(record));
            run.tokens += 1;
            if (record.source === "draft") run.accepted += 1;
            else run.rounds += 1; // each round ends with one token of the target's own
          }
        } else if (text) {
          output.append(text); // a server without the sources extension: text, uncoloured
        }
        run.text += text;
      }
      onProgress(run);
    }
    throw new ApiError("The stream ended before [DONE]: the connection was lost or the server stopped.");
  } catch (err) {
    run.state = output.dataset.state = err.name === "AbortError" ? "stopped" : "error";
    onProgress(run);
    throw err;
  }
}

function requestBody(prompt, speculative, seed) {
  const body = {
    messages: [{ role: "user", content: prompt }],
    stream: true,
    stream_options: { include_usage: true, include_sources: true },
    max_tokens: readNumber("max-tokens", 128, true),
    temperature: readNumber("temperature", 0, false),
  };
  if (seed !== null) body.seed = seed;
  if (!speculative) body.speculative = false;
  else if ($("proposer").value) body.speculative = { proposer: $("proposer").value, gamma: gammaValue() };
  else body.speculative = true; // proposers not known yet: the server's default
  return body;
}

function readNumber(id, fallback, integer) {
  const raw = $(id).value.trim();
  if (raw === "") return fallback;
  const value = Number(raw);
  if (!Number.isFinite(value) || (integer && !Number.isSafeInteger(value))) {
    throw new ApiError(`${id.replace("-", " ")}: not a valid number (${raw})`);
  }
  return value;
}

function seedValue() {
  return $("seed").value.trim() === "" ? null : readNumber("seed", null, true);
}

function gammaValue() {
  const value = $("gamma").value;
  return value === "auto" ? "auto" : Number(value);
}

// ---- the stats panel

function showStats(run, label) {
  const usage = run.usage;
  const spec = usage && usage.speculation;
  const seconds = run.done ? run.seconds : (performance.now() - run.started) / 1000;
  const tokens = usage ? usage.completion_tokens : run.tokens;
  const rounds = spec ? spec.rounds : run.rounds;
  const estimate = run.done ? "" : "≈ ";
  $("stat-label").textContent = run.done ? label : `${label} (${run.state})`;
  $("stat-tps").textContent = seconds > 0 && tokens ? `${estimate}${(tokens / seconds).toFixed(1)}` : "–";
  $("stat-tpp").textContent = rounds ? `${estimate}${(tokens / rounds).toFixed(2)}` : "–";
  if (usage) {
    const rate = usage.drafted_tokens ? ` (${Math.round((100 * usage.accepted_tokens) / usage.drafted_tokens)}%)` : "";
    $("stat-drafted").textContent = `${usage.drafted_tokens} / ${usage.accepted_tokens}${rate}`;
  } else {
    $("stat-drafted").textContent = `? / ${run.accepted}`;
  }
  $("stat-time").textContent = spec ? `${spec.draft_seconds.toFixed(2)} s / ${spec.verify_seconds.toFixed(2)} s` : "–";
  if (run.done) showDepths(spec ? spec.acceptance_by_depth : []);
  else if (run.tokens === 0) showDepths(null);
}

function showDepths(acceptance) {
  const list = $("stat-depth");
  if (!acceptance || !acceptance.length) {
    const none = document.createElement("li");
    none.className = "muted";
    none.textContent = acceptance ? "nothing drafted" : "when the answer ends";
    list.replaceChildren(none);
    return;
  }
  list.replaceChildren(
    ...acceptance.map((p, i) => {
      const item = document.createElement("li");
      const depth = document.createElement("span");
      depth.className = "depth";
      depth.textContent = `d${i + 1}`;
      const bar = document.createElement("span");
      bar.className = "bar";
      const fill = document.createElement("span");
      fill.className = "fill";
      fill.dataset.band = Math.min(i + 1, DEPTH_BANDS);
      fill.style.width = `${(100 * p).toFixed(1)}%`;
      bar.append(fill);
      const pct = document.createElement("span");
      pct.className = "pct";
      pct.textContent = `${Math.round(100 * p)}%`;
      item.append(depth, bar, pct);
      return item;
    }),
  );
}

// ---- the server's state: GET /v1/speculation every second while the page is visible

let polling = false;
let defaultsApplied = false;
let serverMode = "reproducible"; // the server's verification rule, from /v1/speculation

async function poll() {
  if (polling || document.visibilityState !== "visible") return;
  polling = true;
  try {
    const info = await (await api("v1/speculation")).json();
    clearError("poll");
    showServer(info);
  } catch (err) {
    showServer(null, err.status === 401 ? "needs API key" : "unreachable");
    report(err, "poll");
  } finally {
    polling = false;
  }
}

function showServer(info, problem) {
  const mode = $("server-mode");
  if (!info) {
    mode.textContent = problem;
    mode.dataset.mode = "down";
    $("server-load").textContent = "";
    return;
  }
  mode.textContent = info.speculating ? "speculating" : "plain";
  mode.dataset.mode = info.speculating ? "speculating" : "plain";
  $("server-load").textContent = `running ${info.running} · waiting ${info.waiting} · policy ${info.policy}`;
  $("model").textContent = info.model || "";
  serverMode = info.mode || serverMode;
  const names = (info.proposers || []).filter((name) => name !== "none");
  const select = $("proposer");
  if ([...select.options].map((o) => o.value).join() !== names.join()) {
    const chosen = select.value || (info.default && info.default.proposer);
    select.replaceChildren(...names.map((name) => new Option(name, name)));
    if (names.includes(chosen)) select.value = chosen;
  }
  if (!defaultsApplied && info.default) {
    defaultsApplied = true; // the server's defaults once; the user's choices after that
    if (info.default.gamma != null) $("gamma").value = String(info.default.gamma);
  }
}

// ---- actions

let controller = null;

async function whileBusy(task) {
  controller = new AbortController();
  for (const id of ["send", "race"]) $(id).disabled = true;
  $("stop").disabled = false;
  clearError("request");
  try {
    await task(controller.signal);
  } catch (err) {
    if (err.name !== "AbortError") report(err, "request");
  } finally {
    for (const id of ["send", "race"]) $(id).disabled = false;
    $("stop").disabled = true;
    controller = null;
  }
}

function promptText() {
  const text = $("prompt").value;
  if (!text.trim()) throw new ApiError("Type a prompt first.");
  return text;
}

function send() {
  return whileBusy(async (signal) => {
    const speculative = $("speculative").checked;
    const body = requestBody(promptText(), speculative, seedValue());
    const label = speculative ? "speculative" : "plain";
    await streamChat(body, $("output"), signal, (run) => showStats(run, label));
  });
}

// Plain, then speculative: one after the other, as together they would share the engine's batch.
function race() {
  return whileBusy(async (signal) => {
    const text = promptText();
    let seed = seedValue();
    let picked = false;
    if (seed === null && readNumber("temperature", 0, false) > 0) {
      seed = crypto.getRandomValues(new Uint32Array(1))[0]; // both runs need the same seed to match
      picked = true;
    }
    const result = $("race-result");
    result.hidden = false;
    result.dataset.state = "running";
    delete result.dataset.identical;
    for (const id of ["race-summary", "race-plain-time", "race-spec-time"]) $(id).textContent = "";
    $("race-spec").replaceChildren();
    try {
      const plain = await streamChat(requestBody(text, false, seed), $("race-plain"), signal, (run) =>
        showStats(run, "race: plain"),
      );
      $("race-plain-time").textContent = timing(plain);
      const spec = await streamChat(requestBody(text, true, seed), $("race-spec"), signal, (run) =>
        showStats(run, "race: speculative"),
      );
      $("race-spec-time").textContent = timing(spec);
      const identical = plain.text === spec.text;
      const saved = plain.seconds - spec.seconds;
      const speedup = plain.seconds / spec.seconds;
      const parts = [
        identical ? "identical texts" : `texts differ from character ${firstDifference(plain.text, spec.text)}`,
        saved >= 0
          ? `speculative saved ${saved.toFixed(2)} s (${speedup.toFixed(2)}× faster)`
          : `speculative was ${(-saved).toFixed(2)} s slower (${speedup.toFixed(2)}×)`,
      ];
      if (seed !== null) parts.push(`seed ${seed}${picked ? " (picked at random)" : ""}`);
      if (!identical && seed !== null && serverMode !== "reproducible") {
        parts.push(`the server's mode is ${serverMode}: only its reproducible mode makes a seed give the same text`);
      }
      $("race-summary").textContent = parts.join(" · ");
      result.dataset.identical = String(identical);
      result.dataset.state = "done";
    } catch (err) {
      result.dataset.state = err.name === "AbortError" ? "stopped" : "error";
      throw err;
    }
  });
}

function timing(run) {
  const tokens = run.usage ? run.usage.completion_tokens : run.tokens;
  return `${run.seconds.toFixed(2)} s · ${(tokens / run.seconds).toFixed(1)} tokens/s`;
}

function firstDifference(a, b) {
  let i = 0;
  while (i < a.length && a[i] === b[i]) i += 1;
  return i;
}

// ---- wiring

function init() {
  $("gamma").replaceChildren(new Option("auto", "auto"));
  for (let g = 1; g <= MAX_GAMMA; g += 1) $("gamma").append(new Option(String(g), String(g)));
  $("api-key").value = localStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("input", () => {
    localStorage.setItem(KEY_STORAGE, apiKey());
    $("api-key").classList.remove("needed");
    clearError("auth");
    poll();
  });
  $("speculative").addEventListener("change", () => {
    for (const id of ["proposer", "gamma"]) $(id).disabled = !$("speculative").checked;
  });
  $("send").addEventListener("click", send);
  $("race").addEventListener("click", race);
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey) && !$("send").disabled) send();
  });
  document.addEventListener("visibilitychange", poll);
  setInterval(poll, 1000);
  poll();
}

init();
