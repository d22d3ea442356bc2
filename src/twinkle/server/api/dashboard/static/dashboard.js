// The twinkle dashboard: signs in with a key and calls the server's APIs with it (X-API-Key).
// A tenant's key sees its own runs, their curves as they train, its checkpoints and its usage; the
// admin key sees tenants, queues, passes, adapters, restarts and every tenant's usage. Every value the server sends is shown
// as text (textContent), never as HTML.
'use strict';

const FIGURES = [
  ['loss', 'loss'],
  ['lr', 'learning rate'],
  ['grad_norm', 'gradient norm'],
  ['tokens_per_s', 'tokens / s'],
];
const POLL_MS = 1000;
const USAGE_DAYS = 30;
const state = {
  key: sessionStorage.getItem('twinkle-key'), run: null, after: 0, figures: [], points: null, charts: {}, timers: [],
};
const $ = (id) => document.getElementById(id);

async function api(method, path, params) {
  const url = new URL(path, location.origin);
  for (const [name, value] of Object.entries(params || {})) url.searchParams.set(name, value);
  const answer = await fetch(url, { method, headers: { 'X-API-Key': state.key } });
  const body = await answer.json().catch(() => ({}));
  if (!answer.ok) throw new Error(body.detail || `${answer.status} ${answer.statusText}`);
  return body;
}

function cell(row, text) {
  const td = document.createElement('td');
  td.textContent = text;
  row.appendChild(td);
  return td;
}

function button(parent, label, action) {
  const b = document.createElement('button');
  b.textContent = label;
  b.addEventListener('click', async () => {
    $('action-error').textContent = '';
    try { await action(); } catch (error) { $('action-error').textContent = error.message; }
  });
  parent.appendChild(b);
  return b;
}

// Runs fn now and every ms, never two at once (a slow answer is not asked for again before it
// comes), and not while the tab is hidden: an open tab spends little of the tenant's request rate.
function every(ms, fn) {
  let busy = false;
  const tick = async () => {
    if (busy || document.hidden) return;
    busy = true;
    try { await fn(); } catch (error) { console.warn(error); } finally { busy = false; }
  };
  tick();
  state.timers.push(setInterval(tick, ms));
}

function sizeText(bytes) {
  const units = ['B', 'KB', 'MB', 'GB'];
  let i = 0;
  while (bytes >= 1024 && i < units.length - 1) { bytes /= 1024; i += 1; }
  return `${bytes.toFixed(i ? 1 : 0)} ${units[i]}`;
}

// A table's rows, each [values...] or {key, values} (the key in the row's data-key).
function fill(table, rows) {
  const body = $(table).querySelector('tbody');
  body.replaceChildren();
  for (const entry of rows) {
    const row = document.createElement('tr');
    const values = Array.isArray(entry) ? entry : entry.values;
    if (!Array.isArray(entry)) row.dataset.key = entry.key;
    values.forEach((value) => cell(row, String(value)));
    body.appendChild(row);
  }
}

// ---- usage ----------------------------------------------------------------------------------------
function usageCells(figures) {
  const cost = figures.cost_usd === null ? 'not priced' : `$${figures.cost_usd.toFixed(4)}`;
  return [
    figures.tokens_trained, figures.tokens_sampled, figures.prompt_tokens_sampled,
    `${figures.compute_seconds.toFixed(1)} s`, figures.checkpoints_stored, sizeText(figures.bytes_stored), cost,
  ];
}

async function usage() {
  return api('GET', '/twinkle/v1/usage', { since: Math.floor(Date.now() / 1000) - USAGE_DAYS * 86400 });
}

async function refreshUsage() {
  const { tenants } = await usage();
  const rows = [];
  for (const tenant of tenants) {
    for (const run of tenant.runs) {
      const key = run.run_id ?? 'sampling';
      rows.push({ key, values: [run.run_id ?? 'sampling without a run', ...usageCells(run)] });
    }
    rows.push({ key: 'total', values: ['total', ...usageCells(tenant.total)] });
  }
  fill('usage', rows);
}

