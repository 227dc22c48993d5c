/* Live job page: follows /ws/jobs/<id>/ (docs/protocol.md, "Browser socket") and keeps the page current.
 *
 * Needs, in the page: #live (data-ws-url, data-devices, data-predicted, data-iterations), #throughput-chart,
 * #loss-chart, #timeline-chart, #device-states (rows <tr data-device="NAME"><td>NAME</td><td class="state">),
 * #event-log (<ol>), #job-status, #job-progress, #measured-throughput, #cancel-form, and any .when-finished
 * elements (hidden until the job ends); optional: #job-progress-bar, #job-eta, #predicted-throughput,
 * #device-count(-s), #device-actions-template (staff's Remove/Kill forms for a row) and form.add-device; #eval-chart only for a job that scores its held-out split. Charts need
 * the global Plotly (static/js/plotly.min.js); without it the tables, log and status still update. Defines no
 * globals.
 */
(function () {
  'use strict';

  const FINISHED = ['completed', 'failed', 'cancelled'];
  const FLUSH_MS = 250; // iteration points reach the charts at most 4 times a second
  const GANTT_MS = 500; // the timeline is redrawn at most twice a second
  const LOG_LIMIT = 500;
  const ROWS_SHOWN = 10; // iterations in the table beside the charts
  const RETRY_FIRST_MS = 1000;
  const RETRY_MAX_MS = 30000;
  // Close codes of a refused socket (webapp/jobs/consumers.py): retrying cannot help, so say why and stop.
  const REFUSED = {
    4401: ['logged out', 'You are not logged in any more: log in again, then reload this page.'],
    4403: ['forbidden', 'This job is not yours to watch.'],
    4404: ['not found', 'There is no such job, or it is not yours.'],
  };

  // Same look as webapp/jobs/figures.py (timeline_figure and the layout helper).
  const FONT = 'system-ui, -apple-system, "Segoe UI", Roboto, sans-serif';
  const GRID = '#e3e6eb';
  const ACCENT = '#2d5bd7';
  const STEP_GROUPS = {
    F: 'forward', B: 'backward', W: 'weight gradient', send: 'transfer', recv: 'transfer', 'all-reduce': 'all-reduce',
  };
  const STEP_COLORS = {
    forward: '#2d5bd7', backward: '#e07b39', 'weight gradient': '#b8860b', transfer: '#9aa3b2', 'all-reduce': '#1f8a4c',
  };
  const PLOT_CONFIG = { responsive: true, displaylogo: false };

  const root = document.getElementById('live');
  if (!root) return;

  const page = {
    wsUrl: root.dataset.wsUrl,
    devices: parseJson(root.dataset.devices, []),
    predicted: positive(parseFloat(root.dataset.predicted)), // 0 or missing: no prediction to draw
    total: parseInt(root.dataset.iterations, 10) || 0,
    traced: root.dataset.traced === '1', // the site holds steps of this job (its trace can be downloaded)
    evaluated: Boolean($('eval-chart')), // the job scores its held-out split (`eval` messages)
  };

  const live = {
    socket: null,
    retryMs: RETRY_FIRST_MS,
    retryTimer: null,
    leaving: false,
    finished: false,
    seen: new Set(), // iteration numbers already drawn or buffered
    points: [], // drawn points: {x, throughput, loss}, x = iteration number + 1
    pending: [], // points waiting for the next flush
    evals: [], // drawn held-out scores: {x, loss, accuracy (%), perplexity, samples}, one per iteration
    evalsPending: [],
    flushTimer: null,
    steps: [],
    ganttTimer: null,
    ganttDrawnAt: 0,
    marks: [], // membership changes on the throughput chart: {x, text, color} (a loss, a recovery, a leave, a join)
    predictions: [], // the predicted throughput of each generation's plan: {from (first iteration, 1-based), value}
    lastIteration: -1, // the newest iteration message's number: below the iterations seen, a replay is under way
    planned: {}, // the current plan's compute per device and iteration (s), from /jobs/<id>/planned.json
  };

  /* ---------- small helpers ---------- */

  function $(id) {
    return document.getElementById(id);
  }

  function parseJson(text, fallback) {
    try {
      return text ? JSON.parse(text) : fallback;
    } catch (err) {
      console.warn('live.js: cannot parse', text, err);
      return fallback;
    }
  }

  function positive(value) {
    return isNumber(value) && value > 0 ? value : NaN;
  }

  function hasPlotly() {
    return typeof window.Plotly !== 'undefined';
  }

  // Agent-supplied names (devices, step kinds, peers) go into Plotly text, which reads <a href>, <b>, <br> as
  // markup: escaped, a device named <a href=...> shows as that text (Plotly prints the entities as characters).
  function esc(value) {
    return String(value)
      .replace(/&/g, '&amp;')
      .replace(/</g, '&lt;')
      .replace(/>/g, '&gt;')
      .replace(/"/g, '&quot;');
  }

  function isNumber(value) {
    return typeof value === 'number' && isFinite(value);
  }

  // The page's text colour (light or dark, as static/css/site.css follows the system): the charts' text takes it
  // and their backgrounds are transparent, so they read in dark mode too.
  function textColour() {
    const style = root && typeof getComputedStyle === 'function' ? getComputedStyle(root) : null;
    return (style && style.color) || '#1d2330';
  }

  function baseLayout(extra) {
    return Object.assign(
      {
        template: 'none',
        autosize: true, // fill the chart box (its height comes from the CSS)
        font: { family: FONT, size: 13, color: textColour() },
        paper_bgcolor: 'rgba(0,0,0,0)',
        plot_bgcolor: 'rgba(0,0,0,0)',
        margin: { l: 70, r: 20, t: 30, b: 50 },
        legend: { orientation: 'h', x: 0, y: 1.0, xanchor: 'left', yanchor: 'bottom' },
        hoverlabel: { font: { family: FONT } },
      },
      extra
    );
  }

  function axis(title, extra) {
    return Object.assign({ title: { text: title }, gridcolor: GRID, zerolinecolor: GRID, automargin: true }, extra || {});
  }

  /* ---------- status, progress, devices, log ---------- */

  function setSocketState(state) {
    root.dataset.socket = state; // connecting | open | reconnecting | closed (handy for end-to-end tests)
  }

  function showStatus(status, message) {
    const el = $('job-status');
    if (!el) return;
    el.textContent = status;
    Array.from(el.classList)
      .filter((c) => c.indexOf('status-') === 0)
      .forEach((c) => el.classList.remove(c));
    el.classList.add('status-' + status.replace(/[^a-z-]/g, ''));
    if (message === undefined) return;
    el.title = message || '';
    const line = $('job-message'); // optional: the status message in full
    if (line) line.textContent = message || '';
  }

  function applyStatus(status, message) {
    if (!status) return;
    showStatus(status, message);
    const place = $('place-in-line'); // a job that waited in line: out of it once it starts (or ends)
    if (place && status !== 'waiting') place.hidden = true;
    if (FINISHED.indexOf(status) >= 0) markFinished(status);
  }

  function markFinished(status) {
    live.finished = true;
    const cancel = $('cancel-form');
    if (cancel) cancel.hidden = true;
    const add = document.querySelector('form.add-device');
    if (add) add.hidden = true;
    document.querySelectorAll('#device-states td.actions').forEach((cell) => (cell.textContent = ''));
    showEta(0);
    const model = $('model-link'); // only a completed run assembles a trained model
    if (model && status && status !== 'completed') model.hidden = true;
    const trace = $('trace-link'); // a run that stopped before its first step has nothing to trace
    if (trace && !live.traced) trace.hidden = true;
    const downloads = $('downloads');
    if (downloads && (!model || model.hidden) && (!trace || trace.hidden)) downloads.hidden = true;
    document.querySelectorAll('.when-finished').forEach((el) => el.removeAttribute('hidden'));
  }

  function showProgress() {
    const el = $('job-progress');
    if (!el) return;
    const done = live.seen.size;
    let text = page.total ? done + ' / ' + page.total : String(done);
    // a rollback (recovery) or a resume after a site restart trains iterations again that were done already
    if (!live.finished && live.lastIteration >= 0 && live.lastIteration + 1 < done) {
      text += ' · replaying ' + (live.lastIteration + 1) + ' of ' + done;
    }
    el.textContent = text;
    const bar = $('job-progress-bar');
    if (bar && page.total) {
      bar.max = page.total;
      bar.value = Math.min(done, page.total);
    }
  }

  // The time left, as the site estimates it (webapp/jobs/models.py, Job.eta_s: replays count as work).
  function showEta(seconds) {
    const el = $('job-eta');
    if (!el) return;
    if (live.finished || !isNumber(seconds)) {
      el.textContent = '';
      return;
    }
    el.textContent = 'about ' + (seconds < 90 ? Math.round(seconds) + ' s' : Math.round(seconds / 60) + ' min') + ' left';
  }

  function showMeasuredThroughput() {
    // The engine's own measure (engine/metrics.py), carried by each iteration: shown, never recomputed here.
    const el = $('measured-throughput');
    if (!el) return;
    const all = live.points.concat(live.pending).filter((p) => isNumber(p.measured));
    if (!all.length) {
      el.textContent = '–';
      return;
    }
    const latest = all.reduce((a, b) => (b.x > a.x ? b : a));
    el.textContent = latest.measured.toFixed(1);
    el.title = 'median iteration of the current plan so far (its first left out), samples/s: against its prediction';
  }

  /* ---------- each device's speed: its measured compute against the plan's ---------- */

  function fetchPlanned() {
    const url = page.wsUrl.replace('/ws/jobs/', '/jobs/').replace(/\/$/, '') + '/planned.json';
    fetch(url, { credentials: 'same-origin', headers: { Accept: 'application/json' } })
      .then((r) => (r.ok ? r.json() : null))
      .then((doc) => {
        if (!doc || !doc.planned_s) return;
        live.planned = doc.planned_s;
        showSpeeds();
      })
      .catch(() => {});
  }

  // A device's forward and backward time in the newest iteration it finished (the one before the newest seen,
  // or the newest once the job ended), against its planned time: 100 % is as planned, 25 % four times slower.
  function showSpeeds() {
    const busy = {};
    let newest = -Infinity;
    live.steps.forEach((s) => {
      if (isNumber(s.iteration) && s.iteration > newest) newest = s.iteration;
    });
    const iteration = live.finished ? newest : newest - 1;
    live.steps.forEach((s) => {
      if (s.iteration !== iteration || !['F', 'B', 'W'].includes(s.kind) || !isNumber(s.end - s.start)) return;
      busy[s.device] = (busy[s.device] || 0) + (s.end - s.start);
    });
    const body = $('device-states');
    if (body) {
      body.querySelectorAll('tr[data-device]').forEach((tr) => {
        const cell = tr.querySelector('td.speed'); // a device out of the current plan (lost, left) has none
        if (cell && !(tr.dataset.device in live.planned)) {
          cell.textContent = '–';
          cell.classList.remove('slow');
        }
      });
    }
    Object.keys(live.planned).forEach((name) => {
      const row = deviceRow(name);
      const cell = row && row.querySelector('td.speed');
      const planned = live.planned[name];
      if (!cell || !(busy[name] > 0) || !(planned > 0)) return;
      const ratio = planned / busy[name];
      cell.textContent = Math.round(ratio * 100) + ' %';
      cell.title = 'iteration ' + (iteration + 1) + ': computed ' + busy[name].toFixed(3) + ' s against '
        + planned.toFixed(3) + ' s planned';
      cell.classList.toggle('slow', ratio < 0.67);
    });
  }

  function deviceRow(name) {
    const body = $('device-states');
    if (!body) return null;
    const found = Array.from(body.querySelectorAll('tr[data-device]')).find((tr) => tr.dataset.device === name);
    if (found) return found;
    const tr = document.createElement('tr'); // a device the page did not list (e.g. after a re-plan)
    tr.dataset.device = name;
    const nameCell = document.createElement('td');
    nameCell.textContent = name;
    const stateCell = document.createElement('td');
    stateCell.className = 'state';
    const speedCell = document.createElement('td');
    speedCell.className = 'speed num';
    speedCell.textContent = '–';
    tr.append(nameCell, stateCell, speedCell);
    body.appendChild(tr);
    return tr;
  }

  function setDeviceState(name, state) {
    const row = deviceRow(name);
    const cell = row && row.querySelector('.state');
    if (!cell) return;
    cell.textContent = state;
    Array.from(cell.classList)
      .filter((c) => c.indexOf('state-') === 0)
      .forEach((c) => cell.classList.remove(c));
    cell.classList.add('state-' + String(state).replace(/[^a-z-]/g, ''));
  }

  function formatTime(iso) {
    const when = new Date(iso);
    return isNaN(when.getTime()) ? '' : when.toLocaleTimeString();
  }

  function logEntry(entry) {
    const li = document.createElement('li');
    li.className = 'log-' + String(entry.level || 'info').replace(/[^a-z]/g, '');
    const time = document.createElement('time');
    if (entry.time) time.dateTime = entry.time;
    time.textContent = formatTime(entry.time);
    li.append(time, ' ', String(entry.message || ''));
    return li;
  }

  function appendLog(entries) {
    const list = $('event-log');
    if (!list) return;
    const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 8;
    const fragment = document.createDocumentFragment();
    entries.forEach((entry) => fragment.appendChild(logEntry(entry)));
    list.appendChild(fragment);
    while (list.children.length > LOG_LIMIT) list.removeChild(list.firstElementChild);
    if (atBottom) list.scrollTop = list.scrollHeight;
  }

  /* ---------- throughput and loss charts ---------- */

  function toPoint(msg) {
    return {
      iteration: msg.iteration,
      x: msg.iteration + 1,
      throughput: isNumber(msg.throughput) ? msg.throughput : null,
      loss: isNumber(msg.loss) ? msg.loss : null,
      measured: isNumber(msg.measured_throughput) ? msg.measured_throughput : null,
    };
  }

  function toEvalPoint(msg) {
    const number = (v) => (isNumber(v) ? v : null);
    return {
      x: msg.iteration + 1,
      loss: number(msg.loss),
      accuracy: isNumber(msg.accuracy) ? msg.accuracy * 100 : null,
      perplexity: number(msg.perplexity),
      samples: number(msg.samples),
    };
  }

  // Classification jobs are scored by accuracy, language models by perplexity (their held-out loss is on the
  // loss chart either way).
  function evalMetric() {
    return live.evals.some((p) => p.accuracy !== null) ? 'accuracy' : 'perplexity';
  }

  function evalText(p) {
    if (!p) return '';
    if (p.accuracy !== null) return p.accuracy.toFixed(1) + ' %';
    if (p.perplexity !== null) return 'perplexity ' + p.perplexity.toFixed(2);
    return p.loss !== null ? 'loss ' + p.loss.toFixed(4) : '–';
  }

  // Scores in order of iteration, the later of two for the same iteration (a replayed iteration is scored again).
  function mergeEvals(points, fresh) {
    const byX = new Map(points.map((p) => [p.x, p]));
    fresh.forEach((p) => byX.set(p.x, p));
    return Array.from(byX.values()).sort((a, b) => a.x - b.x);
  }

  // A step line: each generation's prediction from its first iteration on (a re-plan moves it).
  function predictedLine(lastX) {
    const end = Math.max(page.total, lastX || 0, 1);
    const steps = live.predictions.length ? live.predictions : isNumber(page.predicted) ? [{ from: 1, value: page.predicted }] : [];
    const x = [];
    const y = [];
    steps.forEach((p, i) => {
      const until = i + 1 < steps.length ? steps[i + 1].from : end;
      x.push(p.from, until);
      y.push(p.value, p.value);
    });
    return {
      x: x,
      y: y,
      type: 'scatter',
      mode: 'lines',
      name: 'predicted',
      line: { color: '#5b6475', dash: 'dash', width: 2 },
      hovertemplate: 'predicted %{y:.1f} samples/s<extra></extra>',
    };
  }

  function drawLineCharts() {
    if (!hasPlotly()) return;
    const pts = live.points;
    const xs = pts.map((p) => p.x);
    const throughputDiv = $('throughput-chart');
    if (throughputDiv) {
      const measured = {
        x: xs,
        y: pts.map((p) => p.throughput),
        type: 'scatter',
        mode: 'lines+markers',
        name: 'measured',
        line: { color: ACCENT, width: 2 },
        marker: { size: 5 },
        hovertemplate: 'iteration %{x}: %{y:.1f} samples/s<extra></extra>',
      };
      const layout = baseLayout({
        xaxis: axis('iteration', { rangemode: 'tozero' }),
        yaxis: axis('throughput (samples/s)', { rangemode: 'tozero' }),
        shapes: live.marks.map((m) => ({
          type: 'line', xref: 'x', yref: 'paper', x0: m.x, x1: m.x, y0: 0, y1: 1,
          line: { color: m.color, width: 2, dash: 'dot' },
        })),
        annotations: live.marks.map((m, i) => ({
          x: m.x, xref: 'x', y: i % 2 ? 0.9 : 1, yref: 'paper', text: esc(m.text), showarrow: false,
          xanchor: 'left', font: { size: 11, color: m.color }, bgcolor: 'rgba(255,255,255,0.8)',
        })),
      });
      Plotly.react(throughputDiv, [measured, predictedLine(xs[xs.length - 1])], layout, PLOT_CONFIG);
    }
    const lossDiv = $('loss-chart');
    if (lossDiv) {
      const loss = {
        x: xs,
        y: pts.map((p) => p.loss),
        type: 'scatter',
        mode: 'lines+markers',
        name: 'training',
        line: { color: '#e07b39', width: 2 },
        marker: { size: 5 },
        hovertemplate: 'iteration %{x}: loss %{y:.4f}<extra></extra>',
      };
      const heldOut = {
        x: live.evals.map((p) => p.x),
        y: live.evals.map((p) => p.loss),
        type: 'scatter',
        mode: 'lines+markers',
        name: 'held-out',
        line: { color: '#1f8a4c', width: 2, dash: 'dot' },
        marker: { size: 7, symbol: 'diamond' },
        hovertemplate: 'after iteration %{x}: held-out loss %{y:.4f}<extra></extra>',
      };
      const layout = baseLayout({
        showlegend: page.evaluated,
        xaxis: axis('iteration', { rangemode: 'tozero' }),
        yaxis: axis('loss'),
      });
      Plotly.react(lossDiv, [loss, heldOut], layout, PLOT_CONFIG);
    }
    drawEvalChart();
  }

  function drawEvalChart() {
    const div = $('eval-chart');
    if (!div || !hasPlotly()) return;
    const accuracy = evalMetric() === 'accuracy';
    const trace = {
      x: live.evals.map((p) => p.x),
      y: live.evals.map((p) => (accuracy ? p.accuracy : p.perplexity)),
      customdata: live.evals.map((p) => p.samples),
      type: 'scatter',
      mode: 'lines+markers',
      name: accuracy ? 'accuracy' : 'perplexity',
      line: { color: '#1f8a4c', width: 2 },
      marker: { size: 7, symbol: 'diamond' },
      hovertemplate: 'after iteration %{x}: ' + (accuracy ? '%{y:.1f} % right' : 'perplexity %{y:.2f}') +
        ' (%{customdata} samples)<extra></extra>',
    };
    const layout = baseLayout({
      showlegend: false,
      xaxis: axis('iteration', { rangemode: 'tozero', range: [0, Math.max(page.total, 1)] }),
      yaxis: !live.evals.length ? axis('held-out score')
        : accuracy ? axis('held-out accuracy (%)', { range: [0, 100] }) : axis('held-out perplexity'),
      annotations: live.evals.length
        ? []
        : [{ text: 'not scored yet', xref: 'paper', yref: 'paper', x: 0.5, y: 0.5, showarrow: false,
             font: { color: '#5b6475', size: 14 } }],
    });
    Plotly.react(div, [trace], layout, PLOT_CONFIG);
  }

  // The same numbers as a table, for reading without the charts: the latest iterations first.
  function showIterationRows() {
    const body = $('iteration-rows');
    if (!body) return;
    body.textContent = '';
    const scores = new Map(live.evals.map((e) => [e.x, e]));
    live.points.slice(-ROWS_SHOWN).reverse().forEach((p) => {
      const row = document.createElement('tr');
      const cells = [String(p.x), isNumber(p.throughput) ? p.throughput.toFixed(1) : '–',
        isNumber(p.loss) ? p.loss.toFixed(4) : '–'];
      if (page.evaluated) cells.push(evalText(scores.get(p.x)));
      cells.forEach((text, i) => {
        const cell = document.createElement('td');
        cell.textContent = text;
        if (i) cell.className = 'num';
        row.appendChild(cell);
      });
      body.appendChild(row);
    });
  }

  function queueIteration(msg) {
    if (!msg || !isNumber(msg.iteration)) return;
    live.lastIteration = msg.iteration;
    if (live.seen.has(msg.iteration)) {
      showProgress(); // a replayed iteration: the count stays, the replay shows
      return;
    }
    live.seen.add(msg.iteration);
    live.pending.push(toPoint(msg));
    scheduleFlush();
  }

  function queueEval(msg) {
    if (!msg || !isNumber(msg.iteration)) return;
    live.evalsPending.push(toEvalPoint(msg));
    scheduleFlush();
  }

  function scheduleFlush() {
    if (live.flushTimer === null) live.flushTimer = setTimeout(flush, FLUSH_MS);
  }

  function flush() {
    live.flushTimer = null;
    flushIterations();
    flushEvals();
  }

  function flushIterations() {
    if (!live.pending.length) return;
    const fresh = live.pending.sort((a, b) => a.x - b.x);
    live.pending = [];
    const lastX = live.points.length ? live.points[live.points.length - 1].x : -Infinity;
    const inOrder = fresh[0].x > lastX;
    live.points = live.points.concat(fresh);
    if (!inOrder) live.points.sort((a, b) => a.x - b.x);
    showIterationRows();
    showProgress();
    showMeasuredThroughput();
    if (!hasPlotly()) return;
    const throughputDiv = $('throughput-chart');
    const lossDiv = $('loss-chart');
    const drawn = (div) => div && div.data; // Plotly has drawn into it
    if (!inOrder || !drawn(throughputDiv) || !drawn(lossDiv)) {
      drawLineCharts(); // a point went back in time (or no chart yet): redraw from scratch
      return;
    }
    const xs = fresh.map((p) => p.x);
    Plotly.extendTraces(throughputDiv, { x: [xs], y: [fresh.map((p) => p.throughput)] }, [0]);
    Plotly.extendTraces(lossDiv, { x: [xs], y: [fresh.map((p) => p.loss)] }, [0]);
    const newLast = xs[xs.length - 1];
    if (isNumber(page.predicted) && newLast > Math.max(page.total, 1)) {
      Plotly.restyle(throughputDiv, { x: [[1, newLast]] }, [1]);
    }
  }

  function flushEvals() {
    if (!live.evalsPending.length) return;
    const fresh = live.evalsPending.sort((a, b) => a.x - b.x);
    live.evalsPending = [];
    const before = live.evals;
    live.evals = mergeEvals(before, fresh);
    showIterationRows();
    if (!hasPlotly()) return;
    const lossDiv = $('loss-chart');
    const evalDiv = $('eval-chart');
    // Only new iterations after the last drawn one, on charts already drawn with a score, can be appended.
    const appended = before.length > 0 && fresh[0].x > before[before.length - 1].x &&
      live.evals.length === before.length + fresh.length;
    if (!appended || !(lossDiv && lossDiv.data) || !(evalDiv && evalDiv.data)) {
      drawLineCharts();
      return;
    }
    const xs = fresh.map((p) => p.x);
    const accuracy = evalMetric() === 'accuracy';
    Plotly.extendTraces(lossDiv, { x: [xs], y: [fresh.map((p) => p.loss)] }, [1]);
    Plotly.extendTraces(evalDiv, {
      x: [xs],
      y: [fresh.map((p) => (accuracy ? p.accuracy : p.perplexity))],
      customdata: [fresh.map((p) => p.samples)],
    }, [0]);
  }

  /* ---------- step timeline ---------- */

  function keepLatestSteps(steps) {
    let latest = -Infinity;
    steps.forEach((s) => {
      if (isNumber(s.iteration) && s.iteration > latest) latest = s.iteration;
    });
    return steps.filter((s) => !isNumber(s.iteration) || s.iteration >= latest - 1);
  }

  function stepHover(s) {
    const what = { F: 'forward', B: 'backward', W: 'weight gradient', send: 'send', recv: 'receive' }[s.kind] || esc(s.kind);
    let head = esc(s.device) + ' · ' + what;
    if (s.micro_batch >= 0) head += ' micro-batch ' + esc(s.micro_batch);
    if (s.peer) head += (s.kind === 'send' ? ' to ' : ' from ') + esc(s.peer);
    const ms = (t) => (t * 1000).toFixed(2);
    return (
      head + '<br>stage ' + esc(s.stage) + ', iteration ' + esc(s.iteration) + '<br>' +
      ms(s.start) + ' – ' + ms(s.end) + ' ms (' + ms(s.end - s.start) + ' ms)'
    );
  }

  function ganttTraces(steps) {
    return Object.keys(STEP_COLORS).map((group) => {
      const chosen = steps.filter((s) => (STEP_GROUPS[s.kind] || 'transfer') === group);
      return {
        type: 'bar',
        orientation: 'h',
        name: group,
        y: chosen.map((s) => esc(s.device)), // category names are printed as tick labels
        x: chosen.map((s) => s.end - s.start),
        base: chosen.map((s) => s.start),
        marker: { color: STEP_COLORS[group], line: { color: '#ffffff', width: 0.5 } },
        text: chosen.map((s) => (['F', 'B', 'W'].includes(s.kind) ? esc(s.micro_batch) : '')),
        textposition: 'inside',
        insidetextanchor: 'middle',
        textfont: { color: '#ffffff' },
        hovertext: chosen.map(stepHover),
        hoverinfo: 'text',
        showlegend: chosen.length > 0,
        // a device's link sends while it computes: transfers are a thin strip at the row's edge
        ...(group === 'transfer' ? { width: 0.2, offset: 0.15 } : {}),
      };
    });
  }

  function drawGantt() {
    live.ganttTimer = null;
    live.ganttDrawnAt = Date.now();
    showSpeeds();
    const div = $('timeline-chart');
    if (!div || !hasPlotly()) return;
    const steps = live.steps;
    const order = page.devices.slice();
    steps.forEach((s) => {
      if (order.indexOf(s.device) < 0) order.push(s.device);
    });
    const layout = baseLayout({
      barmode: 'overlay',
      bargap: 0.3,
      uniformtext: { minsize: 8, mode: 'hide' },
      xaxis: axis('device time since the run started (s)'),
      yaxis: axis('', {
        categoryorder: 'array',
        categoryarray: order.map(esc), // the same escaped names as the bars' y
        autorange: 'reversed',
        showgrid: false,
      }),
      annotations: steps.length
        ? []
        : [{ text: 'no steps yet', xref: 'paper', yref: 'paper', x: 0.5, y: 0.5, showarrow: false,
             font: { color: '#5b6475', size: 14 } }],
    });
    Plotly.react(div, ganttTraces(steps), layout, PLOT_CONFIG);
  }

  function scheduleGantt() {
    if (live.ganttTimer !== null) return;
    const wait = Math.max(0, GANTT_MS - (Date.now() - live.ganttDrawnAt));
    live.ganttTimer = setTimeout(drawGantt, wait);
  }

  /* ---------- messages ---------- */

  function cancelTimers() {
    if (live.flushTimer !== null) clearTimeout(live.flushTimer);
    if (live.ganttTimer !== null) clearTimeout(live.ganttTimer);
    live.flushTimer = null;
    live.ganttTimer = null;
  }

  function onSnapshot(msg) {
    cancelTimers();
    live.retryMs = RETRY_FIRST_MS; // this connection works
    const job = msg.job || {};
    if (!page.total && isNumber(job.iterations)) page.total = job.iterations;
    if (!isNumber(page.predicted) && job.plan && job.plan.predicted) {
      const p = job.plan.predicted; // the simulated iteration when the plan has one (engine.plan.Prediction)
      page.predicted = isNumber(p.simulated_s) && p.simulated_s > 0 ? job.plan.batch_size / p.simulated_s : positive(p.throughput);
    }
    live.seen = new Set();
    live.points = [];
    live.pending = [];
    showEta(job.eta_s);
    live.predictions = (job.generations || [])
      .filter((g) => isNumber(g.predicted_throughput) && g.predicted_throughput > 0)
      .map((g) => ({ from: (g.start || 0) + 1, value: g.predicted_throughput }));
    (msg.iterations || []).forEach((it) => {
      if (!isNumber(it.iteration) || live.seen.has(it.iteration)) return;
      live.seen.add(it.iteration);
      live.points.push(toPoint(it));
    });
    live.points.sort((a, b) => a.x - b.x);
    const newest = (msg.iterations || []).filter((it) => isNumber(it.iteration));
    live.lastIteration = newest.length ? newest[newest.length - 1].iteration : -1;
    live.evalsPending = [];
    live.evals = mergeEvals([], (job.eval || []).filter((e) => isNumber(e.iteration)).map(toEvalPoint));
    drawLineCharts();
    showIterationRows();
    showProgress();
    showMeasuredThroughput();

    live.steps = keepLatestSteps(msg.steps || []);
    live.traced = live.traced || live.steps.length > 0 || page.traced;
    drawGantt();

    const states = msg.devices || {};
    Object.keys(states).forEach((name) => setDeviceState(name, states[name]));
    live.marks = [];
    (msg.membership || []).forEach((ev) => addMark(ev));
    drawLineCharts();

    const list = $('event-log');
    if (list) list.textContent = '';
    appendLog(msg.log || []);

    live.finished = false;
    applyStatus(job.status, job.message);
    refreshIdleDevices();
  }

  function onIteration(msg) {
    queueIteration(msg);
  }

  function onEval(msg) {
    queueEval(msg);
  }

  function onSteps(msg) {
    if (!Array.isArray(msg.steps) || !msg.steps.length) return;
    live.traced = true;
    live.steps = keepLatestSteps(live.steps.concat(msg.steps));
    scheduleGantt();
  }

  function onDevice(msg) {
    if (msg.device) setDeviceState(msg.device, msg.state);
  }

  // The coordinator's events: a mark on the throughput chart (the dip and the recovery); the log has their lines.
  // An event the site says the throughput chart marks carries `mark` ({x, text, tone}: the event catalogue's).
  const TONES = { bad: '#c0392b', good: '#1f8a4c', warn: '#b7791f', info: '#2d5bd7' };

  function addMark(msg) {
    const mark = msg.mark;
    if (!mark || !isNumber(mark.x)) return;
    live.marks.push({ x: mark.x, text: String(mark.text || msg.type), color: TONES[mark.tone] || TONES.info });
  }

  function onMembership(msg) {
    addMark(msg);
    if (msg.type === 'device-lost') setDeviceState(msg.device, 'lost');
    if (['device-lost', 'device-left', 'device-standby'].indexOf(msg.type) >= 0) setActions(msg.device, false);
    drawLineCharts();
    refreshIdleDevices();
  }

  // A new generation: its devices (the header, each row's actions), its prediction, its timeline.
  function onReplan(msg) {
    live.steps = []; // the timeline shows the new plan's steps from its first iteration on
    drawGantt();
    fetchPlanned(); // the speed column measures against the new plan
    const plan = msg.plan || {};
    const names = [];
    (plan.stages || []).forEach((st) => (st.devices || []).forEach((d) => names.indexOf(d.name) < 0 && names.push(d.name)));
    if (names.length) {
      const count = $('device-count');
      if (count) count.textContent = String(names.length);
      const plural = $('device-count-s');
      if (plural) plural.textContent = names.length === 1 ? '' : 's';
      const body = $('device-states');
      if (body) body.querySelectorAll('tr[data-device]').forEach((tr) => setActions(tr.dataset.device, names.indexOf(tr.dataset.device) >= 0));
      names.forEach((name) => setActions(name, true));
    }
    if (isNumber(msg.predicted_throughput) && msg.predicted_throughput > 0) {
      if (!live.predictions.length && isNumber(page.predicted)) live.predictions.push({ from: 1, value: page.predicted });
      live.predictions.push({ from: (msg.start || 0) + 1, value: msg.predicted_throughput });
      const shown = $('predicted-throughput');
      if (shown) shown.textContent = msg.predicted_throughput.toFixed(1);
    }
    drawLineCharts();
    refreshIdleDevices();
  }

  // Staff's Remove/Kill buttons on a device's row: only while it trains in the job.
  function setActions(name, active) {
    const template = $('device-actions-template');
    const row = deviceRow(name);
    if (!template || !row) return;
    let cell = row.querySelector('td.actions');
    if (!cell) {
      cell = document.createElement('td');
      cell.className = 'actions';
      row.appendChild(cell);
    }
    if (!active || live.finished) {
      cell.textContent = '';
      return;
    }
    if (cell.querySelector('form')) return;
    cell.appendChild(template.content.cloneNode(true));
    cell.querySelectorAll('input[name=device]').forEach((input) => (input.value = name));
    cell.querySelectorAll('button[data-device]').forEach((button) => (button.dataset.device = name));
  }

  // The Add list: devices online and in no job, as the devices API says now (staff only).
  function refreshIdleDevices() {
    const form = document.querySelector('form.add-device');
    if (!form || live.finished) return;
    fetch('/api/devices/', { credentials: 'same-origin', headers: { Accept: 'application/json' } })
      .then((r) => (r.ok ? r.json() : null))
      .then((doc) => {
        if (!doc || !Array.isArray(doc.devices)) return;
        const idle = doc.devices.filter((d) => d.status === 'online' && !d.job).map((d) => d.name);
        const select = form.elements.device;
        const button = form.querySelector('button');
        select.textContent = '';
        idle.forEach((name) => select.appendChild(new Option(name, name)));
        if (!idle.length) {
          const none = new Option('no idle device', '');
          none.disabled = true;
          none.selected = true;
          select.appendChild(none);
        }
        if (button) button.disabled = !idle.length;
      })
      .catch(() => {});
  }

  function onLog(msg) {
    appendLog([msg]);
  }

  function onProgress(msg) {
    showEta(msg.eta_s);
  }

  function onStatus(msg) {
    applyStatus(msg.status, msg.message);
  }

  const HANDLERS = {
    snapshot: onSnapshot,
    iteration: onIteration,
    eval: onEval,
    steps: onSteps,
    device: onDevice,
    log: onLog,
    status: onStatus,
    progress: onProgress,
    'device-lost': onMembership,
    recovered: onMembership,
    'device-left': onMembership,
    'device-joined': onMembership,
    'device-standby': onMembership,
    replan: onReplan,
  };

  function dispatch(msg) {
    if (msg && msg.type === 'batch' && Array.isArray(msg.messages)) {
      msg.messages.forEach(dispatch); // what one agent message brought, relayed as one
      return;
    }
    const handler = msg && HANDLERS[msg.type];
    if (handler) handler(msg);
    else if (msg && msg.mark) onMembership(msg); // a kind this page has no handler for: its mark, if any
  }

  function handleMessage(event) {
    dispatch(parseJson(event.data, null));
  }

  /* ---------- socket ---------- */

  function socketUrl() {
    return (location.protocol === 'https:' ? 'wss://' : 'ws://') + location.host + page.wsUrl;
  }

  function connect() {
    live.retryTimer = null;
    setSocketState('connecting');
    let socket;
    try {
      socket = new WebSocket(socketUrl());
    } catch (err) {
      console.warn('live.js: cannot open socket', err);
      scheduleReconnect();
      return;
    }
    live.socket = socket;
    socket.addEventListener('open', () => setSocketState('open'));
    socket.addEventListener('message', handleMessage);
    socket.addEventListener('close', (event) => onSocketClose(socket, event));
  }

  function onSocketClose(socket, event) {
    if (live.socket !== socket) return;
    live.socket = null;
    if (live.leaving) return;
    const refused = REFUSED[event.code];
    if (refused) {
      setSocketState('closed');
      showStatus(refused[0], refused[1]);
      return;
    }
    if (live.finished) {
      setSocketState('closed'); // nothing more will happen to a finished job
      return;
    }
    scheduleReconnect();
  }

  function scheduleReconnect() {
    setSocketState('reconnecting');
    showStatus('reconnecting…');
    const wait = live.retryMs + Math.floor(Math.random() * 250);
    live.retryMs = Math.min(live.retryMs * 2, RETRY_MAX_MS);
    live.retryTimer = setTimeout(connect, wait);
  }

  function leave() {
    live.leaving = true;
    if (live.retryTimer !== null) clearTimeout(live.retryTimer);
    if (live.socket) live.socket.close(1000);
  }

  /* ---------- staff's device actions (remove, add, kill), without leaving the page ---------- */

  // A form.device-action posts to the JSON API instead (the page keeps its charts), once its data-confirm
  // question is answered. Without this script the form posts to the page's own view.
  function onDeviceAction(event) {
    const form = event.target.closest('form.device-action');
    if (!form || event.defaultPrevented) return;
    event.preventDefault();
    const device = form.elements.device ? form.elements.device.value : '';
    if (form.dataset.confirm && !window.confirm(form.dataset.confirm.replace('{device}', device))) return;
    const token = form.elements.csrfmiddlewaretoken ? form.elements.csrfmiddlewaretoken.value : '';
    const url = page.wsUrl.replace('/ws/jobs/', '/api/jobs/') + form.dataset.action + '/';
    const say = (text) => {
      const el = $('action-message');
      if (el) el.textContent = text;
    };
    fetch(url, {
      method: 'POST',
      credentials: 'same-origin',
      headers: { 'Content-Type': 'application/json', 'X-CSRFToken': token },
      body: JSON.stringify({ device: device }),
    })
      .then((r) => r.json().then((body) => [r.ok, body]))
      .then(([ok, body]) => say(ok ? device + ': ' + form.dataset.action + ' asked; the event log follows it'
        : 'Not done: ' + (body.error || 'the site refused')))
      .catch(() => say('Not done: the site did not answer'));
  }

  function start() {
    window.addEventListener('submit', onDeviceAction); // submit bubbles up to the window
    if (!page.wsUrl) {
      console.warn('live.js: #live has no data-ws-url');
      return;
    }
    // (no showProgress here: the page came with the site's count, which the socket's snapshot replaces)
    drawLineCharts();
    drawGantt();
    fetchPlanned();
    window.addEventListener('pagehide', leave);
    window.addEventListener('pageshow', (event) => {
      if (event.persisted && live.leaving) {
        live.leaving = false; // back from the back/forward cache: follow the job again
        live.retryMs = RETRY_FIRST_MS;
        connect();
      }
    });
    connect();
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
})();
