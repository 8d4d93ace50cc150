// rayeval dashboard: lists evaluations, shows one's live progress (ETA per request type, a
// throughput plot drawn as inline SVG) and final metrics, a checkpoint sweep as curves of each
// metric against the training step, and compares finished evaluations side by side and, pair by
// pair, document by document (GET /compare), by polling the REST API. Plain JavaScript, no build
// step, nothing fetched from elsewhere. Data is only ever inserted as text.
"use strict";

const LIST_EVERY_MS = 2000;
const DETAIL_EVERY_MS = 1000;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

const state = {
  token: sessionStorage.getItem("rayeval-token") || "",
  selected: window.location.hash.slice(1) || null,
  resultsShownFor: null,
  settledFor: null,  // the selected evaluation ended and everything about it is shown
  compare: new Set(),  // ids ticked for comparison
  timeline: { id: null, after: 0, points: [] },
  sweep: { id: null, text: null, chosen: null },  // the sweep drawn (its JSON) and the checkpoint shown
};
const SVG = "http://www.w3.org/2000/svg";
const COLOURS = ["#2f6fde", "#d9480f", "#127a3a", "#7048e8", "#c2255c"];

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
    throw new Error("sign in: the API key is missing, wrong or revoked");
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
  return p.done + " / " + p.total + (p.cached ? " (" + p.cached + " from cache)" : "");
}

// What a starting or running evaluation does between batches, with its seconds so far ("" when
// it computes batches, or the server is older than stages).
function stageText(evaluation) {
  const stage = evaluation.progress.stage;
  if (!stage || stage.name === "computing") return "";
  return stage.label + " · " + duration(stage.elapsed_s);
}

// What the plot says when there is no point to draw.
function emptyPlotText(evaluation) {
  const p = evaluation.progress;
  if (p.total && p.cached >= p.total) {
    return "Every answer came from the response cache: no batch was computed.";
  }
  return stageText(evaluation) || (TERMINAL.has(evaluation.status)
    ? "No batch was computed." : "No batch has finished yet.");
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
    checkCell(row, evaluation);
    cell(row, evaluation.id, "mono");
    cell(row, evaluation.owner, "owner");
    cell(row, evaluation.status, "badge " + evaluation.status);
    cell(row, modelName(evaluation.request) + (isSweep(evaluation) ? " · " + evaluation.kind : ""));
    cell(row, evaluation.request.tasks.join(", "));
    const layout = evaluation.request.parallelism;
    cell(row, layout.num_replicas + "×" + layout.shard_size);
    progressCell(row, evaluation);
    cell(row, new Date(evaluation.created_at).toLocaleString());
    cell(row, seconds(evaluation.started_at, evaluation.finished_at));
    row.addEventListener("click", () => select(evaluation.id));
  }
  $("count").textContent = "(" + page.total + ")";
  $("compare-button").disabled = state.compare.size < 2;
  $("empty").hidden = page.items.length > 0;
}

function checkCell(row, evaluation) {
  const td = row.insertCell();
  td.className = "check";
  if (evaluation.status !== "succeeded" || isSweep(evaluation)) {  // a sweep has no one result
    state.compare.delete(evaluation.id);
    return;
  }
  const box = document.createElement("input");
  box.type = "checkbox";
  box.className = "compare";
  box.title = "compare";
  box.checked = state.compare.has(evaluation.id);
  box.addEventListener("click", (event) => event.stopPropagation());
  box.addEventListener("change", () => {
    if (box.checked) state.compare.add(evaluation.id); else state.compare.delete(evaluation.id);
    $("compare-button").disabled = state.compare.size < 2;
  });
  td.appendChild(box);
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
  $("detail-stage").textContent = stageText(evaluation);
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
    row.dataset.phase = name;
    cell(row, name);
    const td = row.insertCell();
    const bar = document.createElement("progress");
    bar.max = Math.max(p.total, 1);
    bar.value = p.done;
    td.appendChild(bar);
    cell(row, p.done);
    cell(row, p.total);
    // Answers from the response cache are done, but not a rate.
    const rate = p.seconds > 0 ? Math.max(0, p.done - (p.cached || 0)) / p.seconds : null;
    cell(row, rate === null ? "" : number(rate, 2));
    cell(row, number(p.tokens_per_s, 0));
    cell(row, number(p.real_token_fraction, 3));
    cell(row, p.cached === undefined ? "" : p.cached);
    cell(row, eta(p, rate, evaluation.status), "eta");
  }
  await refreshPlot(evaluation);

  const sweep = isSweep(evaluation);
  $("sweep").hidden = !sweep;
  if (sweep) {
    await refreshSweep(evaluation);  // its checkpoints' results are shown there, one at a time
    $("results").hidden = true;
  } else if (evaluation.status === "succeeded" && state.resultsShownFor !== evaluation.id) {
    await showResults(evaluation);
  } else if (evaluation.status !== "succeeded") {
    $("results").hidden = true;
  }
  // A sweep read after its end is final (refreshSweep above ran after the status was terminal).
  if (TERMINAL.has(evaluation.status) && (sweep || evaluation.status !== "succeeded"
      || state.resultsShownFor === evaluation.id)) {
    state.settledFor = evaluation.id;
  }
}

