// Run in the page's head, before the app mounts (llama_core.app.ui.PAGE_HEAD; ui.py puts in its storage key).
// As a tab opens, gr.BrowserState writes the saved conversations back as it read them (the same, encrypted
// anew). Written after another tab's change, that copy undid it, and no tab said so: it is not written.
// The page's script (page.js) ends this once it runs; a first visit, with nothing saved, writes as before.
(() => {
  const key = STORAGE_KEY, write = Storage.prototype.setItem;
  window.llamaCoreOpening = true;
  Storage.prototype.setItem = function (name, value) {
    if (window.llamaCoreOpening && this === localStorage && name === key && localStorage.getItem(key) !== null) {
      return;
    }
    return write.call(this, name, value);
  };
})();
