"""The completion tab's callbacks: a completion streamed into the tab, Generate and Stop, Continue, and a token's
alternatives."""

from __future__ import annotations

from typing import Optional

import gradio as gr

from ..serving.streams import TextEngine
from . import streaming
from .display import PROBABILITY_LABELS, alternatives_table, marked_completion, stats_line


def _highlights(tokens: list[dict]) -> list[tuple[str, str]]:
    """(text, probability label) pairs; a newline shows as ↵ so that its token keeps a visible chip."""
    return [(t["token"].replace("\n", "↵\n"), PROBABILITY_LABELS[round(100 * t["probability"])])
            for t in tokens if t["token"]]


def completion_running(busy: bool) -> list:
    """Generate and Stop swap in place, as Send and Stop do; Continue waits for the end."""
    return [gr.update(visible=not busy), gr.update(visible=busy), gr.update(interactive=not busy)]


def continued_prompt(prompt: str, completed: Optional[dict]):
    """The prompt with its last generation appended (the box as it is when it was not generated from it)."""
    if completed is not None and completed["prompt"] == prompt:
        return prompt + completed["text"]
    return gr.skip()


def alternatives_of(shown: list[dict], selected: gr.SelectData) -> str:
    if selected.index not in range(len(shown)):
        return ""
    return alternatives_table(shown[selected.index])


class CompletionTab:
    """The completion tab's streaming callback on a running engine. Its requests go through
    llama_core.app.streaming, looked up there at run time."""

    def __init__(self, engine: TextEngine) -> None:
        self.engine = engine

    async def complete_ui(self, request: gr.Request, prompt, temperature, top_p, max_new_tokens, *advanced_and_flags):
        """Streams a completion into the tab; a request that is refused or fails says why under the buttons,
        the last output left as it was."""
        *advanced, echo, show_probabilities = advanced_and_flags
        updates = streaming.complete(self.engine, prompt, temperature, top_p, max_new_tokens, echo, show_probabilities,
                                     client=streaming.client_of(request), **streaming.advanced_controls(advanced))
        shown, stats = [], None
        try:
            async for text, tokens, stats in updates:
                shown = [t for t in tokens if t["token"]]
                generated = text[len(prompt):] if echo else text
                yield (text, _highlights(shown), gr.skip(), shown, marked_completion(prompt, generated),
                       {"prompt": prompt, "text": generated})
        except gr.Error as exc:
            said = "The completion failed" if stats is not None else "Not generated"
            yield gr.skip(), gr.skip(), f"**{said}:** {streaming.on_page(exc.message)}", gr.skip(), gr.skip(), gr.skip()
            return
        yield gr.skip(), gr.skip(), stats_line(stats), gr.skip(), gr.skip(), gr.skip()
