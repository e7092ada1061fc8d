"""The web app's interface: chat, text completion with token probabilities, and the model's facts.

Interface only: callbacks pass what the user sent to llama_core, which checks it (llama_core.serving.requests)
and streams the reply from a running engine that batches concurrent requests and cancels abandoned ones.
`build_demo(engine, prompts)` makes the Gradio Blocks; llama_core.app.server serves them and
llama_core.app.cli (`llama-chat`, `python app.py`) starts it all.
The chat tab's callbacks are in chat_tab.py, the completion tab's in completion_tab.py, the Gradio API's routes
(/chat, /complete) in api.py; the requests they all make, in streaming.py; the text the page shows, in display.py.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no telemetry or version checks
if importlib.util.find_spec("matplotlib") is None:
    # Gradio tries to import matplotlib twice for every streamed update; without it each try searches the
    # import path again (0.1 ms per update). Record it as missing, so the tries fail at once.
    sys.modules["matplotlib"] = None
import gradio as gr  # noqa: E402

from ..loader import ModelInfo  # noqa: E402
from ..prompt_library import PromptLibrary  # noqa: E402
from ..serving.streams import TextEngine  # noqa: E402
from . import conversations  # noqa: E402
from .api import ApiRoutes  # noqa: E402
from .chat_tab import ChatTab  # noqa: E402
from .completion_tab import CompletionTab, alternatives_of, completion_running, continued_prompt  # noqa: E402
from .display import PROBABILITY_COLORS, model_facts, prompt_size_line  # noqa: E402
# Reached through ui by the tests. Not streaming's replies, open_chat and stream_*: the app looks those up in
# streaming at run time, so a test replaces them there.
from .display import alternatives_table, marked_completion, stats_line  # noqa: E402,F401
from .streaming import TOP_ALTERNATIVES, complete, request_stats, start_chat  # noqa: E402,F401

APP_DIR = Path(__file__).resolve().parent  # page.css and page.js: package data beside this file
THEME = gr.themes.Default(primary_hue="amber", secondary_hue="stone")  # local fonts only: works offline
# Conversations are kept in the browser's localStorage under this key. Gradio encrypts them with the secret; a
# fixed one lets them survive a server restart (it guards nothing: the data is the user's own, in their browser).
STORAGE_KEY, STORAGE_SECRET = "llama-core-conversations", "llama-core-conversations-v1"
# The page's question before Clear or Delete; while a reply streams (the chatbot's own trash button is not disabled
# then), it says to stop first instead, and nothing is cleared.
ASK_UNLESS_STREAMING = """() => {
  const stop = document.getElementById("chat-stop");
  if (stop && stop.checkVisibility()) { alert("A reply is still coming: Stop it first."); return false; }
  return confirm(%s);
}"""
TAKE_SENT = "() => window.llamaCoreStore.takeSent()"  # the conversations another tab sent (store.js)
SHOWN_HERE = "(store) => [store, window.llamaCoreStore.shownHere()]"  # the chat this tab showed before a reload
CLEAR_QUESTION = "Clear this chat? Its messages, every version of them, are removed; this cannot be undone."
DELETE_QUESTION = "Delete this chat? It and every version of its messages are removed; this cannot be undone."
OUTPUT_FORMATS = [("Text", "text"), ("JSON", "json"), ("JSON schema", "json_schema"), ("Regular expression", "regex"),
                  ("Lark grammar", "lark")]
CSS = (APP_DIR / "page.css").read_text(encoding="utf-8")

# Run once the page loads: a change in a stale tab, leaving mid-reply, Escape, a message a reload cut off (page.js).
PAGE_JS = (APP_DIR / "page.js").read_text(encoding="utf-8").replace("STORAGE_KEY", json.dumps(STORAGE_KEY))
# Images come from this server only: a message (an imported chat's, a reply's) showing an image of another site's,
# as HTML or Markdown, fetched it as the chat opened, telling that site who read it and when. Forms send to this
# server only: a message's HTML may hold a form (a fake "sign in again" box), which sent what was typed in it to
# any site its action named.
FROM_HERE_ONLY = ("""<meta http-equiv="Content-Security-Policy" """
                    """content="img-src 'self' data: blob:; form-action 'self'">""")
# Run first in the page's head, before Gradio's scripts (page_head.py): the conversations' store shared by the
# app's tabs, and asking before leaving mid-reply (store.js); a login the server asks to wait, tried again (login.js).
PAGE_HEAD = FROM_HERE_ONLY + "".join(
    "<script>%s</script>" % (APP_DIR / name).read_text(encoding="utf-8").replace("STORAGE_KEY", json.dumps(STORAGE_KEY))
    for name in ("store.js", "login.js"))


def _sampling_controls(info: ModelInfo, prefix: str) -> list[gr.components.Component]:
    """Temperature, top-p and max new tokens, then the Advanced accordion's controls in streaming.ADVANCED order.
    Temperature and top-p start as the checkpoint's generation_config.json says, else at Llama-2's 0.6 and 0.9."""
    max_seq_len, stated = info.max_seq_len, info.generation_config
    temperature = 0.6 if stated.temperature is None else min(stated.temperature, 2.0)
    top_p = 0.9 if stated.top_p is None else stated.top_p
    basic = [
        gr.Slider(0, 2, value=temperature, step=0.05, label="Temperature", info="0 is greedy",
                  elem_id=f"{prefix}-temperature"),
        gr.Slider(0, 1, value=top_p, step=0.01, label="Top-p", info="keep the most likely tokens holding this "
                  "much probability (0: the most likely only)", elem_id=f"{prefix}-top-p"),
        gr.Slider(1, max_seq_len - 1, value=min(256, max(1, max_seq_len // 4)), step=1, label="Max new tokens",
                  elem_id=f"{prefix}-max-new-tokens"),
    ]
    with gr.Accordion("Advanced", open=False, elem_id=f"{prefix}-advanced"):
        advanced = [
            gr.Slider(0, 200, value=0, step=1, label="Top-k", info="keep only the k most likely tokens; 0 is off",
                      elem_id=f"{prefix}-top-k"),
            gr.Slider(0, 1, value=0, step=0.01, label="Min-p", info="drop tokens less likely than this share of "
                      "the most likely one; 0 is off", elem_id=f"{prefix}-min-p"),
            gr.Slider(0.5, 2, value=1, step=0.05, label="Repetition penalty", info="above 1 discourages tokens "
                      "already in the prompt or reply; 1 is off", elem_id=f"{prefix}-repetition-penalty"),
            gr.Slider(-2, 2, value=0, step=0.1, label="Presence penalty", info="above 0 discourages any token the "
                      "reply already used", elem_id=f"{prefix}-presence-penalty"),
            gr.Slider(-2, 2, value=0, step=0.1, label="Frequency penalty", info="above 0 discourages tokens by how "
                      "often the reply used them", elem_id=f"{prefix}-frequency-penalty"),
            gr.Textbox(label="Stop strings", lines=2, info="one per line (at most 4): the reply ends before the "
                       "first", elem_id=f"{prefix}-stop-strings"),
            gr.Number(None, label="Seed", precision=0, info="a whole number from 0: the same seed and settings give "
                      "the same reply; empty is random", elem_id=f"{prefix}-seed"),
            gr.Dropdown(OUTPUT_FORMATS, value="text", label="Reply format", info="JSON: any JSON object; the others "
                        "follow the box below", elem_id=f"{prefix}-output-format"),
            gr.Textbox(label="JSON schema, regular expression or Lark grammar", lines=3, max_lines=12,
                       placeholder='{"type": "object", "properties": {"name": {"type": "string"}}}',
                       elem_id=f"{prefix}-output-grammar"),
        ]
    return basic + advanced


def build_demo(engine: TextEngine, prompts: PromptLibrary) -> gr.Blocks:
    """The app on a running engine: Chat, Completion and Model tabs, and the /chat and /complete API."""
    info = engine.info
    # Replies wait for a slot in the engine's queue, where admission is fair across clients and the chat says it
    # waits; past what the engine holds, in Gradio's queue
    generating = dict(concurrency_id="generate", concurrency_limit=engine.capacity)
    ui = dict(api_visibility="private")
    routes, completion_tab = ApiRoutes(engine), CompletionTab(engine)

    # Gradio's copies of files handed over or uploaded: those older than an hour go, looked for hourly.
    with gr.Blocks(title="Llama-2", analytics_enabled=False, delete_cache=(3600, 3600)) as demo:
        gr.Markdown(f"## Llama-2 · `{info.name}`")
        store = gr.BrowserState(None, storage_key=STORAGE_KEY, secret=STORAGE_SECRET)
        pending = gr.State(None)  # {"message", "keep"} while a reply is under way
        confirmed = gr.Checkbox(False, visible=False)  # what the page's last confirm() dialog answered
        # Another tab's change: the conversations it sent (store.js), merged into this tab's by sync's click
        sent = gr.Textbox(None, visible=False)
        sync = gr.Button(visible="hidden", elem_id="chat-sync")
        shown_here = gr.Textbox(None, visible=False)  # as the page opens: the chat this tab showed (store.js)
        with gr.Tabs(elem_id="tabs"):  # one bar: a component between two tabs would start another
            with gr.Tab("Chat", elem_id="chat-tab"), gr.Row(elem_id="chat-row"):
                with gr.Column(scale=1, min_width=200, elem_id="chat-sidebar"):
                    new_button = gr.Button("New chat", size="md", elem_id="chat-new")
                    chat_list = gr.Radio(label="Conversations", elem_id="chat-list")
                    chat_title = gr.Textbox(label="Title", max_lines=1, elem_id="chat-title",
                                            info="Enter, or leaving the box, renames")
                    delete_button = gr.Button("Delete this chat", size="sm", variant="stop", elem_id="chat-delete")
                    with gr.Row():
                        export_json = gr.Button("Export JSON", size="sm", elem_id="chat-export-json")
                        export_markdown = gr.Button("Export Markdown", size="sm", elem_id="chat-export-markdown")
                    import_button = gr.UploadButton("Import JSON", size="sm", file_types=[".json"], type="binary",
                                                    elem_id="chat-import")
                    exported = gr.File(label="Exported", visible=False, interactive=False, elem_id="chat-exported")
                with gr.Column(scale=3, min_width=300, elem_id="chat-main"):
                    chatbot = gr.Chatbot(label="Chat · click a message for its versions", elem_id="chatbot",
                                         height=420, buttons=["copy", "copy_all"], editable="user",
                                         placeholder="Say something to start the conversation.")
                    with gr.Row(elem_id="chat-branch", visible=False) as branch_row:
                        branch_prev = gr.Button("‹", size="sm", min_width=40, scale=0, elem_id="chat-branch-prev")
                        branch_label = gr.Markdown(elem_id="chat-branch-label")
                        branch_next = gr.Button("›", size="sm", min_width=40, scale=0, elem_id="chat-branch-next")
                        branch_retry = gr.Button("Retry this reply", size="sm", scale=0, min_width=120,
                                                 elem_id="chat-branch-retry")
                    branch_at = gr.State(None)  # the message the branch bar is about, an index into those shown
                    chat_stats = gr.Markdown(elem_id="chat-stats")
                    with gr.Row(elem_id="chat-compose"):
                        chat_input = gr.Textbox(label="Message", show_label=False, placeholder="Message (Enter sends)",
                                                scale=5, elem_id="chat-input", autofocus=True, min_width=160,
                                                max_lines=8)
                        send = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send", min_width=80)
                        stop = gr.Button("Stop", variant="stop", scale=1, elem_id="chat-stop", visible=False,
                                         min_width=80)
                    with gr.Row(elem_id="chat-tools"):
                        retry, continue_reply, undo_button, clear = (
                            gr.Button(name, size="sm", interactive=False, elem_id=f"chat-{name.lower()}", min_width=100)
                            for name in ("Retry", "Continue", "Undo", "Clear"))
                        show_prompt_button = gr.Button("Show prompt", size="sm", elem_id="chat-show-prompt",
                                                       min_width=100)
                    with gr.Accordion("The prompt the model sees next", open=True, visible=False,
                                      elem_id="chat-prompt-panel") as prompt_panel:
                        prompt_shown = gr.Markdown(elem_id="chat-prompt")
                    examples = gr.Examples(prompts.chat_examples, chat_input, label="Examples", elem_id="chat-examples")
                with gr.Column(scale=1, min_width=240):
                    presets = gr.Dropdown([*prompts.system_prompts], value=None, label="Presets",
                                          info="Puts a system prompt in the box below", elem_id="system-prompt-presets",
                                          visible=len(prompts.system_prompts) > 1)
                    system_prompt = gr.Textbox(prompts.system_prompt, label="System prompt", lines=4,
                                               elem_id="system-prompt")
                    chat_controls = _sampling_controls(info, "chat")
            with gr.Tab("Completion", elem_id="completion-tab"), gr.Row():
                with gr.Column(scale=3):
                    prompt = gr.Textbox(label="Prompt", lines=4, elem_id="completion-prompt",  # Enter: a new line
                                        placeholder="Text for the model to continue (Shift+Enter generates)")
                    prompt_size = gr.Markdown(prompt_size_line(engine, ""), elem_id="completion-prompt-tokens")
                    with gr.Row():
                        generate = gr.Button("Generate", variant="primary", elem_id="completion-generate")
                        continue_button = gr.Button("Continue", elem_id="completion-continue")
                        stop_completion = gr.Button("Stop", variant="stop", elem_id="completion-stop", visible=False)
                    marked = gr.HighlightedText(label="Prompt and generated text", color_map={"generated": "#fcd34d"},
                                                show_legend=True, elem_id="completion-marked")
                    completed = gr.State(None)  # {"prompt", "text"}: the last generation and the prompt it continued
                    output = gr.Textbox(label="Output", lines=8, interactive=False, elem_id="completion-output")
                    tokens = gr.HighlightedText(label="Tokens, each with its probability", color_map=PROBABILITY_COLORS,
                                                show_legend=False, show_inline_category=True, visible=False,
                                                elem_id="completion-tokens")
                    alternatives = gr.Markdown(elem_id="completion-alternatives")
                    completion_stats = gr.Markdown(elem_id="completion-stats")
                    shown_tokens = gr.State([])
                    gr.Examples(prompts.completion_examples, prompt, label="Examples")
                with gr.Column(scale=1):
                    completion_controls = _sampling_controls(info, "completion")
                    echo = gr.Checkbox(label="Echo the prompt", elem_id="completion-echo")
                    show_probabilities = gr.Checkbox(label="Show probabilities", elem_id="completion-probabilities")
            with gr.Tab("Model", elem_id="model-tab"):
                gr.Markdown(model_facts(info), elem_id="model-facts")

        defaults = dict(zip(conversations.SETTINGS, (control.value for control in chat_controls)))
        bounds = {name: (control.minimum, control.maximum, control.step)  # the sliders' ranges
                  for name, control in zip(conversations.SETTINGS, chat_controls) if name in conversations.SLIDERS}
        buttons = [send, stop, retry, undo_button, clear, new_button, delete_button, chat_title,  # button_states'
                   continue_reply]
        branch_outputs = [branch_at, branch_row, branch_label, branch_prev, branch_next, branch_retry]
        view_outputs = [store, chatbot, chat_stats, system_prompt, *chat_controls, chat_list, *buttons,
                        *branch_outputs, prompt_panel, exported]
        begin_outputs = [chatbot, chat_input, chat_stats, pending, chat_list, *buttons, prompt_panel, branch_row]
        reply_inputs = [pending, store, system_prompt, *chat_controls]
        finished = gr.State(None)  # the reply respond streamed, for finish to keep; or {"notice": True}
        reply_outputs = [chatbot, chat_stats, finished, chat_input]
        finish_outputs = [store, pending, finished, chat_list, *buttons, *branch_outputs]
        chat = ChatTab(engine, prompts, defaults, bounds, view_outputs, begin_outputs, finish_outputs, system_prompt)
        begins = [(trigger, chat.begin, [chat_input, store, pending]) for trigger in (chat_input.submit, send.click)]
        begins.append((examples.load_input_event.then, chat.begin, [chat_input, store, pending]))
        begins.append((retry.click, chat.begin_retry, [store, pending, chatbot]))
        begins.append((chatbot.retry, chat.begin_retry, [store, pending, chatbot]))
        begins.append((branch_retry.click, chat.begin_retry, [store, pending, chatbot, branch_at]))
        begins.append((chatbot.edit, chat.begin_edit, [store, pending, chatbot]))
        begins.append((continue_reply.click, chat.begin_continue, [store, pending]))
        answers = [trigger(start, inputs, begin_outputs, queue=False, **ui)
                   .then(chat.respond, reply_inputs, reply_outputs, **generating, **ui)
                   for trigger, start, inputs in begins]
        for answer in answers:
            answer.then(chat.finish, [store, finished, pending], finish_outputs, queue=False, **ui)
        stop.click(chat.stop_reply, [pending, store, chat_input], view_outputs + [chat_input, pending], queue=False,
                   **ui)
        chatbot.select(chat.select_message, [store, pending], branch_outputs, queue=False, **ui)
        branch_prev.click(lambda at, s, p: chat.flip(at, s, p, -1), [branch_at, store, pending], view_outputs,
                          queue=False, **ui)
        branch_next.click(lambda at, s, p: chat.flip(at, s, p, 1), [branch_at, store, pending], view_outputs,
                          queue=False, **ui)
        show_prompt_button.click(chat.show_prompt, [chat_input, store, system_prompt, chat_controls[2]],
                                 [prompt_panel, prompt_shown], queue=False, **ui)
        undo_button.click(chat.undo, [store, pending, chatbot], view_outputs + [chat_input], queue=False, **ui)
        # Clear and Delete take every version of the messages, and cannot be undone: the page asks first.
        for trigger, question, then in ((clear.click, CLEAR_QUESTION, chat.clear_chat),
                                        (chatbot.clear, CLEAR_QUESTION, chat.clear_chat),
                                        (delete_button.click, DELETE_QUESTION, chat.delete)):
            trigger(None, None, confirmed, js=ASK_UNLESS_STREAMING % json.dumps(question), queue=False, **ui) \
                .then(then, [store, pending, confirmed], view_outputs, queue=False, **ui)
        new_button.click(chat.new_chat, [store, pending, system_prompt, *chat_controls], view_outputs, queue=False,
                         **ui)
        chat_list.input(chat.switch, [chat_list, store, pending], view_outputs, queue=False, **ui)
        sync.click(None, None, sent, js=TAKE_SENT, queue=False, **ui) \
            .then(chat.merge_sent, [sent, store, pending], view_outputs, queue=False, show_progress="hidden", **ui)
        for renaming in (chat_title.submit, chat_title.blur):  # Enter, or leaving the box, renames
            # No loading cover over the list: a click on it as the box loses the focus is kept.
            renaming(chat.rename, [chat_title, store], [store, chat_list, chat_title], queue=False,
                     show_progress="hidden", **ui)
        # A preset chosen fills the box (saved as typed), and the list is ready for the next choice
        presets.input(lambda name: (prompts.system_prompts.get(name, gr.skip()), None), presets,
                      [system_prompt, presets], queue=False, show_progress="hidden", **ui)
        typed = {"system_prompt", "stop", "output_grammar"}  # text boxes: "input" is keys only (Gradio 6)
        for name, control in [("system_prompt", system_prompt), *zip(conversations.SETTINGS, chat_controls)]:
            trigger = control.change if name in typed else control.input
            trigger(functools.partial(chat.save_settings, name), [store, system_prompt, *chat_controls],
                    [store, *chat_controls], queue=False, preprocess=False, **ui)
        export_json.click(lambda s: chat.export(s, "json"), store, exported, queue=False, **ui)
        export_markdown.click(lambda s: chat.export(s, "md"), store, exported, queue=False, **ui)
        import_button.upload(chat.import_file, [import_button, store, pending], view_outputs, queue=False, **ui)
        demo.load(chat.restore, [store, shown_here], view_outputs, js=SHOWN_HERE, queue=False, **ui)
        # An empty Number shown only later (under Advanced, closed) shows, and sends, 0 unless set empty after load.
        demo.load(lambda: None, None, completion_controls[conversations.SETTINGS.index("seed")], queue=False, **ui)

        completion_inputs = [prompt, *completion_controls, echo, show_probabilities]
        continues = continue_button.click(continued_prompt, [prompt, completed], prompt, queue=False, **ui).then
        running = [generate, stop_completion, continue_button]
        completions = [trigger(lambda: ["", *completion_running(True)], None, [completion_stats, *running], queue=False,
                               **ui)
                       .then(completion_tab.complete_ui, completion_inputs,
                             [output, tokens, completion_stats, shown_tokens, marked, completed], **generating, **ui)
                       for trigger in (generate.click, prompt.submit, continues)]
        for completion in completions:
            completion.then(lambda: completion_running(False), None, running, queue=False, **ui)
        prompt.change(lambda text: prompt_size_line(engine, text), prompt, prompt_size, queue=False, **ui)
        stop_completion.click(lambda: ["Stopped.", *completion_running(False)], None, [completion_stats, *running],
                              queue=False, cancels=completions, **ui)
        show_probabilities.change(lambda on: gr.update(visible=on), show_probabilities, tokens, queue=False, **ui)
        tokens.select(alternatives_of, shown_tokens, alternatives, queue=False, **ui)

        gr.api(routes.chat, api_name="chat", **generating)
        gr.api(routes.complete, api_name="complete", **generating)
    return demo
