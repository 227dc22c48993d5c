// The job form (new job, re-plan): iterations or epochs, and typing one empties the other, since the site
// refuses both rather than silently pick one. It is sent once: a second submit (a double-click) is dropped and
// the submit button disabled until the next page (without JavaScript the form works as before).
"use strict";
document.querySelectorAll("form").forEach((form) => {
  const iterations = form.elements.iterations;
  const epochs = form.elements.epochs;
  if (!iterations || !epochs) return;
  iterations.addEventListener("input", () => { if (iterations.value) epochs.value = ""; });
  epochs.addEventListener("input", () => { if (epochs.value) iterations.value = ""; });
  const buttons = form.querySelectorAll("button[type=submit], input[type=submit]");
  let sent = false;
  form.addEventListener("submit", (event) => {
    if (sent) { event.preventDefault(); return; }
    sent = true;
    // after this task: a disabled submitter would be left out of what the form sends
    setTimeout(() => buttons.forEach((button) => { button.disabled = true; }));
  });
  // back to this page from the next one (the browser's page cache): the form can be sent again
  window.addEventListener("pageshow", (event) => {
    if (!event.persisted) return;
    sent = false;
    buttons.forEach((button) => { button.disabled = false; });
  });
});
