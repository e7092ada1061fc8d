"""The chat tab's callbacks, on conversations kept in the browser (llama_core.app.conversations).

ChatTab holds what they share: the engine, the prompts, the controls' defaults and bounds, the turns under way,
and the lists of components that ui.build_demo wires its callbacks to: each returns one update for every component
of its list, in order.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Optional

import anyio
import gradio as gr

from ..errors import ContextLengthError, LlamaError
from ..prompt_library import PromptLibrary
from ..serving import aio, requests
from ..serving.sequence import STOPPING
from ..serving.streams import TextEngine
from . import branches, conversations, streaming
from .display import STOPPED_STATS, plural, stats_line
from .turns import Turns


def settings_of(values: tuple) -> dict[str, Any]:
    return dict(zip(conversations.SETTINGS, values))


class ChatTab:
    """The chat tab's callbacks on a running engine. Its requests go through llama_core.app.streaming, looked
    up there at run time."""

    def __init__(self, engine: TextEngine, prompts: PromptLibrary, defaults: dict[str, Any], bounds: dict[str, tuple],
                 view_outputs: list, begin_outputs: list, finish_outputs: list, system_prompt: gr.Textbox) -> None:
        self.engine, self.prompts = engine, prompts
        self.defaults = defaults  # the chat controls' initial values, as conversations.SETTINGS names them
        self.bounds = bounds  # the sliders' (minimum, maximum, step), by the same names
        self.view_outputs, self.begin_outputs, self.finish_outputs = view_outputs, begin_outputs, finish_outputs
        self.system_prompt = system_prompt  # the component in view_outputs that the settings' controls follow
        self.turns = Turns()
        self.exports = conversations.ExportFiles()

    def loaded(self, store: Any) -> dict:
        return conversations.loaded_store(store, self.prompts.system_prompt, self.defaults)

    def button_states(self, conversation: dict, busy: bool, title: bool = False, notice: bool = False) -> list:
        """Send and Stop swap in place; the others only when they have something to do, and New chat, Delete
        and the title box not while a reply streams (into this conversation). title: the box shows the
        conversation's title too. notice: a turn's notice shows, which Retry sends again and Undo takes away.
        Continue: the last reply was cut short (the token limit, or Stop)."""
        has_messages = bool(conversation["messages"]) and not busy
        titled = {"value": conversation["title"]} if title else {}
        return [gr.update(visible=not busy), gr.update(visible=busy), gr.update(interactive=has_messages or notice),
                gr.update(interactive=has_messages or notice), gr.update(interactive=has_messages),
                gr.update(interactive=not busy), gr.update(interactive=not busy),
                gr.update(interactive=not busy, **titled),
                gr.update(interactive=has_messages and not notice and conversations.cut_short(conversation))]

    def branch_states(self, conversation: dict, at: Optional[int] = None) -> list:
        """The branch bar for message `at` of those shown (by default branches.branch_point): which
        version it is, ‹ and › to flip, and Retry this reply for a reply."""
        messages = conversation["messages"]
        if at not in range(len(messages)):
            at = branches.branch_point(conversation)
        if at is None:
            return [None, gr.update(visible=False)] + [gr.skip()] * 4
        version, versions = branches.branch_position(conversation, at)
        who = "Reply" if messages[at]["role"] == "assistant" else "Message"
        label = f"{who} {at // 2 + 1} · version {version} / {versions}"
        return [at, gr.update(visible=True), label, gr.update(interactive=version > 1),
                gr.update(interactive=version < versions), gr.update(interactive=who == "Reply")]

    def view(self, store: dict, shown: Optional[list[dict]] = None, stats: Optional[str] = None,
             at: Optional[int] = None) -> list:
        """Every view_outputs update for the store's active conversation."""
        conversation = conversations.active(store)
        settings = dict(self.defaults, **conversation["settings"])
        return [store, conversation["messages"] if shown is None else shown,
                conversation["stats"] if stats is None else stats, conversation["system_prompt"],
                *[settings[name] for name in conversations.SETTINGS],
                gr.update(choices=conversations.choices(store), value=store["active"], interactive=True),
                *self.button_states(conversation, busy=False, title=True), *self.branch_states(conversation, at),
                gr.update(visible=False), gr.update(visible=False, value=None)]  # a prompt shown, a file exported:
        # both out of date

    def unchanged(self, extra: int = 0) -> list:
        return [gr.skip()] * (len(self.view_outputs) + extra)

    def restore(self, store: Any, shown_here: Any = None):
        """The page as the browser's store has it, showing the chat this tab showed before a reload (shown_here,
        where the store still has it), else the one chosen last in any tab. The store is written back only where
        reading it changed it (a new one, or one left from an older version: any change tells the app's other
        tabs), or to show another chat (a write that tells them nothing)."""
        kept = conversations.switched(self.loaded(store), shown_here)
        shown = self.view(kept)
        # A box whose saved value is the one the page opened with is left alone: a change made in it before this
        # came back stays in it (that change is saved after this: the page's events run one at a time). But an
        # empty seed: a Number left empty at load shows, and sends, 0 once Advanced opens (every reply then
        # sampled with seed 0) unless set empty after load.
        first = [self.system_prompt.value, *(self.defaults[name] for name in conversations.SETTINGS)]
        boxes = slice(3, 4 + len(conversations.SETTINGS))  # view's system prompt, then the settings
        shown[boxes] = [gr.skip() if value == opened and value is not None else value
                        for value, opened in zip(shown[boxes], first)]
        return [gr.skip() if kept == store else kept, *shown[1:]]

    def begin(self, message: str, store: Any, pending: Optional[dict]):
        """Shows the user's message at once and marks a reply as under way; a message sent while one streams
        (Enter in the box) waits in the box."""
        if pending is not None or not message.strip():
            return [gr.skip()] * len(self.begin_outputs)
        conversation = conversations.active(self.loaded(store))
        return self.beginning(conversation, message, len(conversation["messages"]), box="")

    def beginning(self, conversation: dict, message: str, keep: int, box: Any = gr.skip(),
                  continues: Optional[dict] = None) -> list:
        """begin_outputs for a reply to `message` after the conversation's first `keep` messages; or, with
        `continues` (the reply's node in the conversation's tree), that reply going on."""
        shown = conversation["messages"][:keep] + [{"role": "user", "content": message}]
        turn = {"message": message, "keep": keep, "turn": uuid.uuid4().hex}
        if continues is not None:
            shown.append({"role": "assistant", "content": continues["content"]})
            turn.update(continues=continues["id"], start=continues["content"].rstrip())
        return [shown, box, "", turn, gr.update(interactive=False), *self.button_states(conversation, busy=True),
                gr.update(visible=False), gr.update(visible=False)]

    def begin_retry(self, store: Any, pending: Optional[dict], shown: Any, at: Optional[int] = None):
        """A new reply to the message before reply `at` (by default the last reply), kept beside the old one;
        on a turn's notice, the turn sent again."""
        conversation = conversations.active(self.loaded(store))
        refused = conversations.refused_turn(shown, conversation["messages"])
        if pending is None and refused is not None and at in (None, len(shown) - 1):
            return self.beginning(conversation, refused, len(conversation["messages"]), box="")
        at = len(conversation["messages"]) - 1 if at is None else at
        if pending is not None or at not in range(1, len(conversation["messages"]), 2):
            return [gr.skip()] * len(self.begin_outputs)
        return self.beginning(conversation, conversation["messages"][at - 1]["content"], at - 1)

    def begin_continue(self, store: Any, pending: Optional[dict]):
        """The last reply, cut short, goes on from where it ended: the model continues its text."""
        conversation = conversations.active(self.loaded(store))
        messages = conversation["messages"]
        if pending is not None or not messages or not conversations.cut_short(conversation):
            return [gr.skip()] * len(self.begin_outputs)
        reply = branches.branch(branches.tree_of(conversation))[-1]
        return self.beginning(conversation, messages[-2]["content"], len(messages) - 2, continues=reply)

    def begin_edit(self, store: Any, pending: Optional[dict], shown: Any, edit: gr.EditData):
        """A message edited in place: the reply to it starts a branch beside the old exchange (a turn refused
        or failed, edited, is sent again)."""
        if pending is not None:
            return [gr.skip()] * len(self.begin_outputs)
        conversation = conversations.active(self.loaded(store))
        try:
            message = requests.text(edit.value, "message").rstrip("\n")  # Enter in the edit box adds a newline
        except LlamaError:
            message = ""
        refused = (conversations.refused_turn(shown, conversation["messages"]) is not None
                   and edit.index == len(conversation["messages"]))
        if (edit.index not in range(0, len(conversation["messages"]), 2) and not refused) or not message.strip():
            return [conversation["messages"]] + [gr.skip()] * (len(self.begin_outputs) - 1)  # the page shows it: undo
        return self.beginning(conversation, message, edit.index, box="" if refused else gr.skip())

    def select_message(self, store: Any, pending: Optional[dict], selected: gr.SelectData):
        if pending is not None or selected is None or type(selected.index) is not int:  # not the page's click
            return [gr.skip()] * 6
        return self.branch_states(conversations.active(self.loaded(store)), selected.index)

    def flip(self, at: Optional[int], store: Any, pending: Optional[dict], step: int):
        if pending is not None or at is None:
            return self.unchanged()
        store = self.loaded(store)
        conversation = branches.flipped(conversations.active(store), at, step)
        return self.view(conversations.with_conversation(store, conversation), at=at)

    async def respond(self, request: gr.Request, pending: Optional[dict], store: Any, system_prompt: str, *controls):
        """Streams the reply to the pending message; `finish` then keeps it in the conversation (as the store
        is then: what was changed while it streamed stays). A turn that is refused or fails is not kept: the
        chat shows why and how to fix it below the message, the message goes back to the box, and the
        conversation goes on from its last good state. Runs on the server's event loop, as the API's routes do."""
        if pending is None:
            yield [gr.skip()] * 4
            return
        turn = pending.get("turn")
        if not self.turns.claim(turn):  # another respond runs this turn, or a Stop ended it before it began
            yield [gr.skip()] * 4
            return
        try:
            async with contextlib.aclosing(self._turn_updates(pending, store, system_prompt, controls,
                                                              streaming.client_of(request))) as updates:
                async for update in updates:
                    yield update
        finally:
            self.turns.end(turn)

    def waiting_line(self) -> str:
        """Under a message whose reply waits for one of the engine's slots, all busy with other replies."""
        slots = self.engine.info.max_batch_size
        return (f"Waiting for a free slot: the model answers {slots} request{'s' if slots != 1 else ''} at once, and "
                "all are busy. This reply starts when one ends (Stop gives up).")

    async def _turn_updates(self, pending: dict, store: Any, system_prompt: str, controls: tuple,
                            client: Optional[str]):
        store = await anyio.to_thread.run_sync(self.loaded, store)  # checking a long store: off the loop
        message, keep, turn = pending["message"], pending["keep"], pending.get("turn")
        start = pending.get("start")  # the reply's text so far, where it goes on (Continue)
        conversation = conversations.active(store)
        history, left_out = conversations.model_history(conversation["messages"][:keep])
        shown = conversation["messages"][:keep] + [{"role": "user", "content": message}]
        if start is not None:
            shown.append({"role": "assistant", "content": start})
        reply, notice, stream, stopped = "", None, None, False
        size = aio.preparing_size(aio.text_size(message, history, system_prompt, start or ""),
                                  streaming.asks_grammar(streaming.advanced_controls(controls[3:])))
        try:
            stream = await aio.submitted(lambda: streaming.open_chat(self.engine, message, history, system_prompt,
                                                                     *controls, client=client, reply_start=start),
                                         size)
        except ContextLengthError:
            notice = (f"no room is left in the model's {self.engine.info.max_seq_len:,}-token context for this reply "
                      "to go on." if start is not None else
                      conversations.context_notice(self.engine.tokenizer, self.engine.info.max_seq_len, message,
                                                   system_prompt, controls[2]))
        except LlamaError as exc:
            notice = f"This message was not sent: {streaming.on_page(str(exc))}."
        if stream is not None and stream.refusal is not None:
            notice = (conversations.REFUSED_SYSTEM_NOTICE if conversations.has_reserved_tags(system_prompt)
                      else conversations.REFUSED_NOTICE)
        elif stream is not None:
            self.turns.running(turn, stream)
            try:
                waited = False
                async with contextlib.aclosing(streaming.replies(
                        stream, waiting_after=streaming.WAITING_NOTE_SECONDS)) as updates:
                    async for update in updates:
                        if self.turns.stopped(turn):
                            break
                        if update is None:  # every slot busy: said under the message until the reply begins
                            waited = True
                            yield [gr.skip(), self.waiting_line(), gr.skip(), gr.skip()]
                            continue
                        reply = update
                        yield [self.with_reply(shown, start, reply), "" if waited else gr.skip(), gr.skip(),
                               gr.skip()]
                        waited = False
            except gr.Error as exc:
                again = "" if exc.message.endswith(STOPPING) else " Send the message again."  # not while it stops
                notice = f"The reply failed: {streaming.on_page(exc.message)}{again}"
            finally:
                stream.cancel()
            stopped = self.turns.stopped(turn)  # the reply as shown is the answer; none yet: the conversation as it
            if stopped and not reply:  # was, and a message just sent back in the box (unless one is typed there)
                fresh = keep == len(conversation["messages"]) and self.turns.box_empty_at_stop(turn)
                yield [conversation["messages"], conversation["stats"], None, message if fresh else gr.skip()]
                return
            notice = None if stopped else notice
        if notice is not None and start is not None:  # the reply stays as it was, the notice under it
            yield [conversation["messages"], f"**Not continued:** {notice}", None, gr.skip()]
            return
        if notice is not None:
            yield [shown + [{"role": "assistant", "content": conversations.NOTICE_MARK + notice}], "", {"notice": True},
                   message]
            return
        stats = STOPPED_STATS if stopped else stats_line(streaming.request_stats(stream), (start or "") + reply)
        if left_out:
            stats += (f"\n\n**Note:** {plural(left_out, 'earlier exchange')} holding reserved chat-format tags "
                      f"{'was' if left_out == 1 else 'were'} left out.")
        finished = {"id": conversation["id"], "keep": keep, "message": message, "reply": (start or "") + reply,
                    "stats": stats, "continues": pending.get("continues")}
        done = conversations.with_finished_reply(conversation, finished)
        yield [done["messages"], stats, dict(finished, conversation=done), gr.skip()]

    @staticmethod
    def with_reply(shown: list[dict], start: Optional[str], reply: str) -> list[dict]:
        """The chat as a reply streams: after the message, or after the text it goes on from (start)."""
        if start is None:
            return shown + [{"role": "assistant", "content": reply}]
        return shown[:-1] + [{"role": "assistant", "content": start + reply}]

    def show_prompt(self, message: str, store: Any, system_prompt: str, max_new_tokens: Any):
        """The exact prompt the next turn would give the model, and what of the history does not fit."""
        messages = conversations.active(self.loaded(store))["messages"]
        return gr.update(visible=True, open=True), conversations.prompt_preview(self.engine, message, messages,
                                                                                system_prompt, max_new_tokens)

    def finish(self, store: Any, finished: Optional[dict], pending: Optional[dict]):
        """After a reply: it kept in its conversation as the store is now (settings, system prompt or title
        changed while it streamed stay); then nothing pending, and the buttons for the conversation as it is
        (no branch bar under a turn's notice). Once a turn: a second trigger's finish changes nothing, and one
        whose begin started nothing (Enter while a reply streams: pending is not yet, or no longer, set)
        leaves the page alone (it cleared pending and the buttons while the reply streamed)."""
        if pending is None or not self.turns.settle(pending.get("turn")):
            return [gr.skip()] * len(self.finish_outputs)
        store = self.loaded(store)
        if finished is not None and "reply" in finished:
            store = conversations.with_reply_kept(store, finished)
        conversation = conversations.active(store)
        notice = finished is not None and "notice" in finished
        branch = [None, gr.update(visible=False)] + [gr.skip()] * 4 if notice else self.branch_states(conversation)
        listed = gr.update(choices=conversations.choices(store), value=store["active"], interactive=True)
        return [store, None, None, listed,
                *self.button_states(conversation, busy=False, title=True, notice=notice), *branch]

    async def stop_reply(self, pending: Optional[dict], store: Any, box: Any):
        """Asks the reply under way to end: respond then keeps the reply as it showed it (or, before any, puts
        a message just sent back in the box, unless one is typed there), and finish saves it. A turn still
        waiting for its respond to start (Gradio's queue) ends here. On the event loop, as respond runs."""
        box_empty = not (type(box) is str and box.strip())
        if pending is None or not self.turns.stop(pending.get("turn"), box_empty):
            return self.unchanged(2)
        store = self.loaded(store)
        fresh = box_empty and pending["keep"] == len(conversations.active(store)["messages"])
        return self.view(store) + [pending["message"] if fresh else gr.skip(), None]

    def undo(self, store: Any, pending: Optional[dict], shown: Any):
        """The last exchange taken back, its message back in the box; a turn's notice only goes (its message is
        in the box already)."""
        store = self.loaded(store)
        conversation = conversations.active(store)
        if pending is None and conversations.refused_turn(shown, conversation["messages"]) is not None:
            return self.view(store) + [gr.skip()]
        if pending is not None or not conversation["messages"]:
            return self.unchanged(1)
        message = conversation["messages"][-2]["content"]
        return self.view(conversations.with_conversation(store, branches.undone(conversation))) + [message]

    def clear_chat(self, store: Any, pending: Optional[dict], confirmed: bool):
        """The conversation's messages, every version, gone once the page's dialog confirmed it (the chatbot's
        own trash button has emptied the chat on the page already: not confirmed, it shows them again)."""
        store = self.loaded(store)
        if pending is not None or not confirmed:  # the store as it was: not written, no other tab told
            return [gr.skip(), *self.view(store)[1:]] if pending is None else self.unchanged()
        return self.view(conversations.with_conversation(store, branches.cleared(conversations.active(store))))

    def new_chat(self, store: Any, pending: Optional[dict], prompt: str, *controls):
        store = self.loaded(store)
        if pending is not None:
            return self.unchanged()
        if conversations.is_new(conversations.active(store)):  # this one: the store is not written
            shown = [gr.skip(), *self.view(store)[1:]]
        else:
            shown = self.view(conversations.with_conversation(
                store, conversations.new_conversation(prompt, settings_of(controls))))
        # The page shows these already: an update would undo a control changed while New chat ran.
        at = self.view_outputs.index(self.system_prompt)
        for i, value in enumerate((prompt, *controls), start=at):
            if shown[i] == value:
                shown[i] = gr.skip()
        return shown

    def switch(self, chosen: Any, store: Any, pending: Optional[dict]):
        if pending is not None:
            return self.unchanged()
        return self.view(conversations.switched(self.loaded(store), chosen))

    def merge_sent(self, sent: Any, store: Any, pending: Optional[dict]):
        """The conversations another tab sent as it saved them (store.js), merged into this tab's (see
        conversations.merged). Only what the merge changed is drawn anew: a box being typed in, or the chat list
        being clicked, is left alone unless the other tab changed it. While a reply streams, the chat, its stats
        and buttons are the reply's (it is kept in the merged conversation as it ends), and the boxes show the
        settings of the chat it streams into."""
        theirs = conversations.sent_store(sent)
        if theirs is None:
            return self.unchanged()
        mine = self.loaded(store)
        kept = conversations.merged(mine, theirs, self.prompts.system_prompt, self.defaults)
        shown = [new if new != old else gr.skip() for new, old in zip(self.view(kept), self.view(mine))]
        shown[0] = kept
        if pending is None:
            return shown
        listed = 4 + len(conversations.SETTINGS)  # view's store, chat, stats, system prompt, settings, then list
        boxes = shown[3:listed] if kept["active"] == mine["active"] else [gr.skip()] * (listed - 3)
        choices = conversations.choices(kept)
        return [kept, gr.skip(), gr.skip(), *boxes,
                gr.update(choices=choices) if choices != conversations.choices(mine) else gr.skip(),
                *[gr.skip()] * (len(shown) - listed - 1)]

    def rename(self, title: Any, store: Any):
        """The title typed (Enter, or leaving the box); the same title writes nothing (nor moves its chat up)."""
        store = self.loaded(store)
        kept = conversations.renamed(store, title)
        if conversations.active(kept)["title"] == conversations.active(store)["title"]:
            return gr.skip(), gr.skip(), conversations.active(store)["title"]
        return kept, gr.update(choices=conversations.choices(kept), value=kept["active"]), \
            conversations.active(kept)["title"]

    def delete(self, store: Any, pending: Optional[dict], confirmed: bool):
        if pending is not None or not confirmed:
            return self.unchanged()
        return self.view(conversations.deleted(self.loaded(store), self.prompts.system_prompt, self.defaults))

    def save_settings(self, name: str, store: Any, system_prompt: Any, *controls):
        """Saves what was typed or chosen in control `name` (the system prompt or a setting) into the
        conversation, and only that: the other boxes may hold what another tab changed since, not yet merged
        here. The values come as the page holds them (the event skips Gradio's checks, which would refuse a
        slider's box typed past its range, and log it): a number outside its slider's range is saved at the
        nearest end, and the box shows it; an emptied box keeps the value it had. Where `name` holds the value
        saved already, the page set it (a load, a switch, a merge) and nothing is written, so the app's other tabs
        are not told of a change."""
        store = self.loaded(store)
        conversation = conversations.active(store)
        if name == "system_prompt":
            value = conversations.kept_setting(name, system_prompt, conversation["system_prompt"])
            if value == conversation["system_prompt"]:
                return [gr.skip()] * (1 + len(controls))
            saved = dict(conversation, system_prompt=value)
            return [conversations.with_conversation(store, saved), *[gr.skip()] * len(controls)]
        settings = dict(self.defaults, **conversation["settings"])
        at = conversations.SETTINGS.index(name)
        value = conversations.kept_setting(name, controls[at], settings[name], self.bounds.get(name))
        shown = [gr.skip()] * len(controls)
        if value != controls[at]:  # a box's fix
            shown[at] = value
        if value == settings[name]:
            return [gr.skip(), *shown]
        saved = dict(conversation, settings=settings_of(settings[setting] if setting != name else value
                                                        for setting in conversations.SETTINGS))
        return [conversations.with_conversation(store, saved), *shown]

    def export(self, store: Any, kind: str):
        return gr.update(value=self.exports.write(conversations.active(self.loaded(store)), kind), visible=True)

    def import_file(self, data: Optional[bytes], store: Any, pending: Optional[dict]):
        if pending is not None or data is None:
            return self.unchanged()
        store = self.loaded(store)
        try:
            conversation = conversations.from_json(data)
        except conversations.ConversationFileError as exc:
            return self.view(store, stats=f"**Not imported:** {conversations.as_markdown_text(str(exc))}.")
        there = conversations.same_in_store(store, conversation)
        if there is not None:  # shown, not copied
            return self.view(dict(store, active=there["id"]), stats=f"Not imported: “"
                             f"{conversations.as_markdown_text(there['title'])}” is here already, the same (shown).")
        return self.view(conversations.with_conversation(store, conversation),
                         stats=f"Imported “{conversations.as_markdown_text(conversation['title'])}”.")
