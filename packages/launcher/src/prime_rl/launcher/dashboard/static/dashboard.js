// prime-rl dashboard page: polls /api/state, keeps every run's rows, draws one uPlot per metric.
// The server sends only rows the page lacks (per run: [epoch, count]); a changed epoch means the
// metrics file was rewritten, so that run's rows are dropped and read again.
"use strict";

const CFG = JSON.parse(document.getElementById("config").textContent);
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
                 "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"];

const state = {
  runs: new Map(),      // name -> {epoch, rows: [], info}
  colors: new Map(),    // name -> color, stable for the page's life
  keys: [],             // every metric key seen in any run
  selected: new Set(),  // keys plotted
  userPicked: false,    // once the user touches the selector, stop applying defaults
  hidden: new Set(),    // runs unticked in the table
  charts: new Map(),    // key -> {plot, el, sig}
  polls: 0,
};
window.dashboard = state;  // for debugging and the browser test

function colorOf(name) {
  if (!state.colors.has(name)) state.colors.set(name, PALETTE[state.colors.size % PALETTE.length]);
  return state.colors.get(name);
}

function fmt(v) {
  if (v === null || v === undefined) return "–";
  const a = Math.abs(v);
  if (Number.isInteger(v) && a < 1e6) return String(v);
  if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(3);
  if (a >= 1000) return Math.round(v).toLocaleString("en-US");
  return v.toPrecision(4);
}

