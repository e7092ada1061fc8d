// The conversations' store in the browser (localStorage, written by gr.BrowserState), shared by the app's tabs.
// Run first in the page's head, before Gradio's scripts (llama_core.app.ui.PAGE_HEAD, where its storage key is put
// in; llama_core.app.page_head puts it there), so that no write, no other tab's change and no listener of Gradio's
// comes before it. The page's script (page.js) uses what it leaves in window.llamaCoreStore.
// Each tab holds the conversations as they were when it opened, and writes them all back when anything changes.
// Another tab's change (the browser then fires "storage" here) makes this tab's copy stale: it says so at once,
// offering a reload, and from then on writes nothing by itself. What it would write (a reply ending, a setting
// changed, another chat chosen) is held, and the note offers to keep it, replacing the other tab's; a change the
// user makes here asks first (page.js).
// A change is told apart by a mark: each write of the store comes after a mark under key + "-by", so the other
// tabs see the mark, then the store. An unmarked write is no change: only which chat the writing tab shows
// (each tab shows a chat of its own, and the store keeps the one last chosen, which a tab opening shows), or a
// page older than this script.
// As the app mounts, gr.BrowserState reads the store and writes it back at once (the same, encrypted anew): written
// after another tab's change, that copy undid it, and no tab said so. That write is not made.
// A write the browser refuses (its storage for the app is full) is said in a note until a write succeeds.
// The events that carry the store to the server run one at a time. Leaving while a reply streams asks first.
(() => {
  const key = STORAGE_KEY, mark = key + "-by", tab = Math.random().toString(36).slice(2);
  const write = Storage.prototype.setItem, read = Storage.prototype.getItem, stringify = JSON.stringify;
  let held = null, leaving = false, marked = false, stale = false, echo = false, writes = 0;
  // What a write of the store holds, bar the chat shown: gr.BrowserState writes it encrypted, so it is taken as
  // BrowserState turns the store into text, just before it writes. That of the last write, and of what is held.
  const isStore = (value) => value !== null && typeof value === "object" && !Array.isArray(value) &&
                             "version" in value && Array.isArray(value.conversations);
  let writing = null, written = null, heldContent = null;
  JSON.stringify = function (value, ...rest) {
    const text = stringify.call(this, value, ...rest);
    if (isStore(value)) writing = stringify.call(JSON, {...value, active: null});
    return text;
  };
  const note = () => document.getElementById("other-tab-note");
  const whenShown = (show) => {  // the head runs before the body is there
    if (document.body) show();
    else document.addEventListener("DOMContentLoaded", show, {once: true});
  };
  const banner = (id, text) => {  // a note at the top of the page
    const shown = document.createElement("div");
    shown.id = id;
    shown.setAttribute("role", "alert");
    shown.append(document.createElement("span"));
    shown.firstChild.textContent = text;
    document.body.prepend(shown);
    return shown;
  };
  const save = (value, content, change = true) => {  // the mark, then the store; a write refused for want of
    try {                                                // room is said
      if (change) write.call(localStorage, mark, tab + ":" + ++writes);
      write.call(localStorage, key, value);
      written = content;
      held = heldContent = null;  // this tab's copy is saved: nothing it held is left unsaved
      document.getElementById("storage-full-note")?.remove();
    } catch (error) {
      localStorage.removeItem(mark);  // the other tabs drop the mark: no write of the store follows it
      if (error.name === "QuotaExceededError" && !document.getElementById("storage-full-note")) {
        banner("storage-full-note", "This browser's storage for the app is full: your latest changes to the " +
          "conversations are not saved. Export the chats you want to keep, then delete old ones to make room.");
      }
      throw error;
    }
  };
  const keep = () => {  // this tab's copy replaces the other tab's
    stale = false;
    note()?.remove();
    try {
      if (held !== null) save(held, heldContent);
    } catch {}  // a store too full for it says so, and it stays held until a save succeeds
  };
  let mounted = false;
  Storage.prototype.getItem = function (name) {
    const value = read.call(this, name);
    if (this === localStorage && name === key && !mounted) {  // the first read is BrowserState's, as it mounts:
      mounted = true;                                          // its write back follows in the same task, or never
      echo = value !== null;
      setTimeout(() => { echo = false; }, 0);
    }
    return value;
  };
  Storage.prototype.setItem = function (name, value) {
    if (this !== localStorage || name !== key) return write.call(this, name, value);
    const content = writing;
    writing = null;
    if (echo) { echo = false; written = content; return; }
    const chatChosen = content !== null && content === (held !== null ? heldContent : written);
    if (!stale) return save(value, content, !chatChosen);  // another chat chosen: written, unmarked
    if (chatChosen && held === null) return;  // nothing here to keep
    held = value;  // the other tab's changes stay until the user chooses
    heldContent = content;
    const shown = note();
    if (shown && !shown.querySelector("#other-tab-keep")) {
      shown.firstChild.textContent = "Your conversations were changed in another tab of this app. What changed " +
        "here since is not saved: Reload to see the other tab's (this tab's changes are lost), or keep this " +
        "tab's (the other tab's are lost).";
      const button = document.createElement("button");
      button.id = "other-tab-keep";
      button.textContent = "Keep this tab's";
      button.onclick = keep;
      shown.append(button);
    }
  };
  localStorage.removeItem(key + "-opened");  // what earlier versions of the page wrote as a tab opened
  window.addEventListener("storage", (event) => {
    if (event.storageArea !== localStorage) return;
    if (event.key === mark) marked = event.newValue !== null;
    if (event.key !== key) return;
    const changed = marked;
    marked = false;
    if (!changed || stale) return;
    stale = true;
    whenShown(() => {
      if (!stale || note()) return;
      const shown = banner("other-tab-note", "Your conversations were changed in another tab of this app. " +
        "Reload to see them here: a change made here first would replace them.");
      const reload = document.createElement("button");
      reload.textContent = "Reload";
      reload.onclick = () => { leaving = true; setTimeout(() => { leaving = false; }, 0); location.reload(); };
      shown.append(reload);
    });
  });
  // The events that carry the conversations run one at a time, each with the latest of them. Gradio sends an
  // event's inputs as the page holds them when it fires, and runs events outside its queue side by side: two
  // quick changes (New chat, then a setting) each changed the conversations as they were before both, and the
  // one to land last undid the other. An event fired before another's conversations came back is sent once
  // they have, with them in place of its own.
  const fetchNow = window.fetch;
  let queue = Promise.resolve(), latest = null, returned = 0;
  window.fetch = function (input, init) {
    const url = String(input?.url ?? input);
    let body = null;
    try { body = url.endsWith("/gradio_api/run/predict") ? JSON.parse(init?.body) : null; } catch {}
    if (!Array.isArray(body?.data) || !body.data.some(isStore)) return fetchNow.apply(this, arguments);
    const fired = returned;
    const sent = queue.then(async () => {
      if (returned > fired) body.data = body.data.map((value) => isStore(value) ? latest : value);
      const response = await fetchNow.call(this, input, {...init, body: JSON.stringify(body)});
      try {
        const carried = ((await response.clone().json()).data ?? []).find(isStore);
        if (carried) { latest = carried; returned += 1; }
      } catch {}
      return response;
    });
    queue = sent.catch(() => {});
    return sent;
  };
  // Leaving or reloading the page while a chat reply streams, or with changes held, asks first. Gradio's own
  // listener closes the page's connection to the server as soon as the browser is about to leave: a user who
  // then chose to stay had the reply frozen, and the page reloaded. This one comes first, and while it asks,
  // Gradio's does not run (leaving closes the connection anyway).
  const replyStreaming = () => {  // Stop in Send's place: its own display, also while another tab of the page shows
    const stop = document.getElementById("chat-stop");
    return !!stop && !stop.closest(".hidden") && getComputedStyle(stop).display !== "none";
  };
  window.addEventListener("beforeunload", (event) => {  // a reply still streaming is kept when it ends
    if (replyStreaming() || (held !== null && !leaving)) {
      event.preventDefault();
      event.returnValue = "";
      event.stopImmediatePropagation();
    }
  });
  window.llamaCoreStore = {
    stale: () => stale,  // another tab changed the conversations since this one read them
    keep,
    replyStreaming,
  };
})();