// ETA of one request type at its rate so far ("done" once it has computed everything).
function eta(p, rate, status) {
  if (p.done >= p.total) return "done";
  if (TERMINAL.has(status)) return "";
  if (!rate) return "…";
  return duration((p.total - p.done) / rate);
}

function duration(s) {
  s = Math.round(s);
  if (s < 120) return s + " s";
  if (s < 7200) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.round((s % 3600) / 60) + " min";
}

// ------------------------------------------------------------------- throughput plot
async function refreshPlot(evaluation) {
  const line = state.timeline;
  if (line.id !== evaluation.id) {
    state.timeline = { id: evaluation.id, after: 0, points: [] };
  }
  for (let page = 0; page < 20; page++) {  // bounded: a long run's backlog comes in pages
    const url = "/evaluations/" + evaluation.id + "/timeline?after=" + state.timeline.after;
    const timeline = await (await api(url)).json();
    if (state.timeline.id !== evaluation.id) return;  // another one was selected meanwhile
    state.timeline.points.push(...timeline.points);
    state.timeline.after = timeline.last_seq;
    if (timeline.complete) break;
  }
  drawPlot($("throughput-plot"), state.timeline.points, emptyPlotText(evaluation));
}

// Tokens/s between two reports of a request type (its average for the first report).
function series(points) {
  const byType = new Map();
  for (const p of points) {
    if (!byType.has(p.request_type)) byType.set(p.request_type, []);
    byType.get(p.request_type).push(p);
  }
  const t0 = Math.min(...points.map((p) => p.time - p.seconds));
  const result = [];
  for (const [type, reports] of byType) {
    const xy = [];
    let previous = null;
    for (const p of reports) {
      let rate = p.tokens_per_s;
      if (previous && p.seconds > previous.seconds) {
        rate = (p.tokens - previous.tokens) / (p.seconds - previous.seconds);
      } else if (previous) {
        continue;
      }
      xy.push([p.time - t0, Math.max(0, rate)]);
      previous = p;
    }
    result.push({ type, xy });
  }
  return result;
}

function svg(parent, tag, attributes, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  parent.appendChild(node);
  return node;
}

function drawPlot(plot, points, emptyText) {
  plot.replaceChildren();
  $("plot-empty").hidden = points.length > 0;
  $("plot-empty").textContent = emptyText;
  plot.dataset.points = String(points.length);
  if (!points.length) return;
  const W = 720, H = 220, left = 56, right = 150, top = 12, bottom = 30;
  const lines = series(points);
  const xs = lines.flatMap((l) => l.xy.map(([x]) => x));
  const ys = lines.flatMap((l) => l.xy.map(([, y]) => y));
  const xMax = Math.max(1, ...xs), yMax = Math.max(1, ...ys) * 1.1;
  const X = (x) => left + (x / xMax) * (W - left - right);
  const Y = (y) => H - bottom - (y / yMax) * (H - top - bottom);
  svg(plot, "line", { x1: left, y1: H - bottom, x2: W - right, y2: H - bottom, stroke: "#98a2b3" });
  svg(plot, "line", { x1: left, y1: top, x2: left, y2: H - bottom, stroke: "#98a2b3" });
  for (const fraction of [0, 0.5, 1]) {
    const y = (yMax / 1.1) * fraction;
    svg(plot, "text", { x: left - 6, y: Y(y) + 4, "text-anchor": "end" }, Math.round(y));
    svg(plot, "text", { x: X(xMax * fraction), y: H - bottom + 16, "text-anchor": "middle" },
        (xMax < 10 ? (xMax * fraction).toFixed(1) : Math.round(xMax * fraction)) + " s");
  }
  svg(plot, "text", { x: 4, y: top + 4 }, "tok/s");
  lines.forEach((line, i) => {
    const colour = COLOURS[i % COLOURS.length];
    const path = line.xy.map(([x, y]) => X(x).toFixed(1) + "," + Y(y).toFixed(1)).join(" ");
    svg(plot, "polyline", {
      points: path, fill: "none", stroke: colour, "stroke-width": 2, class: "series",
      "data-request-type": line.type,
    });
    for (const [x, y] of line.xy) {
      svg(plot, "circle", { cx: X(x), cy: Y(y), r: 2.5, fill: colour });
    }
    svg(plot, "rect", { x: W - right + 12, y: top + 4 + i * 18, width: 10, height: 10, fill: colour });
    svg(plot, "text", { x: W - right + 26, y: top + 13 + i * 18 }, line.type);
  });
}

