"""The web app over llama_core (the `[app]` extra: gradio). Only this subpackage imports gradio.

    cli.py     `llama-chat` and `python app.py`: the arguments, their checks before the model loads,
               the start-up output; imports neither torch nor gradio until the arguments are good
    ui.py      the Gradio interface: components, layout and callbacks that call llama_core
    server.py  serving the interface on a host and port

Nothing is imported here, so that `llama-chat --help` answers before torch or gradio would load.
"""
