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

  function show(msg) {
    status.textContent = msg.status;
    status.className = "status status-" + msg.status;
    if (msg.message !== undefined) message.textContent = msg.message;
    if (progress && typeof msg.progress === "number") progress.value = msg.progress;
    if (!waiting.includes(msg.status)) location.reload();
  }

  function connect(delay) {
    const ws = new WebSocket(scheme + location.host + box.dataset.wsUrl);
    ws.onmessage = function (e) {
      const msg = JSON.parse(e.data);
      if (msg.type === "snapshot") show(msg.job);
      else if (msg.type === "status") show(msg);
    };
    ws.onclose = function () { setTimeout(function () { connect(Math.min(delay * 2, 10000)); }, delay); };
  }
  connect(500);
})();