// ------------------------------------------------------------------- checkpoint sweep
// A sweep (or watch) evaluates one model's training checkpoints: per task and metric, the value
// against the checkpoint's training step (a band of value ± stderr where lm-eval gives a numeric
// stderr), redrawn as checkpoints finish; a point or a table row opens that checkpoint's results.
function isSweep(evaluation) {
  return (evaluation.kind === "sweep" || evaluation.kind === "watch")
    && Boolean(evaluation.links && evaluation.links.sweep);
}

async function refreshSweep(evaluation) {
  const text = await (await api(evaluation.links.sweep)).text();
  if (state.selected !== evaluation.id) return;  // another one was selected meanwhile
  const same = state.sweep.id === evaluation.id;
  if (same && state.sweep.text === text) return;  // nothing new: keep the page as it is
  state.sweep = { id: evaluation.id, text, chosen: same ? state.sweep.chosen : null };
  if (!same) $("checkpoint").hidden = true;
  drawSweep(JSON.parse(text));
}

// Stepped checkpoints by step, then those without a step by label.
function byStep(records) {
  return records.slice().sort((a, b) => {
    if ((a.step === null) !== (b.step === null)) return a.step === null ? 1 : -1;
    if (a.step !== null && a.step !== b.step) return a.step - b.step;
    return a.label < b.label ? -1 : a.label > b.label ? 1 : 0;
  });
}

function finite(value) { return typeof value === "number" && Number.isFinite(value); }

// One curve per task, metric and filter with a number at some succeeded checkpoint, in the
// order they first appear.
function sweepCurves(plotted) {
  const curves = new Map();
  for (const record of plotted) {
    for (const [task, metrics] of Object.entries(record.results || {})) {
      for (const [key, value] of Object.entries(metrics)) {
        if (key === "alias" || !key.includes(",") || key.includes("_stderr,")) continue;
        if (!finite(value)) continue;
        const [metric, filter] = key.split(",");
        const id = [task, metric, filter || ""].join("|");
        if (!curves.has(id)) {
          const better = ((record.higher_is_better || {})[task] || {})[metric];
          curves.set(id, { task, metric, filter: filter || "", better, points: [] });
        }
        const stderr = metrics[metric + "_stderr," + (filter || "")];
        curves.get(id).points.push({ record, value, stderr: finite(stderr) ? stderr : null });
      }
    }
  }
  return [...curves.values()];
}

function drawSweep(sweep) {
  // A step is a number or null (a name without one); anything else counts as null.
  const ordered = byStep(sweep.checkpoints.map((record) =>
    Object.assign({}, record, { step: finite(record.step) ? record.step : null })));
  const plotted = ordered.filter((record) => record.status === "succeeded");
  // x: proportional to the step when every plotted checkpoint has its own; else evenly spaced
  // in step order (labelled by step, or by label for a checkpoint without one).
  const steps = plotted.map((record) => record.step);
  const proportional = plotted.length > 1 && steps.every((s) => s !== null)
    && new Set(steps).size === steps.length;
  const lo = proportional ? steps[0] : 0;
  const span = proportional ? steps[steps.length - 1] - lo : Math.max(plotted.length - 1, 1);
  const position = new Map(plotted.map((record, i) => [record.label,
    plotted.length === 1 ? 0.5 : ((proportional ? record.step : i) - lo) / span]));
  const box = $("sweep-curves");
  box.replaceChildren();
  box.dataset.scale = proportional ? "step" : "ordinal";
  sweepCurves(plotted).forEach((curve, i) => {
    const plot = document.createElementNS(SVG, "svg");
    plot.setAttribute("class", "curve");
    Object.assign(plot.dataset, { task: curve.task, metric: curve.metric, filter: curve.filter });
    box.appendChild(plot);
    drawCurve(plot, curve, position, COLOURS[i % COLOURS.length]);
  });
  $("sweep-empty").hidden = plotted.length > 0;
  $("sweep-count").textContent = "(" + plotted.length + " of " + ordered.length
    + " checkpoints plotted)";
  sweepTable(ordered);
  markChosen();
}

