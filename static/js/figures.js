/* Draws every <div class="plotly-figure" data-figure-id="ID"> from the figure JSON in <script type="application/json"
 * id="ID"> (Django's json_script), as made by webapp/jobs/figures.py. Needs the global Plotly; defines no globals. */
(function () {
  'use strict';

  function renderFigure(div) {
    const source = document.getElementById(div.dataset.figureId);
    if (!source) {
      console.warn('figures.js: no figure data with id', div.dataset.figureId);
      return;
    }
    let fig;
    try {
      fig = JSON.parse(source.textContent);
    } catch (err) {
      console.warn('figures.js: cannot parse figure', div.dataset.figureId, err);
      return;
    }
    Plotly.newPlot(div, fig.data || [], fig.layout || {}, { responsive: true, displaylogo: false });
  }

  function renderAll() {
    if (typeof window.Plotly === 'undefined') return; // the tables beside the figures still carry the numbers
    document.querySelectorAll('div.plotly-figure[data-figure-id]').forEach(renderFigure);
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', renderAll);
  else renderAll();
})();
