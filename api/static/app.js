// rayeval dashboard: lists evaluations and shows one's live progress and final metrics, by
// polling the REST API. Plain JavaScript, no build step. Data is only ever inserted as text.
"use strict";

const LIST_EVERY_MS = 2000;
const DETAIL_EVERY_MS = 1000;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

const state = {
  token: sessionStorage.getItem("rayeval-token") || "",
  selected: window.location.hash.slice(1) || null,
  resultsShownFor: null,
  settledFor: null,  // the selected evaluation ended and everything about it is shown
};

function $(id) { return document.getElementById(id); }

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (state.token) headers["Authorization"] = "Bearer " + state.token;
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (response.status === 401) {
    $("auth").hidden = false;
    throw new Error("the API token is missing or wrong");
  }
  if (!response.ok) {
    let detail = response.statusText;
    try { detail = (await response.json()).detail; } catch (_) { /* not JSON */ }
    throw new Error(detail);
  }
  return response;
}

function say(text) { $("message").textContent = text || ""; }

function seconds(from, to) {
  if (!from) return "";
  const end = to ? new Date(to) : new Date();
  const s = Math.max(0, Math.round((end - new Date(from)) / 1000));
  return s < 120 ? s + " s" : Math.round(s / 60) + " min";
}

function progressText(evaluation) {
  const p = evaluation.progress;
  if (!p.total) return evaluation.status === "queued" && evaluation.queue_position
    ? "queue #" + evaluation.queue_position : "";
  return p.done + " / " + p.total;
}

function progressCell(row, evaluation) {
  const td = row.insertCell();
  const p = evaluation.progress;
  if (p.total) {
    const bar = document.createElement("progress");
    bar.max = p.total;
    bar.value = p.done;
    td.appendChild(bar);
  }
  const label = document.createElement("span");
  label.textContent = " " + progressText(evaluation);
  td.appendChild(label);
}

function modelName(request) {
  const pretrained = String(request.model_args.pretrained || "");
  return pretrained.split("/").filter(Boolean).slice(-2).join("/");
}

async function refreshList() {
  const response = await api("/evaluations?limit=100");
  const page = await response.json();
  const body = $("evaluations").tBodies[0];
  body.replaceChildren();
  for (const evaluation of page.items) {
    const row = body.insertRow();
    row.dataset.id = evaluation.id;
    row.dataset.status = evaluation.status;
    if (evaluation.id === state.selected) row.className = "selected";
    cell(row, evaluation.id, "mono");
    cell(row, evaluation.status, "badge " + evaluation.status);
    cell(row, modelName(evaluation.request));
    cell(row, evaluation.request.tasks.join(", "));
    const layout = evaluation.request.parallelism;
    cell(row, layout.num_replicas + "×" + layout.shard_size);
    progressCell(row, evaluation);
    cell(row, new Date(evaluation.created_at).toLocaleString());
    cell(row, seconds(evaluation.started_at, evaluation.finished_at));
    row.addEventListener("click", () => select(evaluation.id));
  }
  $("count").textContent = "(" + page.total + ")";
  $("empty").hidden = page.items.length > 0;
}

function select(id) {
  state.selected = id;
  state.resultsShownFor = null;
  state.settledFor = null;
  window.location.hash = id;
  for (const row of $("evaluations").tBodies[0].rows) {
    row.className = row.dataset.id === id ? "selected" : "";
  }
  refreshDetail().catch((error) => say(error.message));
}

function fact(list, name, value) {
  if (value === null || value === undefined || value === "") return;
  const dt = document.createElement("dt");
  dt.textContent = name;
  const dd = document.createElement("dd");
  dd.textContent = value;
  list.append(dt, dd);
}

function number(value, digits) {
  return typeof value === "number" ? value.toFixed(digits) : String(value);
}