function tick(value) {
  const rounded = Number(value.toPrecision(3));
  return Math.abs(rounded) >= 1e5 || (rounded !== 0 && Math.abs(rounded) < 1e-3)
    ? rounded.toExponential(1) : String(rounded);
}

function drawCurve(plot, curve, position, colour) {
  const W = 360, H = 210, left = 50, right = 16, top = 30, bottom = 34;
  plot.setAttribute("viewBox", "0 0 " + W + " " + H);
  plot.setAttribute("width", W);
  plot.setAttribute("height", H);
  plot.setAttribute("role", "img");
  const name = curve.task + " · " + curve.metric
    + (curve.filter && curve.filter !== "none" ? " (" + curve.filter + ")" : "");
  plot.setAttribute("aria-label", name + " by training step");
  const points = curve.points;
  const lows = points.map((p) => p.value - (p.stderr || 0));
  const highs = points.map((p) => p.value + (p.stderr || 0));
  let yMin = Math.min(...lows), yMax = Math.max(...highs);
  const pad = yMax > yMin ? (yMax - yMin) * 0.08 : Math.max(Math.abs(yMax) * 0.05, 0.05);
  yMin -= pad;
  yMax += pad;
  const inset = 12;  // keeps the first and last points off the axes
  const X = (record) => left + inset + position.get(record.label) * (W - left - right - 2 * inset);
  const Y = (y) => H - bottom - ((y - yMin) / (yMax - yMin)) * (H - top - bottom);
  svg(plot, "text", { x: 6, y: 16, class: "title" }, name);
  if (typeof curve.better === "boolean") {
    svg(plot, "text", { x: W - 6, y: 16, "text-anchor": "end" },
        curve.better ? "higher is better" : "lower is better");
  }
  svg(plot, "line", { x1: left, y1: H - bottom, x2: W - right, y2: H - bottom, stroke: "#98a2b3" });
  svg(plot, "line", { x1: left, y1: top, x2: left, y2: H - bottom, stroke: "#98a2b3" });
  for (const fraction of [0, 0.5, 1]) {
    const y = yMin + pad + (yMax - yMin - 2 * pad) * fraction;
    svg(plot, "text", { x: left - 6, y: Y(y) + 4, "text-anchor": "end" }, tick(y));
  }
  const every = Math.ceil(points.length / 8);  // at most 8 step labels under the axis
  points.forEach((p, i) => {
    if (i % every && i !== points.length - 1) return;
    svg(plot, "text", { x: X(p.record), y: H - bottom + 15, "text-anchor": "middle" },
        p.record.step === null ? p.record.label : String(p.record.step));
  });
  svg(plot, "text", { x: (left + W - right) / 2, y: H - 4, "text-anchor": "middle" }, "step");
  for (const run of stderrRuns(points)) {
    const labels = run.map((p) => p.record.label).join(" ");
    if (run.length === 1) {
      const [p] = run;
      svg(plot, "line", { x1: X(p.record), y1: Y(p.value - p.stderr), x2: X(p.record),
        y2: Y(p.value + p.stderr), stroke: colour, "stroke-opacity": 0.35, "stroke-width": 6,
        class: "band", "data-labels": labels });
      continue;
    }
    const upper = run.map((p) => X(p.record).toFixed(1) + "," + Y(p.value + p.stderr).toFixed(1));
    const lower = run.map((p) => X(p.record).toFixed(1) + "," + Y(p.value - p.stderr).toFixed(1));
    svg(plot, "polygon", { points: upper.concat(lower.reverse()).join(" "), fill: colour,
      "fill-opacity": 0.18, stroke: "none", class: "band", "data-labels": labels });
  }
  svg(plot, "polyline", {
    points: points.map((p) => X(p.record).toFixed(1) + "," + Y(p.value).toFixed(1)).join(" "),
    fill: "none", stroke: colour, "stroke-width": 2, class: "series",
  });
  for (const p of points) {
    const dot = svg(plot, "circle", { cx: X(p.record), cy: Y(p.value), r: 4.5, fill: colour,
      class: "point", "data-label": p.record.label, "data-step": String(p.record.step),
      "data-value": String(p.value), "data-stderr": p.stderr === null ? "" : String(p.stderr) });
    svg(dot, "title", {}, p.record.label + (p.record.step === null ? "" : " (step "
      + p.record.step + ")") + ": " + number(p.value, 4)
      + (p.stderr === null ? "" : " ± " + number(p.stderr, 4)));
    dot.addEventListener("click", () => chooseCheckpoint(p.record));
  }
}

