// The job form (new job, re-plan): iterations or epochs, and typing one empties the other, since the site
// refuses both rather than silently pick one.
"use strict";
document.querySelectorAll("form").forEach((form) => {
  const iterations = form.elements.iterations;
  const epochs = form.elements.epochs;
  if (!iterations || !epochs) return;
  iterations.addEventListener("input", () => { if (iterations.value) epochs.value = ""; });
  epochs.addEventListener("input", () => { if (epochs.value) iterations.value = ""; });
});