async function refreshTenantUsage() {
  const { tenants } = await usage();
  fill('tenant-usage', tenants.map((t) => ({ key: t.tenant, values: [t.tenant, ...usageCells(t.total)] })));
}

// ---- signing in ---------------------------------------------------------------------------------
async function signIn(key) {
  state.key = key;
  const who = await api('GET', '/dashboard/api/session');
  sessionStorage.setItem('twinkle-key', key);
  $('sign-in').hidden = true;
  $('sign-out').hidden = false;
  if (who.role === 'admin') {
    $('who').textContent = 'admin';
    $('admin-view').hidden = false;
    every(2 * POLL_MS, refreshAdmin);
    every(5 * POLL_MS, refreshTenantUsage);
  } else {
    $('who').textContent = `tenant ${who.name}`;
    $('tenant-view').hidden = false;
    every(3 * POLL_MS, refreshRuns);
    every(POLL_MS, refreshHistory);
    every(3 * POLL_MS, refreshCheckpoints);
    every(5 * POLL_MS, refreshUsage);
  }
}

function signOut() {
  sessionStorage.removeItem('twinkle-key');
  state.timers.forEach(clearInterval);
  location.reload();
}

// ---- a tenant's runs ------------------------------------------------------------------------------
async function refreshRuns() {
  const { runs } = await api('GET', '/twinkle/v1/runs', { limit: 100 });
  const list = $('runs');
  list.replaceChildren();
  for (const run of runs) {
    const item = document.createElement('li');
    item.dataset.run = run.id;
    item.textContent = run.adapter_name;
    const detail = document.createElement('small');
    detail.textContent = `${run.id} · ${run.status}`;
    item.appendChild(detail);
    item.classList.toggle('selected', run.id === state.run);
    item.addEventListener('click', () => select(run));
    list.appendChild(item);
  }
  if (state.run === null && runs.length) select(runs[0]);
}

function select(run) {
  state.run = run.id;
  state.after = 0;
  state.figures = FIGURES.slice();
  state.points = { step: [] };
  $('run-title').textContent = `${run.adapter_name} (${run.id})`;
  $('run-status').textContent = `${run.base_model} · ${run.status}`;
  document.querySelectorAll('#runs li').forEach((li) => li.classList.toggle('selected', li.dataset.run === run.id));
  drawCharts();
  refreshHistory();
  refreshCheckpoints();
}

function drawCharts() {
  const box = $('charts');
  box.replaceChildren();
  state.charts = {};
  const width = Math.max(280, Math.floor((box.clientWidth - 16) / 2) - 8);
  for (const [name, label] of state.figures) {
    state.points[name] = state.points[name] || state.points.step.map(() => null);
    const holder = document.createElement('div');
    holder.className = 'chart';
    holder.id = `chart-${name}`;
    holder.dataset.points = String(state.points.step.length);
    box.appendChild(holder);
    const options = {
      title: label,
      width,
      height: 200,
      scales: { x: { time: false } },
      axes: [{ label: 'step' }, {}],
      series: [{ label: 'step' }, { label, stroke: '#4f46e5', width: 2, points: { show: true, size: 4 } }],
    };
    state.charts[name] = new uPlot(options, [state.points.step, state.points[name]], holder);
  }
}

