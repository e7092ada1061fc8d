"""A conversation's branches: every message kept, as a tree, an edited message or a retried reply beside the
one it replaced, and the branch shown.

The tree of a conversation (its "tree"; its "messages" are the branch shown):
  {"nodes": [{"id": int, "parent": id or ROOT, "role", "content", "stats"}], "chosen": {str(parent id): child id}}
The branch shown starts at ROOT and goes on to each node's chosen child (its newest when none is chosen; none at
all where the chosen is null). Nodes come after their parents. Everything here returns new values.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from ..errors import LlamaError

ROOT = -1  # the parent id of a conversation's first messages
MAX_MESSAGES = 10_000  # in a conversation's tree: far past any model's context, and its checks stay quick


class TreeError(LlamaError, ValueError):
    """A saved tree is not one this app wrote: the message names what is wrong."""


def tree_of(conversation: dict) -> dict:
    """The conversation's tree; one saved without one (an older store, a version 1 file) is a single branch."""
    if "tree" in conversation:
        return conversation["tree"]
    nodes = [{"id": i, "parent": i - 1 if i else ROOT, "role": m["role"], "content": m["content"], "stats": ""}
             for i, m in enumerate(conversation["messages"])]
    if nodes:
        nodes[-1]["stats"] = conversation.get("stats", "")
    return {"nodes": nodes, "chosen": {}}


def branch(tree: dict) -> list[dict]:
    """The nodes of the branch shown, first to last."""
    shown, parent, children_of = [], ROOT, _children_index(tree)
    while True:
        children = children_of.get(parent, [])
        if str(parent) in tree["chosen"]:
            node = next((n for n in children if n["id"] == tree["chosen"][str(parent)]), None)
        else:
            node = children[-1] if children else None
        if node is None:
            return shown
        shown.append(node)
        parent = node["id"]


def with_tree(conversation: dict, tree: dict) -> dict:
    """The conversation with this tree, showing its branch and the stats of the branch's last reply."""
    shown = branch(tree)
    return dict(conversation, tree=tree, messages=[{"role": n["role"], "content": n["content"]} for n in shown],
                stats=shown[-1]["stats"] if shown else "")


def cleared(conversation: dict) -> dict:
    return with_tree(conversation, {"nodes": [], "chosen": {}})


def undone(conversation: dict) -> dict:
    """The conversation without the last exchange shown: its reply (and its message, unless other replies to
    it are kept) leave the tree; the branch shown ends before it."""
    tree = tree_of(conversation)
    shown = branch(tree)
    if len(shown) < 2:
        return conversation
    user, reply = shown[-2], shown[-1]
    gone = _with_descendants(tree, {reply["id"]} if len(_children(tree, user["id"])) > 1 else {user["id"]})
    chosen = {k: v for k, v in tree["chosen"].items() if int(k) not in gone and v not in gone}
    chosen[str(user["parent"])] = None
    return with_tree(conversation, {"nodes": [n for n in tree["nodes"] if n["id"] not in gone], "chosen": chosen})


def flipped(conversation: dict, index: int, step: int) -> dict:
    """The conversation showing the branch `step` places after (before, when negative) the one holding message
    `index` of those shown; unchanged where there is none."""
    tree = tree_of(conversation)
    shown = branch(tree)
    if type(index) is not int or index not in range(len(shown)):
        return conversation
    siblings = [n["id"] for n in _children(tree, shown[index]["parent"])]
    position = siblings.index(shown[index]["id"]) + step
    if position not in range(len(siblings)):
        return conversation
    return with_tree(conversation, dict(tree, chosen=dict(tree["chosen"], **{str(shown[index]["parent"]): siblings[position]})))


def branch_position(conversation: dict, index: int) -> tuple[int, int]:
    """(k, n): message `index` of those shown is version k of the n kept at its place (1-based)."""
    tree = tree_of(conversation)
    node = branch(tree)[index]
    siblings = [n["id"] for n in _children(tree, node["parent"])]
    return siblings.index(node["id"]) + 1, len(siblings)


