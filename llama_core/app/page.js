// The app page's script (llama_core.app.ui.PAGE_JS), run once the page loads (ui.py puts in its storage key).
// Each tab holds the conversations as they were when it opened, and writes them all back when anything changes.
// Another tab's change (the browser then fires "storage" here) makes this tab's copy stale: it says so at once,
// offering a reload, and from then on writes nothing by itself. What it would write (a reply ending, a setting
// changed, another chat chosen) is held, and the note offers to keep it, replacing the other tab's; a change the
// user makes here (sending, a new chat, retry, undo...) asks first.
// A change is told apart by a mark: this script writes one under key + "-by" before each write of the store, so
// the other tabs see the mark, then the store. An unmarked write is no change: a tab opening, from a page older
// than this script (a tab opening now writes nothing: opening.js).
// A write the browser refuses (its storage for the app is full) is said in a note until a write succeeds.
// Leaving or reloading the page while a chat reply streams, or with changes held, asks first.
() => {
  const key = STORAGE_KEY, mark = key + "-by", tab = Math.random().toString(36).slice(2);
  window.llamaCoreOpening = false;  // opened: from now on the conversations are written (opening.js)
  const write = Storage.prototype.setItem;
  let held = null, leaving = false, marked = false, writes = 0;
  const note = () => document.getElementById("other-tab-note");
  const banner = (id, text) => {  // a note at the top of the page
    const shown = document.createElement("div");
    shown.id = id;
    shown.setAttribute("role", "alert");
    shown.append(document.createElement("span"));
    shown.firstChild.textContent = text;
    document.body.prepend(shown);
    return shown;
  };
  const save = (value) => {  // the mark, then the store; a write refused for want of room is said
    try {
      write.call(localStorage, mark, tab + ":" + ++writes);
      write.call(localStorage, key, value);
      held = null;  // this tab's copy is saved: nothing it held is left unsaved
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
    note()?.remove();
    try {
      if (held !== null) save(held);
    } catch {}  // a store too full for it says so, and it stays held until a save succeeds
  };
  Storage.prototype.setItem = function (name, value) {
    if (this !== localStorage || name !== key) return write.call(this, name, value);
    if (!note()) return save(value);
    held = value;  // the other tab's changes stay until the user chooses
    const shown = note();
    if (!shown.querySelector("#other-tab-keep")) {
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
  localStorage.removeItem(key + "-opened");  // what earlier versions of this script wrote as a tab opened
  window.addEventListener("storage", (event) => {
    if (event.storageArea !== localStorage) return;
    if (event.key === mark) marked = event.newValue !== null;
    if (event.key !== key) return;
    const changed = marked;
    marked = false;
    if (!changed || note()) return;
    const shown = banner("other-tab-note", "Your conversations were changed in another tab of this app. Reload " +
      "to see them here: a change made here first would replace them.");
    const reload = document.createElement("button");
    reload.textContent = "Reload";
    reload.onclick = () => { leaving = true; setTimeout(() => { leaving = false; }, 0); location.reload(); };
    shown.append(reload);
  });
  // The events that carry the conversations run one at a time, each with the latest of them. Gradio sends an
  // event's inputs as the page holds them when it fires, and runs events outside its queue side by side: two
  // quick changes (New chat, then a setting) each changed the conversations as they were before both, and the
  // one to land last undid the other. An event fired before another's conversations came back is sent once
  // they have, with them in place of its own.
  const isStore = (value) => value !== null && typeof value === "object" && !Array.isArray(value) &&
                             "version" in value && Array.isArray(value.conversations);
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
        const store = ((await response.clone().json()).data ?? []).find(isStore);
        if (store) { latest = store; returned += 1; }
      } catch {}
      return response;
    });
    queue = sent.catch(() => {});
    return sent;
  };
  // While the note shows, a change here (sending, a new chat, retry, undo...) asks first: it would replace the
  // other tab's. Going on makes this tab's copy the one kept, so the note goes.
  const changes = "#chat-send, #chat-new, #chat-delete, #chat-retry, #chat-undo, #chat-clear, #chat-branch-retry, " +
                  "#chat-examples .gallery-item, #chat-import, " +
                  ["Retry", "Edit", "Clear"].map((name) => `#chatbot button[aria-label="${name}"]`).join(", ");
  const goOn = () => {
    if (!note()) return true;
    if (!confirm("Your conversations were changed in another tab of this app. Going on here replaces those " +
                 "changes with this tab's. Go on? (Cancel, then Reload, to see them.)")) return false;
    keep();
    return true;
  };
  const guard = (event) => { if (!goOn()) { event.preventDefault(); event.stopImmediatePropagation(); } };
  document.addEventListener("click", (event) => {
    if (event.target instanceof Element && event.target.closest(changes)) guard(event);
  }, true);
  document.addEventListener("keydown", (event) => {  // sending, and renaming (leaving the title box renames too:
    if (event.key === "Enter" && !event.shiftKey && event.target instanceof Element &&  // that is held)
        event.target.closest("#chat-input, #chat-title")) guard(event);
  }, true);
  // Escape stops a streaming reply; after Stop (which hides itself), the message box has the focus.
  const streaming = () => {  // Stop in Send's place: its own display, also while another tab of the page shows
    const stop = document.getElementById("chat-stop");
    return !!stop && !stop.closest(".hidden") && getComputedStyle(stop).display !== "none";
  };
  const toBox = () => {  // once Send is back in Stop's place (the page re-renders the buttons as the turn ends)
    const started = performance.now();
    const tick = () => {
      if (document.getElementById("chat-send")?.checkVisibility() || performance.now() - started > 5000) {
        document.querySelector("#chat-input textarea")?.focus();
      } else setTimeout(tick, 50);
    };
    setTimeout(tick, 0);
  };
  document.addEventListener("click", (event) => {
    if (event.target instanceof Element && event.target.closest("#chat-stop")) toBox();
  }, true);
  document.addEventListener("keydown", (event) => {  // before any box's own handling of the key
    const target = event.target instanceof Element ? event.target : document.body;
    const other = target.closest("input, textarea, select, [role=listbox], [contenteditable]") &&
                  !target.closest("#chat-input");  // a dropdown, an edit box...: Escape is theirs
    if (event.key === "Escape" && !other && streaming()) document.getElementById("chat-stop").click();
  }, true);
  // The arrow keys move through the chat list, as in any group of radio buttons (Gradio names each of its
  // buttons apart, so the browser does not).
  document.addEventListener("keydown", (event) => {
    const step = {ArrowUp: -1, ArrowLeft: -1, ArrowDown: 1, ArrowRight: 1}[event.key];
    const button = event.target instanceof Element && event.target.closest("#chat-list input[type=radio]");
    if (!step || !button || event.altKey || event.ctrlKey || event.metaKey) return;
    const buttons = [...document.querySelectorAll("#chat-list input[type=radio]")];
    const next = buttons[buttons.indexOf(button) + step];
    event.preventDefault();
    if (!next || next.disabled) return;
    next.focus();
    next.click();
    const started = performance.now();
    const refocus = () => {  // the switch draws the list anew: the focus stays with the chosen chat
      const lost = !document.activeElement || document.activeElement === document.body;
      if (lost) document.querySelector("#chat-list input[type=radio]:checked")?.focus();
      if (performance.now() - started < 2000) setTimeout(refocus, 50);
    };
    refocus();
  }, true);
  // A message sent is kept in this tab's sessionStorage until its turn ends: leaving or reloading the page before
  // (the reply is not kept then) puts it back in the box when the page opens again, unless the chat shows it.
  const unsent = key + "-unsent";
  let sentSeen = false;
  const sending = (event, text) => {  // the box's text, or an example's
    if (event.defaultPrevented || streaming()) return;
    const message = text ?? document.querySelector("#chat-input textarea")?.value ?? "";
    if (message.trim()) { sessionStorage.setItem(unsent, message); sentSeen = false; }
  };
  const example = (item) => {  // an example's whole text: the page shows a long one cut short, ending "..."
    const words = (text) => text.replace(/\s+/g, " ").trim();
    const shown = words(item.innerText).replace(/\.\.\.$/, "");
    const samples = window.gradio_config?.components?.find((c) => c.props?.elem_id === "chat-examples")?.props
      ?.samples ?? [];
    const whole = samples.map((sample) => sample[0]).find((text) => typeof text === "string" &&
                                                           words(text).startsWith(shown));
    return whole ?? item.innerText;
  };
  document.addEventListener("click", (event) => {
    if (!(event.target instanceof Element)) return;
    if (event.target.closest("#chat-send")) sending(event);
    const item = event.target.closest("#chat-examples .gallery-item");
    if (item) sending(event, example(item));
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && event.target instanceof Element &&
        event.target.closest("#chat-input")) sending(event);
  });
  setInterval(() => {  // the turn ended: the message is in the chat (or back in the box)
    if (sessionStorage.getItem(unsent) === null) return;
    if (streaming()) sentSeen = true;
    else if (sentSeen) sessionStorage.removeItem(unsent);
  }, 250);
  window.addEventListener("pagehide", () => {  // kept only where the page goes while its turn runs
    if (!streaming()) sessionStorage.removeItem(unsent);
  });
  const left = sessionStorage.getItem(unsent);
  if (left !== null) {
    sessionStorage.removeItem(unsent);
    setTimeout(() => {  // once the saved conversation is shown
      const users = document.querySelectorAll('#chatbot [data-testid="user"]');
      const box = document.querySelector("#chat-input textarea");
      if (!box || box.value || (users.length && users[users.length - 1].innerText.trim() === left.trim())) return;
      box.value = left;
      box.dispatchEvent(new Event("input", {bubbles: true}));
    }, 1500);
  }
  window.addEventListener("beforeunload", (event) => {  // a reply still streaming is kept when it ends
    if (streaming() || (held !== null && !leaving)) {
      event.preventDefault();
      event.returnValue = "";
    }
  });
}