async function refreshDetail() {
  if (!state.selected) return;
  const evaluation = await (await api("/evaluations/" + state.selected)).json();
  $("detail").hidden = false;
  $("detail").dataset.status = evaluation.status;
  $("detail-id").textContent = evaluation.id;
  $("detail-status").textContent = evaluation.status;
  $("detail-status").className = "badge " + evaluation.status;
  $("cancel").hidden = TERMINAL.has(evaluation.status);

  const facts = $("detail-facts");
  facts.replaceChildren();
  fact(facts, "model", evaluation.request.model_args.pretrained);
  fact(facts, "tasks", evaluation.request.tasks.join(", "));
  fact(facts, "queue position", evaluation.queue_position);
  fact(facts, "submitted", new Date(evaluation.created_at).toLocaleString());
  fact(facts, "started", evaluation.started_at && new Date(evaluation.started_at).toLocaleString());
  fact(facts, "finished", evaluation.finished_at && new Date(evaluation.finished_at).toLocaleString());
  fact(facts, "requests", progressText(evaluation));
  if (evaluation.throughput.tokens_per_s !== null) {
    fact(facts, "tokens/s", number(evaluation.throughput.tokens_per_s, 0));
  }
  if (evaluation.throughput.requests_per_s !== null) {
    fact(facts, "requests/s", number(evaluation.throughput.requests_per_s, 2));
  }
  $("detail-error").hidden = !evaluation.error;
  $("detail-error").textContent = evaluation.error || "";

  const phases = $("phases").tBodies[0];
  phases.replaceChildren();
  for (const [name, p] of Object.entries(evaluation.progress.phases)) {
    const row = phases.insertRow();
    cell(row, name);
    cell(row, p.done);
    cell(row, p.total);
    cell(row, number(p.tokens_per_s, 0));
    cell(row, number(p.real_token_fraction, 3));
  }

  if (evaluation.status === "succeeded" && state.resultsShownFor !== evaluation.id) {
    await showResults(evaluation);
  } else if (evaluation.status !== "succeeded") {
    $("results").hidden = true;
  }
  if (TERMINAL.has(evaluation.status)
      && (evaluation.status !== "succeeded" || state.resultsShownFor === evaluation.id)) {
    state.settledFor = evaluation.id;
  }
}

async function showResults(evaluation) {
  const results = await (await api(evaluation.links.results)).json();
  const body = $("metrics").tBodies[0];
  body.replaceChildren();
  const sections = Object.assign({}, results.results || {}, results.groups || {});
  for (const [task, metrics] of Object.entries(sections)) {
    for (const [key, value] of Object.entries(metrics)) {
      if (key === "alias" || key.includes("_stderr,")) continue;
      const [metric, filter] = key.split(",");
      const row = body.insertRow();
      row.dataset.task = task;
      row.dataset.metric = metric;
      cell(row, task);
      cell(row, metric);
      cell(row, filter || "");
      cell(row, number(value, 4), "value");
      const stderr = metrics[metric + "_stderr," + (filter || "")];
      cell(row, stderr === undefined ? "" : number(stderr, 4));
    }
  }
  $("results-link").href = evaluation.links.results;
  const links = $("samples-links");
  links.replaceChildren();
  const tasks = Object.keys(evaluation.links.samples);
  if (tasks.length) links.append("Samples (JSONL): ");
  tasks.forEach((task, i) => {
    const a = document.createElement("a");
    a.href = evaluation.links.samples[task];
    a.textContent = task;
    links.append(a, i + 1 < tasks.length ? ", " : "");
  });
  $("results").hidden = false;
  state.resultsShownFor = evaluation.id;
}

async function cancelSelected() {
  if (!state.selected || !window.confirm("Cancel evaluation " + state.selected + "?")) return;
  try {
    await api("/evaluations/" + state.selected, { method: "DELETE" });
    say("cancelled " + state.selected);
  } catch (error) {
    say(error.message);
  }
}

function poll(fn, everyMs, shouldRun) {
  const tick = async () => {
    if (!shouldRun || shouldRun()) {
      try { await fn(); say(""); } catch (error) { say(error.message); }
    }
    setTimeout(tick, everyMs);
  };
  tick();
}

$("auth").addEventListener("submit", (event) => {
  event.preventDefault();
  state.token = $("token").value.trim();
  sessionStorage.setItem("rayeval-token", state.token);
  $("auth").hidden = true;
  refreshList().catch((error) => say(error.message));
});
$("cancel").addEventListener("click", cancelSelected);

poll(refreshList, LIST_EVERY_MS);
poll(refreshDetail, DETAIL_EVERY_MS, () => state.selected && state.settledFor !== state.selected);
