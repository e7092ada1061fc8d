// The app page's script (llama_core.app.ui.PAGE_JS), run once the page loads (ui.py puts in its storage key).
// The conversations' store, its marks, the note that another tab changed it, the events that carry it and asking
// before leaving mid-reply are store.js's, run in the head: here, what the page does about them (a change made
// here asks first), and its keys.
() => {
  const key = STORAGE_KEY, store = window.llamaCoreStore;
  // While the note shows, a change here (sending, a new chat, retry, undo...) asks first: it would replace the
  // other tab's. Going on makes this tab's copy the one kept, so the note goes.
  const changes = "#chat-send, #chat-new, #chat-delete, #chat-retry, #chat-continue, #chat-undo, #chat-clear, " +
                  "#chat-branch-retry, " +
                  "#chat-examples .gallery-item, #chat-import, " +
                  ["Retry", "Edit", "Clear"].map((name) => `#chatbot button[aria-label="${name}"]`).join(", ");
  const goOn = () => {
    if (!store.stale()) return true;
    if (!confirm("Your conversations were changed in another tab of this app. Going on here replaces those " +
                 "changes with this tab's. Go on? (Cancel, then Reload, to see them.)")) return false;
    store.keep();
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
  const streaming = store.replyStreaming;
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
  // The version buttons say which way they go to a screen reader (they show ‹ and ›), each time Gradio draws them.
  const versionNames = {"chat-branch-prev": "Previous version", "chat-branch-next": "Next version"};
  const nameVersions = () => {
    for (const [id, name] of Object.entries(versionNames)) {
      const button = document.getElementById(id);
      if (button && button.getAttribute("aria-label") !== name) button.setAttribute("aria-label", name);
    }
  };
  new MutationObserver(nameVersions).observe(document.body, {childList: true, subtree: true});
  nameVersions();
  // A message sent is kept in this tab's sessionStorage until its turn ends: leaving or reloading the page before
  // (the reply is not kept then), or before the server took it, puts it back in the box when the page opens again,
  // unless the chat shows it.
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
  window.addEventListener("pagehide", () => {  // kept only where the page goes while its turn runs, or before it
    const left = sessionStorage.getItem(unsent);  // began (the server out of reach, the message still in the box:
    const box = document.querySelector("#chat-input textarea");  // Gradio reloads the page once it is back)
    if (!streaming() && !(left !== null && box?.value.trim() === left.trim())) sessionStorage.removeItem(unsent);
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
}