// Consecutive points that have a stderr (a point without one breaks the band).
function stderrRuns(points) {
  const runs = [];
  let run = [];
  for (const p of points) {
    if (p.stderr === null) {
      if (run.length) runs.push(run);
      run = [];
    } else {
      run.push(p);
    }
  }
  if (run.length) runs.push(run);
  return runs;
}

function sweepTable(ordered) {
  const body = $("sweep-table").tBodies[0];
  body.replaceChildren();
  for (const record of ordered) {
    const row = body.insertRow();
    row.dataset.label = record.label;
    row.dataset.status = record.status;
    row.dataset.kind = record.kind || "weights";
    // A LoRA checkpoint is labelled as one: its results are the sweep's base with it applied.
    cell(row, record.label + (record.kind === "adapter" ? " (adapter)" : ""), "mono");
    cell(row, record.step === null ? "" : String(record.step));
    cell(row, record.status, "badge " + record.status);
    const total = (record.seconds || {}).total;
    cell(row, finite(total) ? number(total, 1) : "");
    cell(row, record.error || "", "error");
    if (record.status === "succeeded" && record.links) {
      row.classList.add("openable");
      row.addEventListener("click", () => chooseCheckpoint(record));
    }
  }
}

function chooseCheckpoint(record) {
  showCheckpoint(record).catch((error) => say(error.message));
}

function markChosen() {
  const chosen = state.sweep.chosen;
  for (const node of $("sweep").querySelectorAll("circle.point, #sweep-table tbody tr")) {
    node.classList.toggle("chosen", chosen !== null && node.dataset.label === chosen);
  }
}

// One checkpoint's lm-eval results file, rendered as a normal evaluation's metrics are.
async function showCheckpoint(record) {
  state.sweep.chosen = record.label;
  markChosen();
  const results = await (await api(record.links.results)).json();
  if (state.sweep.chosen !== record.label) return;  // another one was chosen meanwhile
  $("checkpoint").dataset.label = record.label;
  $("checkpoint-label").textContent = record.label
    + (record.kind === "adapter" ? ", adapter" : "")
    + (record.step === null ? "" : " (step " + record.step + ")");
  $("checkpoint-results-link").href = record.links.results;
  fillMetrics($("checkpoint-metrics").tBodies[0], results);
  fillSamplesLinks($("checkpoint-samples"), record.links.samples);
  $("checkpoint").hidden = false;
}

