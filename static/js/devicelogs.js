/* The live page's device logs: each board's agent's lines about the job, as the site keeps them (`agent-log`
 * events, /jobs/<id>/logs/), for one device or every one; read now, when the choice changes, and every 10 s while
 * the job runs. Defines no globals. */
(function () {
  'use strict';
  const pre = document.getElementById('device-log');
  const choice = document.getElementById('device-log-choice');
  const download = document.getElementById('device-log-download');
  if (!pre || !choice) return;
  const EVERY_MS = 10000;
  let timer = null;

  function url(extra) {
    const query = new URLSearchParams(extra || {});
    if (choice.value) query.set('device', choice.value);
    const text = query.toString();
    return pre.dataset.url + (text ? '?' + text : '');
  }

  function finished() {
    const status = document.getElementById('job-status');
    return status && ['completed', 'failed', 'cancelled'].indexOf(status.textContent.trim()) >= 0;
  }

  function load() {
    clearTimeout(timer);
    if (download) download.href = url({ download: '1' });
    fetch(url(), { credentials: 'same-origin' })
      .then((r) => (r.ok ? r.text() : null))
      .then((text) => {
        if (text === null) return;
        const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
        pre.textContent = text || 'No lines yet.';
        if (atEnd) pre.scrollTop = pre.scrollHeight; // following the newest, unless the reader scrolled up
      })
      .catch(() => {})
      .finally(() => {
        if (!finished()) timer = setTimeout(load, EVERY_MS);
      });
  }

  choice.addEventListener('change', load);
  load();
})();