def branch_point(conversation: dict) -> Optional[int]:
    """The message whose versions to offer first: the last one shown that has others; None where none has
    (the bar then waits for a message to be clicked: the last reply has Retry below the chat already)."""
    tree = tree_of(conversation)
    shown, children_of = branch(tree), _children_index(tree)
    forked = [i for i, node in enumerate(shown) if len(children_of[node["parent"]]) > 1]
    return forked[-1] if forked else None


def _children(tree: dict, parent: int) -> list[dict]:
    return [n for n in tree["nodes"] if n["parent"] == parent]


def _children_index(tree: dict) -> dict[int, list[dict]]:
    """Each parent id's children, in order: one pass over the nodes (a long conversation is walked in
    linear time)."""
    children: dict[int, list[dict]] = {}
    for node in tree["nodes"]:
        children.setdefault(node["parent"], []).append(node)
    return children


def _with_descendants(tree: dict, ids: set[int]) -> set[int]:
    children_of, found, todo = _children_index(tree), set(ids), list(ids)
    while todo:
        for child in children_of.get(todo.pop(), []):
            if child["id"] not in found:
                found.add(child["id"])
                todo.append(child["id"])
    return found


def checked_tree(tree: Any) -> dict:
    """A tree read from a file or the browser, checked: as the module docstring describes it, each node after its
    parent, users and replies alternating, every message with a reply, and each chosen child one of its
    parent's. Raises TreeError naming the first problem."""
    if type(tree) is not dict or type(tree.get("nodes")) is not list or type(tree.get("chosen", {})) is not dict:
        raise TreeError('"tree" must be {"nodes": [...], "chosen": {...}}')
    if len(tree["nodes"]) > MAX_MESSAGES:
        raise TreeError(f"a conversation keeps at most {MAX_MESSAGES:,} messages, every version counted; this one "
                        f"has {len(tree['nodes']):,}")
    roles, nodes = {ROOT: "assistant"}, []  # the root is followed by user messages, as a reply is
    for i, node in enumerate(tree["nodes"]):
        if type(node) is not dict or type(node.get("id")) is not int or node["id"] in roles:
            raise TreeError(f"tree node {i} needs an \"id\", a whole number no other node has")
        if type(node.get("parent")) is not int or node["parent"] not in roles:
            raise TreeError(f"tree node {i}: \"parent\" must be the id of an earlier node, or {ROOT}")
        expected = "user" if roles[node["parent"]] == "assistant" else "assistant"
        stats = node.get("stats", "")
        if node.get("role") != expected or type(node.get("content")) is not str or type(stats) is not str:
            raise TreeError(f"tree node {i} must be {{\"role\": \"{expected}\", \"content\": text}}: messages "
                            "alternate user and assistant")
        roles[node["id"]] = expected
        nodes.append({"id": node["id"], "parent": node["parent"], "role": expected, "content": node["content"],
                      "stats": stats})
    children: dict[int, list[int]] = {id_: [] for id_ in roles}
    for node in nodes:
        children[node["parent"]].append(node["id"])
    unanswered = [i for i, n in enumerate(nodes) if n["role"] == "user" and not children[n["id"]]]
    if unanswered:
        raise TreeError(f"tree node {unanswered[0]} is a user message with no reply")
    chosen = {}
    for key, child in tree.get("chosen", {}).items():
        parent = int(key) if re.fullmatch(r"-?\d+", key) else None
        # null ends the branch shown: after a reply (or at the root), never after a user's message
        ends = child is None and roles.get(parent) == "assistant"
        if parent not in roles or not (ends or (type(child) is int and child in children[parent])):
            raise TreeError(f"tree \"chosen\" {key!r}: {child!r} is not one of its replies")
        chosen[key] = child
    return {"nodes": nodes, "chosen": chosen}
