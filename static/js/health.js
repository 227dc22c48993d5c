/* The live page's chart of its devices' health (CPU, memory, GPU over the job), as the site draws it
 * (webapp/devices/health.py, job_figure): fetched from #health-chart's data-url now and every 15 s while the job
 * runs; the line under it (#health-summary) is its text alternative. Needs the global Plotly; defines no globals. */
(function () {
  'use strict';
  const div = document.getElementById('health-chart');
  if (!div) return;
  const summary = document.getElementById('health-summary');
  const EVERY_MS = 15000;

  function draw(doc) {
    if (summary) summary.textContent = doc.summary || '';
    div.setAttribute('aria-label', 'Line chart of each device\'s CPU, memory and GPU use over the job. ' + (doc.summary || ''));
    if (typeof window.Plotly === 'undefined' || !doc.figure || !doc.samples) return;
    div.hidden = false;
    const layout = Object.assign({}, doc.figure.layout, { font: { color: getComputedStyle(div).color || undefined } });
    Plotly.react(div, doc.figure.data, layout, { responsive: true, displaylogo: false });
  }

  function load() {
    fetch(div.dataset.url, { credentials: 'same-origin', headers: { Accept: 'application/json' } })
      .then((r) => (r.ok ? r.json() : null))
      .then((doc) => doc && draw(doc))
      .catch(() => {})
      .finally(() => {
        const status = document.getElementById('job-status');
        const over = status && ['completed', 'failed', 'cancelled'].indexOf(status.textContent.trim()) >= 0;
        if (!over) setTimeout(load, EVERY_MS);
      });
  }

  load();
})();
