// Copy buttons: <button class="copy" data-copy="ELEMENT_ID"> copies that element's text. The site is often served
// over plain http on a LAN address, where browsers give no navigator.clipboard: then the text is selected and
// copied the older way.
"use strict";
document.addEventListener("click", async (event) => {
  const button = event.target.closest("button[data-copy]");
  if (!button) return;
  const source = document.getElementById(button.dataset.copy);
  if (!source) return;
  const text = source.textContent.trim();
  let copied = false;
  try {
    if (navigator.clipboard && window.isSecureContext) {
      await navigator.clipboard.writeText(text);
      copied = true;
    }
  } catch (e) { /* fall back below */ }
  if (!copied) {
    const range = document.createRange();
    range.selectNodeContents(source);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    copied = document.execCommand("copy");
  }
  const label = button.textContent;
  button.textContent = copied ? "Copied" : "Press Ctrl-C";
  setTimeout(() => { button.textContent = label; }, 2000);
});