async function refreshHistory() {
  if (state.run === null) return;
  const run = state.run;
  const after = state.after;
  const { steps } = await api('GET', `/twinkle/v1/runs/${encodeURIComponent(run)}/history`, { after });
  if (run !== state.run || after !== state.after || !steps.length) return;  // another answer got here first
  // Figures a trainer logged itself (a reward...) get a chart of their own once they appear.
  const known = new Set(['step', 'time', ...state.figures.map(([name]) => name)]);
  const added = [...new Set(steps.flatMap((step) => Object.keys(step)))].filter((name) => !known.has(name));
  state.figures.push(...added.map((name) => [name, name.replaceAll('_', ' ')]));
  for (const step of steps) {
    state.points.step.push(step.step);
    for (const [name] of state.figures) {
      state.points[name] = state.points[name] || state.points.step.slice(0, -1).map(() => null);
      state.points[name].push(step[name] ?? null);
    }
  }
  state.after = steps[steps.length - 1].step;
  if (added.length) drawCharts();
  for (const [name] of state.figures) {
    state.charts[name].setData([state.points.step, state.points[name]]);
    $(`chart-${name}`).dataset.points = String(state.points.step.length);
  }
  $('run-status').textContent = `${state.points.step.length} steps recorded, last step ${state.after}`;
}

async function refreshCheckpoints() {
  if (state.run === null) return;
  const run = state.run;
  const { checkpoints } = await api('GET', `/twinkle/v1/runs/${encodeURIComponent(run)}/checkpoints`);
  if (run !== state.run) return;
  const body = $('checkpoints').querySelector('tbody');
  body.replaceChildren();
  for (const checkpoint of checkpoints) {
    const row = document.createElement('tr');
    row.dataset.checkpoint = `${checkpoint.kind}/${checkpoint.name}`;
    cell(row, checkpoint.name);
    cell(row, checkpoint.kind);
    cell(row, sizeText(checkpoint.size_bytes));
    cell(row, new Date(checkpoint.created_at * 1000).toLocaleString());
    cell(row, checkpoint.public ? 'yes' : 'no');
    const actions = cell(row, '');
    const path = `/dashboard/api/runs/${encodeURIComponent(run)}/checkpoints/${checkpoint.kind}/${encodeURIComponent(checkpoint.name)}`;
    button(actions, 'Download', () => showLinks(path, checkpoint.name));
    button(actions, checkpoint.public ? 'Unpublish' : 'Publish', async () => {
      await api('PUT', `${path}/public`, { public: !checkpoint.public });
      await refreshCheckpoints();
    });
    button(actions, 'Delete', async () => {
      await api('DELETE', path);
      $('links').replaceChildren();
      await refreshCheckpoints();
    });
    body.appendChild(row);
  }
}

async function showLinks(path, name) {
  const { urls } = await api('POST', `${path}/links`);
  const box = $('links');
  box.replaceChildren();
  const title = document.createElement('strong');
  title.textContent = `${name}: `;
  box.appendChild(title);
  for (const [file, url] of Object.entries(urls)) {
    const link = document.createElement('a');
    link.href = url;
    link.download = file.split('/').pop();
    link.textContent = file;
    box.appendChild(link);
  }
}

// ---- the admin view ---------------------------------------------------------------------------------

async function refreshAdmin() {
  const overview = await api('GET', '/dashboard/api/admin');
  fill('models', overview.models.map((m) => [m.name, m.queued, m.adapters_in_memory, m.released_runs, m.restarts.length]));
  fill('passes', Object.entries(overview.requests_per_pass).map(([op, p]) => [op, p.passes, p.mean.toFixed(2)]));
  fill('tenants', overview.tenants.map((t) => [t.name, t.runs, t.active_runs, t.queued]));
  const restarts = $('restarts');
  restarts.replaceChildren();
  for (const model of overview.models) {
    for (const restart of model.restarts) {
      const item = document.createElement('li');
      item.textContent = `${model.name}: ${new Date(restart.at * 1000).toLocaleString()}: ${restart.reason}`;
      restarts.appendChild(item);
    }
  }
}

// ---- start ------------------------------------------------------------------------------------------
$('sign-in-form').addEventListener('submit', async (event) => {
  event.preventDefault();
  $('sign-in-error').textContent = '';
  try { await signIn($('key').value.trim()); } catch (error) { $('sign-in-error').textContent = error.message; }
});
$('sign-out').addEventListener('click', signOut);
if (state.key) signIn(state.key).catch(() => sessionStorage.removeItem('twinkle-key'));
