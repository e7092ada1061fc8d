"""The chat tab's saved conversations: the store kept in the browser, the export file's schema (JSON and
Markdown), its import with clear messages for bad files, and the notices shown for a turn that was not run.

A conversation is a dict:
  {"id", "title", "system_prompt", "settings": {name: value}, "messages": [{"role", "content"}], "tree",
   "stats", "updated", "edited": {part: time}}
its messages the branch shown, complete (user, assistant) exchanges; its tree (llama_core.app.branches) every
message kept, an edited message or a retried reply beside the old one. The store holds them all:
  {"version": STORE_VERSION, "active": id, "conversations": [conversation, ...], "deleted": {id: time}}
the conversations most recent first, "deleted" (where any was) the latest deleted ones' ids and when, so that a
tab that still holds one does not bring it back as its store is merged (merged); "edited" says when each of a
conversation's PARTS was last changed, so that two tabs' changes to its parts are both kept.
Everything here returns new values and never changes its arguments (Gradio shares the values it passes).
"""

from __future__ import annotations

import atexit
import html
import json
import math
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from ..dialog import SPECIAL_TAGS, encode_dialog, reply_room
from ..errors import ContextLengthError, DialogError, LlamaError
from ..serving import requests
from ..serving.requests import whole_number
from ..serving.streams import TextEngine, chat_prompt
from ..tokenizer import Tokenizer
from . import branches
from .display import AT_TOKEN_LIMIT, STOPPED_STATS, plural

SCHEMA = "llama-core/conversation"  # an export file's "schema" field
SCHEMA_VERSION = 2  # an export file's "version" field: 2 added "tree" (branches)
READ_VERSIONS = (1, 2)  # the versions import reads
STORE_VERSION = 1
MAX_IMPORT_BYTES = 2_000_000  # the largest export file accepted
MAX_TITLE_CHARS = 80
MAX_DELETED = 1000  # the deleted conversations a store remembers, the latest
# A conversation's parts changed apart (its keys): as two tabs' stores merge, each part is kept as changed last.
PARTS = {"title": ("title",), "system_prompt": ("system_prompt",), "settings": ("settings",),
         "messages": ("messages", "tree", "stats")}