// ----------------------------------------------------------------------- comparison
async function showComparison(ids) {
  const evaluations = await Promise.all(ids.map(async (id) => {
    const evaluation = await (await api("/evaluations/" + id)).json();
    const results = await (await api(evaluation.links.results)).json();
    return { evaluation, results };
  }));
  const head = $("compare-table").tHead.rows[0];
  head.replaceChildren();
  for (const title of ["task", "metric", "filter"]) {
    const th = document.createElement("th");
    th.textContent = title;
    head.appendChild(th);
  }
  const differs = distinctions(evaluations.map(({ evaluation }) => evaluation.request));
  for (const [column, { evaluation }] of evaluations.entries()) {
    const th = document.createElement("th");
    th.dataset.evaluation = evaluation.id;
    const a = document.createElement("a");
    a.href = "#" + evaluation.id;
    a.textContent = label(evaluation) + differs[column];
    a.addEventListener("click", () => select(evaluation.id));
    th.appendChild(a);
    head.appendChild(th);
  }
  const rows = new Map();  // "task|metric|filter" -> per evaluation {value, stderr}
  evaluations.forEach(({ results }, column) => {
    const sections = Object.assign({}, results.results || {}, results.groups || {});
    for (const [task, metrics] of Object.entries(sections)) {
      for (const [key, value] of Object.entries(metrics)) {
        if (key === "alias" || !key.includes(",") || key.includes("_stderr,")) continue;
        const [metric, filter] = key.split(",");
        const id = [task, metric, filter || ""].join("|");
        if (!rows.has(id)) rows.set(id, { task, metric, filter: filter || "", cells: [] });
        rows.get(id).cells[column] = { value, stderr: metrics[metric + "_stderr," + (filter || "")] };
      }
    }
  });
  const body = $("compare-table").tBodies[0];
  body.replaceChildren();
  for (const { task, metric, filter, cells } of rows.values()) {
    const row = body.insertRow();
    row.dataset.task = task;
    row.dataset.metric = metric;
    row.dataset.filter = filter;
    const taskCell = cell(row, task, "task");
    evaluations.forEach(({ evaluation }, i) => {
      const url = evaluation.links.samples[task];
      if (!url) return;
      const a = document.createElement("a");
      a.href = url;
      a.className = "samples";
      a.textContent = " samples" + (evaluations.length > 1 ? " " + (i + 1) : "");
      taskCell.appendChild(a);
    });
    cell(row, metric);
    cell(row, filter);
    const first = cells[0];
    let differs = false;
    evaluations.forEach(({ evaluation }, i) => {
      const c = cells[i];
      const text = c === undefined ? "—" : number(c.value, 4)
        + (typeof c.stderr === "number" ? " ± " + number(c.stderr, 4) : "");
      const td = cell(row, text, "value");
      td.dataset.evaluation = evaluation.id;
      if (i === 0 || c === undefined || first === undefined) {
        if (i > 0) { td.classList.add("diff"); differs = true; }
        return;
      }
      if (typeof c.value === "number" && typeof first.value === "number") {
        const delta = c.value - first.value;
        if (Math.abs(delta) > 1e-12) {
          td.classList.add("diff");
          td.title = "Δ " + (delta > 0 ? "+" : "") + delta.toFixed(4) + " vs the first";
          differs = true;
          const se = [c.stderr, first.stderr];
          if (se.every((v) => typeof v === "number")
              && Math.abs(delta) > Math.hypot(se[0], se[1])) {
            td.classList.add("significant");
          }
        }
      } else if (c.value !== first.value) {
        td.classList.add("diff");
        differs = true;
      }
    });
    if (differs) row.classList.add("differs");
  }
  $("compare").hidden = false;
  $("sample-view").hidden = true;
  await showPaired(evaluations.map(({ evaluation }) => evaluation));
  $("compare").scrollIntoView();
}

// ------------------------------------------------------------------ paired comparison
// The first evaluation against each other one: per task and metric the difference (B − A), its
// paired 95% interval and p-value, the unpaired interval beside it, and the documents that
// flipped, each a link to its samples.
async function showPaired(evaluations) {
  const box = $("paired");
  box.replaceChildren();
  const [first, ...others] = evaluations;
  for (const other of others) {
    const block = document.createElement("div");
    block.className = "paired";
    block.dataset.a = first.id;
    block.dataset.b = other.id;
    const title = document.createElement("h3");
    const [ofA, ofB] = distinctions([first.request, other.request]);
    title.textContent = "Paired comparison: B − A, A = " + label(first) + ofA
      + ", B = " + label(other) + ofB;
    block.appendChild(title);
    box.appendChild(block);
    const url = "/compare?a=" + encodeURIComponent(first.id) + "&b=" + encodeURIComponent(other.id);
    try {
      pairedTable(block, await (await api(url)).json(), first, other);
    } catch (error) {
      const p = document.createElement("p");
      p.className = "paired-error error";
      p.textContent = "Not paired: " + error.message;
      block.appendChild(p);
    }
  }
}

function label(evaluation) {
  return evaluation.id.slice(0, 8) + " " + modelName(evaluation.request);
}

// What an evaluation ran with, beside its model: the settings a comparison tells apart.
function settingsOf(request) {
  const layout = request.parallelism;
  return {
    checkpoint: request.model_args.checkpoint || "",
    dtype: request.model_args.dtype || "auto",
    layout: layout.num_replicas + "x" + layout.shard_size
      + (layout.shard_size > 1 ? " " + layout.shard_strategy : ""),
    device: request.device,
    "few-shot": request.num_fewshot === null ? "task default" : String(request.num_fewshot),
    limit: request.limit === null ? "all" : String(request.limit),
    "batch size": String(request.batch_size),
  };
}

