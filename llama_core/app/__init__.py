"""The web app over llama_core (the `[app]` extra: gradio). Only this subpackage imports gradio.

    cli.py     `llama-chat` and `python app.py`: the arguments, their checks before the model loads,
               the start-up output; imports neither torch nor gradio until the arguments are good
    ui.py      the Gradio interface: components and layout, their events wired to the callbacks of
               chat_tab.py, completion_tab.py and api.py, which call llama_core through streaming.py
    server.py  serving the interface on a host and port

Nothing is imported here, so that `llama-chat --help` answers before torch or gradio would load.
"""