# The sampling controls a conversation keeps, as the chat tab's controls name them (stop: one string per line).
SETTINGS = ("temperature", "top_p", "max_new_tokens", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "stop", "seed", "output_format", "output_grammar")
SLIDERS = ("temperature", "top_p", "max_new_tokens", "top_k", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty")  # the SETTINGS the page sets with sliders
NOTICE_MARK = "⚠️ "  # opens the chat's notice under a turn refused or failed (a message of its own, never kept)
NEW_TITLE = "New chat"
MESSAGE_PLACEHOLDER = "…"  # the prompt shown before a message is typed has this in its place


class ConversationFileError(LlamaError, ValueError):
    """An imported file is not a conversation this app exported: the message names what is wrong."""


# -- conversations and the store ---------------------------------------------------------------------------
def new_conversation(system_prompt: str, settings: dict[str, Any], title: str = NEW_TITLE,
                     messages: Optional[list[dict]] = None) -> dict:
    return {"id": uuid.uuid4().hex, "title": title, "system_prompt": system_prompt,
            "settings": {k: v for k, v in settings.items() if k in SETTINGS}, "messages": list(messages or []),
            "updated": time.time(), "stats": ""}


def new_store(system_prompt: str, settings: dict[str, Any]) -> dict:
    conversation = new_conversation(system_prompt, settings)
    return {"version": STORE_VERSION, "active": conversation["id"], "conversations": [conversation]}


def loaded_store(value: Any, system_prompt: str, settings: dict[str, Any]) -> dict:
    """The store read from the browser; a new one when there is none, or it is unreadable (an older version,
    edited by hand): the page must open whatever the browser holds. Unreadable conversations are left out."""
    return _read_store(value) or new_store(system_prompt, settings)


def sent_store(text: Any) -> Optional[dict]:
    """The store another tab of the page sent as it saved it (its JSON text), read as loaded_store reads one;
    None where it holds no conversation."""
    try:
        return _read_store(json.loads(text)) if type(text) is str else None
    except ValueError:
        return None


def _read_store(value: Any) -> Optional[dict]:
    if type(value) is not dict or value.get("version") != STORE_VERSION or type(value.get("conversations")) is not list:
        return None
    kept = []
    for item in value["conversations"]:
        try:
            kept.append(_checked_conversation(item, "conversation"))
        except ConversationFileError:
            continue
    if not kept:
        return None
    active = value.get("active") if any(c["id"] == value.get("active") for c in kept) else kept[0]["id"]
    store = {"version": STORE_VERSION, "active": active, "conversations": kept}
    deleted = value.get("deleted")
    if type(deleted) is dict:
        deleted = {key: at for key, at in deleted.items()
                   if type(key) is str and type(at) in (int, float) and math.isfinite(at)}
        if deleted:
            store["deleted"] = _latest(deleted)
    return store


def _merged_conversation(mine: dict, theirs: dict) -> dict:
    """One conversation as two tabs hold it: each part as changed last (mine on a tie)."""
    if mine == theirs:
        return mine
    kept = dict(mine if mine["updated"] >= theirs["updated"] else theirs, updated=max(mine["updated"], theirs["updated"]))
    edited = {}
    for part, keys in PARTS.items():
        times = [c.get("edited", {}).get(part, c["updated"]) for c in (mine, theirs)]
        source = mine if times[0] >= times[1] else theirs
        for key in keys:
            if key in source:
                kept[key] = source[key]
            else:
                kept.pop(key, None)
        edited[part] = max(times)
    kept["edited"] = edited
    return kept


def _latest(deleted: dict[str, float]) -> dict[str, float]:
    if len(deleted) <= MAX_DELETED:
        return deleted
    return dict(sorted(deleted.items(), key=lambda item: item[1], reverse=True)[:MAX_DELETED])


def merged(mine: dict, theirs: dict, system_prompt: str, settings: dict[str, Any]) -> dict:
    """Another tab's store merged into this tab's: each conversation's parts (PARTS) as changed last in either
    (this tab's on a tie); a conversation deleted in either gone, unless saved since; the chat shown still this
    tab's, unless it is gone (then the other tab's). Both deleted all: a new conversation."""
    deleted = dict(theirs.get("deleted", {}))
    for key, at in mine.get("deleted", {}).items():
        deleted[key] = max(at, deleted.get(key, at))
    latest: dict[str, dict] = {}
    for conversation in theirs["conversations"] + mine["conversations"]:
        known = latest.get(conversation["id"])
        latest[conversation["id"]] = conversation if known is None else _merged_conversation(conversation, known)
    for key, conversation in list(latest.items()):
        if key in deleted and conversation["updated"] <= deleted[key]:
            del latest[key]
        else:
            deleted.pop(key, None)  # saved after it was deleted (a reply that ended there): kept
    store = {"version": STORE_VERSION, "active": None,
             "conversations": sorted(latest.values(), key=lambda c: c["updated"], reverse=True)}
    if not store["conversations"]:
        store = new_store(system_prompt, settings)
    if deleted:
        store["deleted"] = _latest(deleted)
    store["active"] = next((s["active"] for s in (mine, theirs) if s["active"] in latest),
                           store["conversations"][0]["id"])
    return _read_store(store)  # each conversation's keys in one order: a merge that changes nothing reads the same


def active(store: dict) -> dict:
    return next(c for c in store["conversations"] if c["id"] == store["active"])


def with_conversation(store: dict, conversation: dict, *, activate: bool = True) -> dict:
    """The store with this conversation saved (replacing the one of its id) and moved first; the parts it
    changed marked as edited now."""
    now = time.time()
    before = next((c for c in store["conversations"] if c["id"] == conversation["id"]), {})
    edited = {part: now if any(conversation.get(key) != before.get(key) for key in keys)
              else conversation.get("edited", {}).get(part, before.get("updated", now))
              for part, keys in PARTS.items()}
    conversation = dict(conversation, updated=now, edited=edited)
    others = [c for c in store["conversations"] if c["id"] != conversation["id"]]
    return dict(store, conversations=[conversation] + others,
                active=conversation["id"] if activate else store["active"])


def same_in_store(store: dict, conversation: dict) -> Optional[dict]:
    """The store's conversation holding what this one holds (title, system prompt, settings, messages and their
    versions), if any: an export file imported twice, or where it was exported, is there already."""
    def content(c: dict) -> dict:
        return {k: v for k, v in c.items() if k not in ("id", "updated", "edited", "stats")}
    return next((c for c in store["conversations"] if content(c) == content(conversation)), None)


def with_reply_kept(store: dict, finished: dict) -> dict:
    """The store with a finished reply kept in its conversation, as the store is now (what changed while it
    streamed stays). A conversation the store no longer holds is kept as the reply left it: the page wrote
    another store meanwhile (a fresh browser's first store, made by the page's load while the first message
    was sent, had another id), and a reply shown is never thrown away; an untouched new chat it replaces."""
    conversation = next((c for c in store["conversations"] if c["id"] == finished["id"]), None)
    if conversation is not None:
        return with_conversation(store, with_finished_reply(conversation, finished))
    kept = _checked_conversation(finished["conversation"], "conversation")
    if is_new(active(store)):
        store = dict(store, conversations=[c for c in store["conversations"] if c["id"] != store["active"]])
    return with_conversation(store, kept)  # deleted in another tab as the reply streamed: saved after, so kept


def switched(store: dict, conversation_id: Any) -> dict:
    if not any(c["id"] == conversation_id for c in store["conversations"]):
        return store
    return dict(store, active=conversation_id)


def renamed(store: dict, title: Any) -> dict:
    """The active conversation given title (a blank one keeps the title it had)."""
    conversation = active(store)
    return with_conversation(store, dict(conversation, title=clean_title(title, conversation["title"])))


def deleted(store: dict, system_prompt: str, settings: dict[str, Any]) -> dict:
    """The store without its active conversation, remembered as deleted; the next one (or a new one) becomes
    active."""
    gone = _latest(dict(store.get("deleted", {}), **{store["active"]: time.time()}))
    others = [c for c in store["conversations"] if c["id"] != store["active"]]
    if not others:
        return dict(new_store(system_prompt, settings), deleted=gone)
    return dict(store, conversations=others, active=others[0]["id"], deleted=gone)


def choices(store: dict) -> list[tuple[str, str]]:
    """(title, id) for each conversation, most recent first: the sidebar's list."""
    return [(c["title"], c["id"]) for c in store["conversations"]]


def is_new(conversation: dict) -> bool:
    """Nothing said and no title given yet (a cleared chat keeps its title: a new one is another chat)."""
    return not conversation["messages"] and conversation["title"] == NEW_TITLE


def clean_title(title: Any, fallback: str = NEW_TITLE) -> str:
    text = " ".join(title.split()) if type(title) is str else ""
    if len(text) > MAX_TITLE_CHARS:
        text = text[: MAX_TITLE_CHARS - 1].rstrip() + "…"
    return text or fallback


def with_exchange(conversation: dict, keep: int, message: str, reply: str, stats: str = "") -> dict:
    """The conversation showing its first `keep` messages and one more (user, assistant) exchange, `stats`
    describing the reply. What followed message `keep` stays in the tree as another branch; a message equal to
    one already there (the one it replaces: a retry; or one put back by Undo and sent again) is that one, and
    only the reply is new. A new chat takes its title from its first message."""
    title = conversation["title"]
    if title == NEW_TITLE and keep == 0:
        title = clean_title(message)
    tree = branches.tree_of(conversation)
    shown = branches.branch(tree)
    nodes, chosen = list(tree["nodes"]), dict(tree["chosen"])
    parent = shown[keep - 1]["id"] if keep else branches.ROOT
    new_id = max((n["id"] for n in nodes), default=branches.ROOT) + 1
    same = [n["id"] for n in nodes if n["parent"] == parent and n["role"] == "user" and n["content"] == message]
    if same:
        user = same[0]
    else:
        user, new_id = new_id, new_id + 1
        nodes.append({"id": user, "parent": parent, "role": "user", "content": message, "stats": ""})
    nodes.append({"id": new_id, "parent": user, "role": "assistant", "content": reply, "stats": stats})
    chosen.update({str(parent): user, str(user): new_id})
    return branches.with_tree(dict(conversation, title=title), {"nodes": nodes, "chosen": chosen})


def with_finished_reply(conversation: dict, finished: dict) -> dict:
    """The conversation with a finished turn's reply ({"keep", "message", "reply", "stats"}) as with_exchange
    keeps it; one that went on from a reply cut short ("continues": that reply's node id) in that reply's place,
    where the conversation still holds it (else beside it, as a retry's)."""
    at = finished.get("continues")
    tree = branches.tree_of(conversation)
    if at is not None and any(n["id"] == at and n["role"] == "assistant" for n in tree["nodes"]):
        nodes = [dict(n, content=finished["reply"], stats=finished["stats"]) if n["id"] == at else n
                 for n in tree["nodes"]]
        return branches.with_tree(conversation, dict(tree, nodes=nodes))
    return with_exchange(conversation, finished["keep"], finished["message"], finished["reply"], finished["stats"])


def cut_short(conversation: dict) -> bool:
    """Whether the conversation's last reply was cut short, by the token limit or by Stop (its stats line says
    so): Continue makes it go on. One the context's end cut has no room to."""
    stats = conversation.get("stats") or ""
    return bool(conversation["messages"]) and (AT_TOKEN_LIMIT in stats or stats.startswith(STOPPED_STATS))


def kept_setting(name: str, value: Any, previous: Any, bounds: Optional[tuple] = None) -> Any:
    """A setting (or the system prompt) as the page sent it, made one its control holds: a slider's number
    within its (minimum, maximum, step) bounds, whole where the step is 1; a seed a whole number or none;
    text as it is. Anything unreadable (an emptied number box, say) is the previous value."""
    if bounds is not None:
        minimum, maximum, step = bounds
        try:
            number = float(value)
        except (TypeError, ValueError):
            return previous
        if type(value) is bool or not math.isfinite(number):
            return previous
        number = min(max(number, minimum), maximum)
        return int(round(number)) if step == 1 else number
    if name == "seed":
        if value is None or value == "":
            return None
        try:
            seed = value if type(value) is int else int(float(value))
        except (TypeError, ValueError, OverflowError):
            return previous
        return seed if 0 <= seed <= requests.MAX_SEED else previous  # a box typed past 64 bits: not savable
    return value if type(value) is str else previous


def refused_turn(shown: Any, messages: list[dict]) -> Optional[str]:
    """The message of a turn the chat shows refused or failed (NOTICE_MARK's notice below it; the
    conversation's messages hold neither), or None."""
    if type(shown) is not list or len(shown) != len(messages) + 2:
        return None
    try:
        notice = requests.text(shown[-1]["content"], "notice")
        message = requests.text(shown[-2]["content"], "message")
    except (LlamaError, KeyError, TypeError):
        return None
    return message if shown[-1].get("role") == "assistant" and notice.startswith(NOTICE_MARK) else None


def has_reserved_tags(text: str) -> bool:
    return any(tag in text for tag in SPECIAL_TAGS)


def model_history(messages: list[dict]) -> tuple[list[dict], int]:
    """The exchanges the model is shown and how many were left out: those holding a reserved chat-format tag
    (a reply written before replies stopped at tags, an imported file) would make every later turn refused."""
    pairs = [messages[i : i + 2] for i in range(0, len(messages) - 1, 2)]
    kept = [p for p in pairs if not any(has_reserved_tags(m["content"]) for m in p)]
    return [m for pair in kept for m in pair], len(pairs) - len(kept)


# -- notices for a turn that was not run ---------------------------------------------------------------------
def context_notice(tokenizer: Tokenizer, max_seq_len: int, message: str, system_prompt: str,
                   max_new_tokens: Any) -> str:
    """too_long_notice for a message that, with the system prompt, did not fit beside the reply's room."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
    tokens = len(encode_dialog(tokenizer, system + [{"role": "user", "content": message}]))
    return too_long_notice(tokens, max_seq_len, reply_room(max_seq_len, whole_number(max_new_tokens)), bool(system))


def too_long_notice(message_tokens: int, max_seq_len: int, reply_room: int, with_system_prompt: bool) -> str:
    """What to tell a user whose message (with the system prompt) leaves no room in the context."""
    what = "This message with the system prompt is" if with_system_prompt else "This message is"
    fits = max_seq_len - reply_room
    return (f"{what} {message_tokens:,} tokens; the model holds {max_seq_len:,}, and keeps {reply_room:,} for the "
            f"reply, so at most {fits:,} fit. Shorten it by about {message_tokens - fits:,} tokens"
            + (" (or shorten the system prompt)" if with_system_prompt else "") + " and send it again.")


REFUSED_NOTICE = ("This message holds reserved chat-format tags ([INST], [/INST], <<SYS>> or <</SYS>>) and was not "
                  "sent. Remove them and send it again.")
REFUSED_SYSTEM_NOTICE = ("The system prompt holds reserved chat-format tags ([INST], [/INST], <<SYS>> or <</SYS>>), "
                         "so no message can be sent. Remove them from the system prompt.")


# -- the prompt the model sees ---------------------------------------------------------------------------------
def prompt_preview(engine: TextEngine, message: Any, messages: list[dict], system_prompt: Any,
                   max_new_tokens: Any) -> str:
    """Markdown showing the exact prompt the next turn would give the model (the chat's history as the chat
    tab sends it, the system prompt and `message`), its token count, and the old exchanges dropped to fit."""
    history, left_out = model_history(messages)
    placeholder = not isinstance(message, str) or not message.strip()
    if placeholder:  # the history and system prompt are still worth seeing before anything is typed
        message = MESSAGE_PLACEHOLDER
    try:
        dialog = requests.chat_dialog(message, history, system_prompt)
        prompt = chat_prompt(engine, dialog, max_new_tokens)
    except ContextLengthError:
        return "**No prompt:** " + context_notice(engine.tokenizer, engine.info.max_seq_len, message,
                                                  system_prompt, max_new_tokens)
    except DialogError:
        return "**No prompt:** " + (REFUSED_SYSTEM_NOTICE if has_reserved_tags(system_prompt) else REFUSED_NOTICE)
    except LlamaError as exc:
        return f"**No prompt to show:** {exc}."
    lines = [f"**The prompt for the next turn: {len(prompt.prompt_tokens):,} tokens** of the model's "
             f"{prompt.max_seq_len:,} ({prompt.reply_room:,} kept for the reply)."]
    if placeholder:
        lines.append(f"The message box is empty: {MESSAGE_PLACEHOLDER} stands where your message will be.")
    if left_out:
        verb = "is" if left_out == 1 else "are"
        lines.append(f"{plural(left_out, 'exchange')} holding reserved chat-format tags {verb} left out.")
    if prompt.dropped:
        pairs = len(prompt.dropped) // 2
        verbs = ("does", "is") if pairs == 1 else ("do", "are")
        lines.append(f"**{plural(pairs, 'earlier exchange')} {verbs[0]} not fit ({prompt.dropped_tokens:,} tokens) "
                     f"and {verbs[1]} dropped:**")
        lines.append('<div class="dropped-turns">' + "".join(
            f"<p><del><b>{m['role'].capitalize()}:</b> {_html_lines(m['content'])}</del></p>" for m in prompt.dropped)
            + "</div>")
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", prompt.text)), default=0))
    lines.append(f"{fence}text\n{prompt.text}\n{fence}")
    return "\n\n".join(lines)


def as_markdown_text(text: str) -> str:
    """text shown as it is in Markdown: no HTML tags, links or emphasis made of it (a title from an imported
    file, say)."""
    return re.sub(r"([\\`*_{}\[\]()#+\-.!|~>])", r"\\\1", html.escape(text, quote=False))


def _html_lines(text: str) -> str:
    return "<br>".join(html.escape(line) for line in text.strip().splitlines())


# -- export and import --------------------------------------------------------------------------------------
def to_json(conversation: dict) -> str:
    """The conversation as an export file: our versioned schema, which from_json reads back. "messages" is the
    branch shown (all a version 1 reader knows), "tree" every branch."""
    return json.dumps({"schema": SCHEMA, "version": SCHEMA_VERSION, "title": conversation["title"],
                       "system_prompt": conversation["system_prompt"], "settings": conversation["settings"],
                       "messages": conversation["messages"], "tree": branches.tree_of(conversation)},
                      ensure_ascii=False, indent=2) + "\n"


def to_markdown(conversation: dict) -> str:
    """The conversation as Markdown, each message as the chat shows it (its HTML too: viewers clean it as the
    chat does); the title one heading of plain text."""
    lines = [f"# {as_markdown_text(clean_title(conversation['title']))}", ""]
    if conversation["system_prompt"].strip():
        lines += ["**System prompt:**", "", _quoted(conversation["system_prompt"]), ""]
    for message in conversation["messages"]:
        lines += [f"**{message['role'].capitalize()}:**", "", _fences_closed(message["content"].strip()), ""]
    return "\n".join(lines)


_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})([^`]*)$")  # a code fence's line: the fence, its info string


def _fences_closed(markdown: str) -> str:
    """markdown with a code block it leaves open closed at its end (a reply cut off at its token limit): left
    open, it took in the messages after it, until a fence of theirs."""
    opened = None
    for line in markdown.splitlines():
        fence = _FENCE.match(line)
        if fence is None:
            continue
        if opened is None:
            opened = fence.group(1)
        elif fence.group(1)[0] == opened[0] and len(fence.group(1)) >= len(opened) and not fence.group(2).strip():
            opened = None
    return markdown if opened is None else f"{markdown}\n{opened}"


class ExportFiles:
    """Where exported conversations are written for the page to hand over: one folder for the server, each
    export in a folder of its own. Gradio copies a file into its cache as it hands it over, so an export
    older than KEEP_SECONDS is removed at the next one, and the whole folder when the process exits."""

    KEEP_SECONDS = 600

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="llama-chat-export-"))
        atexit.register(shutil.rmtree, self.root, True)

    def write(self, conversation: dict, kind: str) -> str:
        """The path of a new file holding conversation as JSON ("json") or Markdown ("md")."""
        now = time.time()
        for old in self.root.iterdir():
            if now - old.stat().st_mtime > self.KEEP_SECONDS:
                shutil.rmtree(old, ignore_errors=True)
        path = Path(tempfile.mkdtemp(dir=self.root)) / file_name(conversation, kind)
        path.write_text(to_json(conversation) if kind == "json" else to_markdown(conversation), encoding="utf-8")
        return str(path)


def file_name(conversation: dict, extension: str) -> str:
    stem = re.sub(r"[^\w-]+", "-", conversation["title"]).strip("-")[:40] or "conversation"
    return f"{stem}.{extension}"


def from_json(data: bytes | str) -> dict:
    """A conversation (with a new id) from an export file; ConversationFileError names what is wrong."""
    if len(data) > MAX_IMPORT_BYTES:
        raise ConversationFileError(f"the file is too large: {len(data):,} bytes, at most {MAX_IMPORT_BYTES:,}")
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConversationFileError(f"the file is not JSON ({exc}); choose a conversation exported as JSON") from None
    except RecursionError:
        raise ConversationFileError("the file is not a conversation: its JSON is nested too deeply") from None
    if type(value) is not dict or value.get("schema") != SCHEMA:
        raise ConversationFileError(f"the file is not a conversation exported by this app (its \"schema\" must be "
                                    f"\"{SCHEMA}\")")
    if value.get("version") not in READ_VERSIONS or type(value.get("version")) is not int:
        raise ConversationFileError(f"the file has version {value.get('version')!r}; this app reads versions "
                                    f"{' and '.join(map(str, READ_VERSIONS))}")
    if value["version"] == 1:
        value = {k: v for k, v in value.items() if k != "tree"}
    conversation = _checked_conversation(dict(value, id=uuid.uuid4().hex, updated=time.time()), "the file")
    return conversation


def _checked_conversation(value: Any, where: str) -> dict:
    if type(value) is not dict:
        raise ConversationFileError(f"{where} must be a JSON object")
    for name in ("id", "title", "system_prompt"):
        if type(value.get(name)) is not str:
            raise ConversationFileError(f"{where}: \"{name}\" must be a string")
    settings = value.get("settings", {})
    if type(settings) is not dict:
        raise ConversationFileError(f"{where}: \"settings\" must be an object")
    for name in settings:
        if name not in SETTINGS:
            raise ConversationFileError(f"{where}: unknown setting \"{name}\"; known: {', '.join(SETTINGS)}")
    messages = value.get("messages")
    if type(messages) is not list:
        raise ConversationFileError(f"{where}: \"messages\" must be a list")
    if len(messages) > branches.MAX_MESSAGES:
        raise ConversationFileError(f"{where}: a conversation keeps at most {branches.MAX_MESSAGES:,} messages")
    for i, message in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if type(message) is not dict or message.get("role") != expected or type(message.get("content")) is not str:
            raise ConversationFileError(f"{where}: message {i} must be {{\"role\": \"{expected}\", \"content\": "
                                        "text}: messages alternate user and assistant")
    if len(messages) % 2:
        raise ConversationFileError(f"{where}: the last message must be the assistant's reply")
    updated, stats = value.get("updated"), value.get("stats")
    conversation = {"id": value["id"], "title": clean_title(value["title"]), "system_prompt": value["system_prompt"],
                    # a setting no control can hold (NaN, a number past 64 bits, text for a slider) is left
                    # out, its default in its place: the conversation itself is kept
                    "settings": {name: setting for name, setting in settings.items() if _holdable(name, setting)},
                    "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
                    "updated": updated if type(updated) in (int, float) else time.time(),
                    "stats": stats if type(stats) is str else ""}
    edited = value.get("edited")
    if type(edited) is dict:  # a store's, not an export file's
        edited = {part: at for part, at in edited.items()
                  if part in PARTS and type(at) in (int, float) and math.isfinite(at)}
        if edited:
            conversation["edited"] = edited
    if "tree" not in value:
        return conversation
    try:
        return branches.with_tree(conversation, branches.checked_tree(value["tree"]))
    except branches.TreeError as exc:
        raise ConversationFileError(f"{where}: {exc}") from None


def _holdable(name: str, value: Any) -> bool:
    """Whether a saved setting is one its control can hold: a slider's a finite number, the seed's a whole
    number from 0 to MAX_SEED or none, the reply format's a name, the text boxes' text or none (left empty)."""
    if name == "seed":
        return value is None or (type(value) is int and 0 <= value <= requests.MAX_SEED)
    if name in SLIDERS:
        return type(value) in (int, float) and math.isfinite(value) and abs(value) <= requests.MAX_SEED
    return type(value) is str or (value is None and name in ("stop", "output_grammar"))


def _quoted(text: str) -> str:
    return "\n".join("> " + line for line in text.strip().splitlines())