// Axis ticks: uPlot's default shows 0.0002 as "0" on a small-valued axis; keep 4 significant digits.
function fmtTick(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e5 || a < 1e-3) return v.toExponential(1);
  return String(+v.toPrecision(4));
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "dataset") Object.assign(e.dataset, v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

function defaultSelection() {
  const keys = new Set(state.keys);
  const pick = CFG.defaultPlots.filter((k) => keys.has(k));
  if (!keys.has("loss/mean")) {
    const loss = state.keys.find((k) => k.startsWith("loss/"));
    if (loss) pick.push(loss);
  }
  if (!keys.has("reward/mean")) {
    const reward = state.keys.find((k) => k === "reward" || k.startsWith("reward/"));
    if (reward) pick.push(reward);
  }
  // online evals (`[orchestrator.eval]`): every environment's eval reward, beside the training reward
  pick.push(...state.keys.filter((k) => /^eval\/[^/]+\/reward_mean$/.test(k)));
  return pick.length ? pick : state.keys.slice(0, 4);
}

function apply(data) {
  const seen = new Set();
  for (const info of data.runs) {
    seen.add(info.name);
    let run = state.runs.get(info.name);
    if (!run || run.epoch !== info.epoch) {
      run = {epoch: info.epoch, rows: [], info};
      state.runs.set(info.name, run);
    }
    if (info.start !== run.rows.length) run.rows = run.rows.slice(0, info.start);
    for (const row of info.rows) run.rows.push(row);
    delete info.rows;
    run.info = info;
    colorOf(info.name);
  }
  for (const name of [...state.runs.keys()]) if (!seen.has(name)) state.runs.delete(name);
  state.keys = data.keys;
  if (!state.userPicked) state.selected = new Set(defaultSelection());
  return data.runs.some((r) => r.more);
}

function notesOf(info) {
  const notes = [];
  if (info.num_rows === 0) notes.push(info.has_metrics_file ? "no metrics yet (file empty)" : "no metrics yet");
  if (info.skipped_lines) notes.push(`${info.skipped_lines} malformed line${info.skipped_lines > 1 ? "s" : ""} skipped`);
  if (info.partial_line) notes.push("last line still being written");
  for (const [key, step] of Object.entries(info.nonfinite || {})) notes.push(`${key} was NaN/inf (last at step ${step})`);
  if (info.state === "failed" || info.state === "stale") notes.push(info.reason);
  return notes.join("; ");
}

function renderTable() {
  const tbody = document.querySelector("#runs tbody");
  // Rebuild only when a run's row changed, so polls do not churn the DOM under the user's mouse.
  const sig = JSON.stringify([...state.runs.values()].map((r) => r.info));
  if (tbody.dataset.sig === sig) return;
  tbody.dataset.sig = sig;
  tbody.replaceChildren();
  for (const [name, run] of state.runs) {
    const info = run.info;
    const box = el("input", {type: "checkbox", dataset: {run: name}});
    box.checked = !state.hidden.has(name);
    box.addEventListener("change", () => {
      box.checked ? state.hidden.delete(name) : state.hidden.add(name);
      renderPlots();
    });
    const tr = el("tr", {dataset: {run: name, state: info.state}},
      el("td", {}, box),
      el("td", {title: info.path}, el("span", {class: "swatch", style: `background:${colorOf(name)}`}), name),
      el("td", {}, el("span", {class: `state state-${info.state}`, title: info.reason}, info.state)),
      el("td", {class: "num step", dataset: {run: name}}, info.latest_step === null ? "–" : String(info.latest_step)));
    for (const label of CFG.figures) {
      const fig = info.figures[label];
      const text = !fig ? "–" : fig.nonfinite ? "NaN" : fmt(fig.value);
      tr.append(el("td", {class: fig?.nonfinite ? "num error" : "num", title: fig ? fig.key : ""}, text));
    }
    tr.append(el("td", {class: "notes"}, notesOf(info)));
    tbody.append(tr);
  }
  document.getElementById("run-count").textContent = `(${state.runs.size})`;
  document.getElementById("no-runs").hidden = state.runs.size > 0;
}

function renderSelector() {
  const box = document.getElementById("keys");
  const filter = document.getElementById("key-filter").value.trim().toLowerCase();
  // Rebuild only when something changed, so a poll never resets the list's scroll or focus.
  const sig = [filter, ...state.keys, "\u0000", ...state.selected].join("\u0001");
  if (box.dataset.sig === sig) return;
  box.dataset.sig = sig;
  box.replaceChildren();
  for (const key of state.keys) {
    if (filter && !key.toLowerCase().includes(filter)) continue;
    const input = el("input", {type: "checkbox", value: key});
    input.checked = state.selected.has(key);
    input.addEventListener("change", () => {
      state.userPicked = true;
      input.checked ? state.selected.add(key) : state.selected.delete(key);
      renderPlots();
    });
    box.append(el("label", {title: key}, input, " " + key));
  }
}

// uPlot wants aligned columns: one shared x (union of steps) and a y column per run, null where absent.
function plotData(key, names) {
  const perRun = names.map((n) => {
    const m = new Map();
    for (const row of state.runs.get(n).rows) if (key in row) m.set(row.step, row[key]);
    return m;
  });
  const steps = [...new Set(perRun.flatMap((m) => [...m.keys()]))].sort((a, b) => a - b);
  return [steps, ...perRun.map((m) => steps.map((s) => (m.has(s) ? m.get(s) : null)))];
}

function plotWidth(container) {
  return Math.max(300, container.clientWidth - 12);
}

function renderPlots() {
  const plots = document.getElementById("plots");
  const names = [...state.runs.keys()].filter((n) => !state.hidden.has(n));
  // Plots follow selection order: the defaults first (reward, loss, ...), then what the user ticks.
  const keys = [...state.selected].filter((k) => state.keys.includes(k));
  for (const [key, chart] of state.charts) {
    if (!keys.includes(key)) { chart.plot?.destroy(); chart.el.remove(); state.charts.delete(key); }
  }
  for (const key of keys) {
    let chart = state.charts.get(key);
    if (!chart) {
      const div = el("div", {class: "plot", dataset: {key}}, el("h3", {}, key));
      plots.append(div);
      chart = {el: div, plot: null, sig: ""};
      state.charts.set(key, chart);
    }
    const withKey = names.filter((n) => state.runs.get(n).rows.some((r) => key in r));
    const sig = withKey.join("\u0000");
    const data = plotData(key, withKey);
    if (chart.sig !== sig || !chart.plot) {
      chart.plot?.destroy();
      chart.plot = null;
      chart.el.querySelector(".empty")?.remove();
      chart.sig = sig;
      if (!withKey.length) { chart.el.append(el("div", {class: "empty"}, "no data in the shown runs")); continue; }
      chart.plot = new uPlot({
        width: plotWidth(chart.el), height: 230,
        scales: {x: {time: false}},
        cursor: {sync: {key: "steps"}},
        axes: [{label: "step"}, {size: 64, values: (u, splits) => splits.map(fmtTick)}],
        series: [{label: "step"}, ...withKey.map((n) => ({
          label: n, stroke: colorOf(n), width: 1.5, spanGaps: true, points: {show: false},
          value: (u, v) => (v === null || v === undefined ? "--" : fmt(v)),
        }))],
      }, data, chart.el);
    } else {
      chart.plot.setData(data);
    }
  }
  // Keep plots in selector order.
  for (const key of keys) plots.append(state.charts.get(key).el);
}

function render() {
  renderTable();
  renderSelector();
  renderPlots();
}

async function poll() {
  const since = {};
  for (const [name, run] of state.runs) since[name] = [run.epoch, run.rows.length];
  let more = false;
  const status = document.getElementById("poll-status");
  try {
    const resp = await fetch("/api/state?since=" + encodeURIComponent(JSON.stringify(since)), {cache: "no-store"});
    if (!resp.ok) throw new Error(`HTTP ${resp.status}: ${await resp.text()}`);
    more = apply(await resp.json());
    render();
    state.polls += 1;
    status.className = "muted";
    status.textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    status.className = "error";
    status.textContent = `cannot reach the dashboard server (${err.message}); retrying`;
  }
  setTimeout(poll, more ? 0 : CFG.pollMs);
}

document.getElementById("key-filter").addEventListener("input", renderSelector);
window.addEventListener("resize", () => {
  for (const chart of state.charts.values()) {
    chart.plot?.setSize({width: plotWidth(chart.el), height: 230});
  }
});
poll();
