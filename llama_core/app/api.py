"""The app's Gradio API: /chat and /complete on a running engine (ui.build_demo adds them to the app).

Both stream; bad input raises gr.Error naming the problem (AppError in the client), and max_new_tokens null
means llama_core's default:
  /chat(message, history, system_prompt, temperature, top_p, max_new_tokens) -> str
      Yields the assistant's reply so far. history: earlier {"role": "user"|"assistant", "content"} messages,
      alternating and ending with a reply; content a string or a list of Gradio text parts.
  /complete(prompt, temperature, top_p, max_new_tokens, echo, show_probabilities) -> (str, list, dict)
      Yields (text, tokens, stats): text so far (after the prompt with echo); tokens, with show_probabilities,
      [{"token": text, "probability": p, "generated": bool}] (with echo the prompt's tokens come first),
      else []; stats: prompt_tokens, generated_tokens, max_seq_len, tokens_per_second, finish_reason.
"""

from __future__ import annotations

from typing import AsyncIterator, Optional

import gradio as gr

from ..serving import aio
from ..serving.streams import TextEngine
from . import streaming


class ApiRoutes:
    """The API's two routes. They run on the server's event loop (async): no worker thread between a request and
    the engine, or between a token and its client. Their requests go through llama_core.app.streaming, looked up
    there at run time."""

    def __init__(self, engine: TextEngine) -> None:
        self.engine = engine

    async def chat(self, message: str, history: list[dict], system_prompt: str, temperature: float, top_p: float,
                   max_new_tokens: int, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                   presence_penalty: float = 0.0, frequency_penalty: float = 0.0, stop: Optional[list[str]] = None,
                   seed: Optional[int] = None, output_format: str = "text", output_grammar: str = "",
                   request: gr.Request = None) -> AsyncIterator[str]:
        """Streams the assistant's reply to message after history: yields the reply so far. output_format:
        text, json (any JSON object), json_schema, regex or lark, the last three held to output_grammar."""
        stream = await aio.submitted(
            lambda: streaming.start_chat(self.engine, message, history, system_prompt, temperature, top_p,
                                         max_new_tokens, top_k=top_k, min_p=min_p,
                                         repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                         frequency_penalty=frequency_penalty, stop=stop, seed=seed,
                                         output_format=output_format, output_grammar=output_grammar,
                                         client=streaming.client_of(request)),
            aio.preparing_size(aio.text_size(message, history, system_prompt, output_grammar),
                               streaming.asks_grammar({"output_format": output_format})))
        async for reply in streaming.replies(stream):
            yield reply

    async def complete(self, prompt: str, temperature: float, top_p: float, max_new_tokens: int, echo: bool,
                       show_probabilities: bool, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                       presence_penalty: float = 0.0, frequency_penalty: float = 0.0, stop: Optional[list[str]] = None,
                       seed: Optional[int] = None, output_format: str = "text", output_grammar: str = "",
                       request: gr.Request = None) -> AsyncIterator[tuple[str, list[dict], dict]]:
        """Streams a completion of prompt: yields (text, tokens with probabilities, stats). output_format: as
        for /chat."""
        async for update in streaming.complete(self.engine, prompt, temperature, top_p, max_new_tokens, echo,
                                               show_probabilities, top_k=top_k, min_p=min_p,
                                               repetition_penalty=repetition_penalty,
                                               presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                               stop=stop, seed=seed, output_format=output_format,
                                               output_grammar=output_grammar, client=streaming.client_of(request)):
            yield update
