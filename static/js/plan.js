// Plan page: follow the planning task over the job's socket; reload when the plan (or the reason) is ready.
(function () {
  "use strict";
  const box = document.getElementById("plan-status");
  if (!box) return;
  const waiting = ["queued", "planning"];
  if (!waiting.includes(box.dataset.status)) return;
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  const status = document.getElementById("job-status");
  const message = document.getElementById("job-message");
  const progress = document.getElementById("plan-progress");
  // Close codes of a refused socket (webapp/jobs/consumers.py): retrying cannot help, so say why and stop.
  const REFUSED = {
    4401: "You are not logged in any more: log in again, then reload this page.",
    4403: "This job is not yours to watch.",
    4404: "There is no such job, or it is not yours.",
  };

  function show(msg) {
    status.textContent = msg.status;
    status.className = "status status-" + String(msg.status).replace(/[^a-z-]/g, "");
    if (msg.message !== undefined) message.textContent = msg.message;
    if (progress && typeof msg.progress === "number") progress.value = msg.progress;
    if (!waiting.includes(msg.status)) location.reload();
  }

  function connect(delay) {
    const ws = new WebSocket(scheme + location.host + box.dataset.wsUrl);
    ws.onmessage = function (e) {
      let msg;
      try {
        msg = JSON.parse(e.data);
      } catch (err) {
        return; // not ours to show
      }
      (msg.type === "batch" && Array.isArray(msg.messages) ? msg.messages : [msg]).forEach(function (m) {
        if (m.type === "snapshot") show(m.job);
        else if (m.type === "status") show(m);
      });
    };
    ws.onclose = function (e) {
      if (REFUSED[e.code]) {
        status.textContent = "unavailable";
        message.textContent = REFUSED[e.code];
        return;
      }
      setTimeout(function () { connect(Math.min(delay * 2, 10000)); }, delay);
    };
  }
  connect(500);
})();