// Per request, " (dtype bfloat16, layout 2x1)": the settings in which the requests differ
// (empty strings when they ran alike), so that two columns of one model do not read alike.
function distinctions(requests) {
  const settings = requests.map(settingsOf);
  const keys = Object.keys(settings[0]).filter(
    (key) => new Set(settings.map((s) => s[key])).size > 1);
  return settings.map((s) => keys.length
    ? " (" + keys.map((key) => key + " " + s[key]).join(", ") + ")" : "");
}

function pairedTable(block, comparison, a, b) {
  const note = document.createElement("p");
  note.className = "muted";
  note.textContent = "95% intervals: paired = bootstrap over the same documents ("
    + comparison.iterations.toLocaleString() + " resamples, seed " + comparison.seed
    + "); unpaired = from each run's stderr. p: McNemar's exact test for 0/1 metrics, a paired"
    + " sign-flip permutation test otherwise; * significant at 5%.";
  block.appendChild(note);
  const table = document.createElement("table");
  table.className = "paired-table";
  const head = table.createTHead().insertRow();
  for (const title of ["task", "metric", "filter", "docs", "A", "B", "B − A",
    "paired 95% interval", "p", "unpaired 95% interval", "moved (+ / −)"]) {
    const th = document.createElement("th");
    th.textContent = title;
    head.appendChild(th);
  }
  const body = table.createTBody();
  for (const m of comparison.metrics) {
    const row = body.insertRow();
    Object.assign(row.dataset, { task: m.task, metric: m.metric, filter: m.filter });
    if (m.significant) row.classList.add("significant");
    cell(row, m.task);
    cell(row, m.metric);
    cell(row, m.filter);
    cell(row, m.documents, "num");
    cell(row, fixed(m.a), "num");
    cell(row, fixed(m.b), "num");
    const difference = cell(row, signed(m.difference) + (m.significant ? " *" : ""), "num difference");
    if (m.significant && m.higher_is_better !== null && m.difference !== null) {
      difference.classList.add((m.difference > 0) === m.higher_is_better ? "improved" : "regressed");
    }
    cell(row, interval(m.paired_interval), "num paired");
    const p = cell(row, pValue(m.p_value), "num p");
    p.title = m.test;
    if (m.significant) {
      const star = document.createElement("span");
      star.className = "star";
      star.textContent = " *";
      p.appendChild(star);
    }
    cell(row, interval(m.unpaired_interval), "num unpaired");
    flipsCell(row, m, a, b);
  }
  block.appendChild(table);
}

function flipsCell(row, m, a, b) {
  const td = row.insertCell();
  td.className = "flips";
  const details = document.createElement("details");
  const summary = document.createElement("summary");
  if (!m.moved) {  // a corpus-only value: no document moves on its own
    td.textContent = "n/a";
    td.title = "this metric has no value per document";
    return;
  }
  summary.textContent = "+" + m.flipped.better + " / −" + m.flipped.worse;
  details.appendChild(summary);
  // 0/1 metrics: documents that flipped; others: documents whose value (for perplexities and
  // bits per byte: log-likelihood) rose or fell in B.
  const what = m.moved === "loglikelihood" ? "log-likelihood " : "";
  const titles = m.moved === "flips" ? { better: "B right, A wrong: ", worse: "A right, B wrong: " }
    : { better: what + "higher in B: ", worse: what + "lower in B: " };
  for (const [name, docs] of [["better", m.better], ["worse", m.worse]]) {
    const line = document.createElement("div");
    line.className = "docs " + name;
    line.append(titles[name]);
    if (!docs.length) line.append("none");
    for (const doc of docs) {
      const link = document.createElement("a");
      link.href = samplesUrl(b, m.task, doc);
      link.className = "doc";
      link.dataset.doc = String(doc);
      link.textContent = String(doc);
      link.title = "document " + doc + ": its samples in A and B";
      link.addEventListener("click", (event) => {
        event.preventDefault();
        showDocument(a, b, m.task, doc).catch((error) => say(error.message));
      });
      line.append(link, " ");
    }
    details.appendChild(line);
  }
  td.appendChild(details);
}

function samplesUrl(evaluation, task, doc) {
  return "/evaluations/" + evaluation.id + "/samples/" + encodeURIComponent(task)
    + "?doc_id=" + encodeURIComponent(doc);
}

