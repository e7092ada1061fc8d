// The conversations' store in the browser (localStorage, written by gr.BrowserState), shared by the app's tabs.
// Run first in the page's head, before Gradio's scripts (llama_core.app.ui.PAGE_HEAD, where its storage key is put
// in; llama_core.app.page_head puts it there), so that no write, no other tab's change and no listener of Gradio's
// comes before it. The page's script (page.js) uses what it leaves in window.llamaCoreStore.
// Each tab holds the conversations, and writes them all back when anything changes. It then sends them to the
// app's other tabs (a BroadcastChannel), and each merges them into its own at once (the hidden #chat-sync event,
// conversations.merged on the server: each conversation as it was changed last, in either tab), so that every
// tab shows every tab's changes, and the next write holds them all.
// A change is told apart by a mark: each write of the store comes after a mark under key + "-by", so the other
// tabs see the mark, then the store. An unmarked write is no change: only which chat the writing tab shows
// (each tab shows a chat of its own, and the store keeps the one last chosen, which a tab opening shows), or a
// page older than this script.
// A change that comes with no conversations sent (a page without BroadcastChannel) makes this tab's copy stale:
// it says so, offering a reload, and from then on writes nothing by itself. What it would write (a reply ending,
// a setting changed) is held, and the note offers to keep it, replacing the other tab's; a change the user makes
// here asks first (page.js).
// As the app mounts, gr.BrowserState reads the store and writes it back at once (the same, encrypted anew): written
// after another tab's change, that copy undid it, and no tab said so. That write is not made.
// The chat a tab shows is kept in its sessionStorage too, as it writes the store: a reload of that tab opens it
// again (ui.py's SHOWN_HERE), rather than the one chosen last in any tab.
// A write the browser refuses (its storage for the app is full) is said in a note until a write succeeds.
// The events that carry the store to the server run one at a time. Leaving while a reply streams asks first.
(() => {
  const key = STORAGE_KEY, mark = key + "-by", shownHere = key + "-shown", tab = Math.random().toString(36).slice(2);
  const write = Storage.prototype.setItem, read = Storage.prototype.getItem, stringify = JSON.stringify;
  let leaving = false, marked = null, stale = false, echo = false, writes = 0;
  // A write of the store as text, and what it holds bar the chat shown (its content): gr.BrowserState writes it
  // encrypted, so both are taken as BrowserState turns the store into text, just before it writes. The content
  // the browser holds (this tab's last write, or the last one another tab sent), and what is held.
  const isStore = (value) => value !== null && typeof value === "object" && !Array.isArray(value) &&
                             "version" in value && Array.isArray(value.conversations);
  let writing = null, written = null, held = null;  // {text, content, active}; held also {value}: encrypted
  JSON.stringify = function (value, ...rest) {
    const text = stringify.call(this, value, ...rest);
    if (isStore(value)) writing = {text, content: stringify.call(JSON, {...value, active: null}), active: value.active};
    return text;
  };
  const channel = typeof BroadcastChannel === "function" ? new BroadcastChannel(key) : null;
  const sent = new Set();  // the marks of the changes other tabs sent here
  let incoming = null, taken = null;  // the last conversations another tab sent, not yet merged here; being merged
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
  const save = (value, store, change = true) => {  // the mark, the store, then the store sent to the other tabs;
    const by = tab + ":" + ++writes;               // a write refused for want of room is said
    try {
      if (change) write.call(localStorage, mark, by);
      write.call(localStorage, key, value);
      written = store;
      held = null;  // this tab's copy is saved: nothing it held is left unsaved
      if (change) channel?.postMessage({by, ...store});
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
      if (held !== null) save(held.value, {text: held.text, content: held.content});
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
    const store = writing;
    writing = null;
    if (echo) { echo = false; written = store; return; }
    if (typeof store?.active === "string") {
      try { sessionStorage.setItem(shownHere, store.active); } catch {}
    }
    const same = store !== null && store.content === (held ?? written)?.content;  // another chat chosen, or
    if (!stale) return save(value, store, !same);                                  // the other tabs' merged
    if (same && held === null) return;  // nothing here to keep
    held = {value, ...store};  // the other tab's changes stay until the user chooses
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
    if (event.key === mark) marked = event.newValue;
    if (event.key !== key) return;
    const by = marked;
    marked = null;
    if (by === null || stale || sent.has(by)) return;
    if (channel) setTimeout(() => { if (!sent.has(by)) goStale(); }, 3000);  // its conversations come soon
    else goStale();
  });
  const goStale = () => {
    if (stale) return;
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
  };
  // Another tab's change: merged here by the page's #chat-sync event (its script takes the conversations sent),
  // once the page has it. Changes sent while one merges are merged next, the last of them.
  const merge = () => {
    const button = document.getElementById("chat-sync");
    if (button) button.click();
    else setTimeout(merge, 100);
  };
  channel?.addEventListener("message", ({data}) => {
    if (typeof data?.by !== "string" || typeof data.text !== "string" || typeof data.content !== "string") return;
    sent.add(data.by);
    if (stale) return;  // this tab's copy is held apart until the user chooses
    const waiting = incoming !== null;
    incoming = data.text;
    written = {text: data.text, content: data.content};
    if (!waiting) merge();
  });
  // The events that carry the conversations run one at a time, each with the latest of them. Gradio sends an
  // event's inputs as the page holds them when it fires, and runs events outside its queue side by side: two
  // quick changes (New chat, then a setting) each changed the conversations as they were before both, and the
  // one to land last undid the other. An event fired before another's conversations came back is sent once
  // they have, with them in place of its own; so is one fired as they came back, before the page held them (a
  // setting changed just after a pasted system prompt saved the prompt as it was before).
  // A merge the server did not make (a refusal: two full stores past the size it takes) leaves this tab's copy
  // without the other tab's change: it goes stale, rather than write its copy over that change unsaid.
  const fetchNow = window.fetch;
  let queue = Promise.resolve(), latest = null;
  window.fetch = function (input, init) {
    const url = String(input?.url ?? input);
    let body = null;
    try { body = url.endsWith("/gradio_api/run/predict") ? JSON.parse(init?.body) : null; } catch {}
    if (!Array.isArray(body?.data) || !body.data.some(isStore)) return fetchNow.apply(this, arguments);
    const merging = taken !== null && body.data.includes(taken);  // #chat-sync's, with what another tab sent
    const sent = queue.then(async () => {
      if (latest !== null) body.data = body.data.map((value) => isStore(value) ? latest : value);
      let response;
      try {
        response = await fetchNow.call(this, input, {...init, body: JSON.stringify(body)});
      } catch (error) {
        if (merging) goStale();
        throw error;
      }
      if (merging && !response.ok) goStale();
      try {
        const carried = ((await response.clone().json()).data ?? []).find(isStore);
        if (carried) latest = carried;
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
    takeSent: () => { taken = incoming; incoming = null; return taken; },  // for #chat-sync
    shownHere: () => { try { return sessionStorage.getItem(shownHere); } catch { return null; } },  // as it opens
  };
})();
