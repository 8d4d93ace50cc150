// rayeval dashboard: lists evaluations, shows one's live progress (ETA per request type, a
// throughput plot drawn as inline SVG) and final metrics, and compares finished evaluations side
// by side and, pair by pair, document by document (GET /compare), by polling the REST API. Plain JavaScript, no build step, nothing fetched from
// elsewhere. Data is only ever inserted as text.
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
    checkCell(row, evaluation);
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
  $("compare-button").disabled = state.compare.size < 2;
  $("empty").hidden = page.items.length > 0;
}

function checkCell(row, evaluation) {
  const td = row.insertCell();
  td.className = "check";
  if (evaluation.status !== "succeeded") {
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
    const rate = p.seconds > 0 ? p.done / p.seconds : null;
    cell(row, rate === null ? "" : number(rate, 2));
    cell(row, number(p.tokens_per_s, 0));
    cell(row, number(p.real_token_fraction, 3));
    cell(row, p.cached === undefined ? "" : p.cached);
    cell(row, eta(p, rate, evaluation.status), "eta");
  }
  await refreshPlot(evaluation);

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
  drawPlot($("throughput-plot"), state.timeline.points);
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

function drawPlot(plot, points) {
  plot.replaceChildren();
  $("plot-empty").hidden = points.length > 0;
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
  for (const { evaluation } of evaluations) {
    const th = document.createElement("th");
    th.dataset.evaluation = evaluation.id;
    const a = document.createElement("a");
    a.href = "#" + evaluation.id;
    a.textContent = evaluation.id.slice(0, 8) + " " + modelName(evaluation.request);
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
    title.textContent = "Paired comparison: B − A, A = " + label(first) + ", B = " + label(other);
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

function pairedTable(block, comparison, a, b) {
  const note = document.createElement("p");
  note.className = "muted";
  note.textContent = "95% intervals: paired = bootstrap over the same documents ("
    + comparison.iterations.toLocaleString() + " resamples, seed " + comparison.seed
    + "); unpaired = from each run's stderr. p: McNemar's exact test for 0/1 metrics, the paired"
    + " bootstrap otherwise; * significant at 5%.";
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
  summary.textContent = "+" + m.flipped.better + " / −" + m.flipped.worse;
  details.appendChild(summary);
  // 0/1 metrics: documents that flipped; others: documents whose value rose or fell in B.
  const binary = m.test === "mcnemar";
  const titles = binary ? { better: "B right, A wrong: ", worse: "A right, B wrong: " }
    : { better: "higher in B: ", worse: "lower in B: " };
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
  const body = $("metrics").tBodies[0];
  body.replaceChildren();
  const sections = Object.assign({}, results.results || {}, results.groups || {});
  for (const [task, metrics] of Object.entries(sections)) {
    for (const [key, value] of Object.entries(metrics)) {
      if (key === "alias" || !key.includes(",") || key.includes("_stderr,")) continue;
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
$("compare-button").addEventListener("click", () => {
  showComparison([...state.compare]).catch((error) => say(error.message));
});
$("compare-close").addEventListener("click", () => { $("compare").hidden = true; });
$("sample-close").addEventListener("click", () => { $("sample-view").hidden = true; });

poll(refreshList, LIST_EVERY_MS);
poll(refreshDetail, DETAIL_EVERY_MS, () => state.selected && state.settledFor !== state.selected);