// One document's samples in A and in B, side by side (the lines of GET .../samples/{task}?doc_id=).
async function showDocument(a, b, task, doc) {
  const texts = await Promise.all([a, b].map(async (evaluation) => {
    const jsonl = await (await api(samplesUrl(evaluation, task, doc))).text();
    return jsonl.split("\n").filter((line) => line.trim())
      .map((line) => JSON.stringify(JSON.parse(line), null, 2)).join("\n\n");
  }));
  $("sample-doc").textContent = String(doc);
  $("sample-task").textContent = task;
  $("sample-a-title").textContent = "A: " + label(a);
  $("sample-b-title").textContent = "B: " + label(b);
  $("sample-a").textContent = texts[0];
  $("sample-b").textContent = texts[1];
  $("sample-view").hidden = false;
  $("sample-view").scrollIntoView();
}

function fixed(value) { return value === null ? "n/a" : number(value, 4); }

function signed(value) {
  return value === null ? "n/a" : (value > 0 ? "+" : "") + value.toFixed(4);
}

function interval(bounds) {
  return bounds === null ? "n/a" : "[" + signed(bounds[0]) + ", " + signed(bounds[1]) + "]";
}

function pValue(p) {
  if (p === null) return "n/a";
  return p < 0.0001 ? "< 0.0001" : p.toFixed(4);
}

async function showResults(evaluation) {
  const results = await (await api(evaluation.links.results)).json();
  fillMetrics($("metrics").tBodies[0], results);
  $("results-link").href = evaluation.links.results;
  fillSamplesLinks($("samples-links"), evaluation.links.samples);
  $("results").hidden = false;
  state.resultsShownFor = evaluation.id;
}

// lm-eval's metrics ("metric,filter" keys of `results` and `groups`), one row each with its stderr.
function fillMetrics(body, results) {
  body.replaceChildren();
  const sections = Object.assign({}, results.results || {}, results.groups || {});
  for (const [task, metrics] of Object.entries(sections)) {
    for (const [key, value] of Object.entries(metrics)) {
      if (key === "alias" || !key.includes(",") || key.includes("_stderr,")) continue;
      const [metric, filter] = key.split(",");
      const row = body.insertRow();
      row.dataset.task = task;
      row.dataset.metric = metric;
      row.dataset.filter = filter || "";
      cell(row, task);
      cell(row, metric);
      cell(row, filter || "");
      cell(row, number(value, 4), "value");
      const stderr = metrics[metric + "_stderr," + (filter || "")];
      cell(row, stderr === undefined ? "" : number(stderr, 4), "stderr");
    }
  }
}

function fillSamplesLinks(links, samples) {
  links.replaceChildren();
  const tasks = Object.keys(samples || {});
  if (tasks.length) links.append("Samples (JSONL): ");
  tasks.forEach((task, i) => {
    const a = document.createElement("a");
    a.href = samples[task];
    a.textContent = task;
    links.append(a, i + 1 < tasks.length ? ", " : "");
  });
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

// Who the key is: shown in the header, with a way to sign out (the key lives in this tab's
// sessionStorage only, never in a URL).
async function showWhoAmI() {
  const me = await (await api("/me")).json();
  $("whoami").textContent = "signed in as " + me.name + " (" + me.role + ")";
  $("sign-out").hidden = !state.token;
}

$("auth").addEventListener("submit", (event) => {
  event.preventDefault();
  state.token = $("token").value.trim();
  $("token").value = "";
  sessionStorage.setItem("rayeval-token", state.token);
  $("auth").hidden = true;
  showWhoAmI().then(refreshList).catch((error) => say(error.message));
});
$("sign-out").addEventListener("click", () => {
  sessionStorage.removeItem("rayeval-token");
  window.location.reload();
});
showWhoAmI().catch((error) => say(error.message));
$("cancel").addEventListener("click", cancelSelected);
$("compare-button").addEventListener("click", () => {
  showComparison([...state.compare]).catch((error) => say(error.message));
});
$("compare-close").addEventListener("click", () => { $("compare").hidden = true; });
$("sample-close").addEventListener("click", () => { $("sample-view").hidden = true; });

poll(refreshList, LIST_EVERY_MS);
poll(refreshDetail, DETAIL_EVERY_MS, () => state.selected && state.settledFor !== state.selected);
