// The login form's tries, run in the page's head (llama_core.app.ui.PAGE_HEAD). The server takes wrong logins
// at a user's password one a second (app/logins.py), and answers 429 while 16 tries wait: Gradio's form shows
// nothing for it (or the "Incorrect Credentials" of a try before). A try the server asks to wait is made again
// each second for 20 s; then the page says why it was not let in.
(() => {
  const fetchNow = window.fetch, patience = 20000;
  const isLogin = (input, init) => {
    try {
      const path = new URL(String(input?.url ?? input), location.href).pathname;
      return init?.method === "POST" && /\/login\/?$/.test(path);
    } catch { return false; }
  };
  const say = (text) => {
    document.getElementById("login-busy-note")?.remove();
    if (!text) return;
    const note = document.createElement("div");
    note.id = "login-busy-note";
    note.setAttribute("role", "alert");
    note.style.cssText = "position: sticky; top: 0; z-index: 1000; padding: 8px 12px; background: #fef3c7; " +
                         "color: #78350f; border-bottom: 1px solid #f59e0b;";
    note.textContent = text;
    document.body.prepend(note);
  };
  window.fetch = async function (input, init) {
    if (!isLogin(input, init)) return fetchNow.apply(this, arguments);
    const until = performance.now() + patience;
    for (;;) {
      const response = await fetchNow.call(this, input, init);
      if (response.status !== 429) { say(null); return response; }
      if (performance.now() > until) {
        say("Too many login attempts at once (someone may be guessing the password): try again in a while.");
        return response;
      }
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
  };
})();
