/* Draws every <div class="plotly-figure" data-figure-id="ID"> from the figure JSON in <script type="application/json"
 * id="ID"> (Django's json_script), as made by webapp/jobs/figures.py. Needs the global Plotly; defines no globals.
 *
 * The figures have transparent backgrounds; their text takes the page's colour (static/css/site.css, light or dark as
 * the system is, followed when it changes), and a title wider than its box is drawn smaller. A div the template left
 * without a text alternative gets role="img" and its figure's title as aria-label. */
(function () {
  'use strict';

  const drawn = []; // {div, title, font}: the figures drawn, with their titles as made

  function textColour(div) {
    return getComputedStyle(div).color || undefined;
  }

  // The title's font size: its own, or smaller (down to 11 px) so that it fits `width` px on one line; Plotly cuts a
  // title wider than its figure, and draws a wrapped one over its own top.
  let ruler = null;
  function titleSize(text, size, family, width) {
    if (!text) return size;
    ruler = ruler || document.createElement('canvas').getContext('2d');
    const plain = new DOMParser().parseFromString(text, 'text/html').body.textContent || text; // &lt; as <
    let fitted = size;
    for (; fitted > 11; fitted -= 1) {
      ruler.font = fitted + 'px ' + family;
      if (ruler.measureText(plain).width <= width - 32) break;
    }
    return fitted;
  }

  function titleText(layout) {
    const title = layout.title;
    return typeof title === 'string' ? title : (title && title.text) || '';
  }

  // What figures.py made: its title's font size and family.
  function titleFont(layout) {
    const font = (layout.title && layout.title.font) || {};
    return { size: font.size || 16, family: font.family || (layout.font && layout.font.family) || 'sans-serif' };
  }

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
    const layout = fig.layout || {};
    const title = titleText(layout);
    const font = titleFont(layout);
    layout.font = Object.assign({}, layout.font, { color: textColour(div) });
    if (title) {
      if (typeof layout.title === 'string') layout.title = { text: layout.title };
      layout.title.font = Object.assign({}, layout.title.font, {
        size: titleSize(title, font.size, font.family, div.clientWidth),
      });
    }
    if (!div.hasAttribute('role')) div.setAttribute('role', 'img');
    if (!div.hasAttribute('aria-label') && title) div.setAttribute('aria-label', 'Chart: ' + title.replace(/<[^>]*>/g, ''));
    Plotly.newPlot(div, fig.data || [], layout, { responsive: true, displaylogo: false });
    drawn.push({ div: div, title: title, font: font });
  }

  // After a resize or a change of colour scheme: the titles fitted afresh, the text in the page's colour.
  function restyle() {
    drawn.forEach(function (f) {
      if (!f.div.layout) return;
      const update = { 'font.color': textColour(f.div) };
      if (f.title) update['title.font.size'] = titleSize(f.title, f.font.size, f.font.family, f.div.clientWidth);
      Plotly.relayout(f.div, update);
    });
  }

  function renderAll() {
    if (typeof window.Plotly === 'undefined') return; // the tables beside the figures still carry the numbers
    document.querySelectorAll('div.plotly-figure[data-figure-id]').forEach(renderFigure);
    let pending = null;
    window.addEventListener('resize', function () {
      clearTimeout(pending);
      pending = setTimeout(restyle, 250);
    });
    if (window.matchMedia) {
      const dark = window.matchMedia('(prefers-color-scheme: dark)');
      if (dark.addEventListener) dark.addEventListener('change', restyle);
    }
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', renderAll);
  else renderAll();
})();
