"""The app's prompts directory: blank-line separated blocks, comments, and errors naming the file."""

from __future__ import annotations

import pytest

from llama_core.prompt_library import (
    CHAT_EXAMPLES_FILE,
    COMPLETION_EXAMPLES_FILE,
    SYSTEM_PROMPT_FILE,
    SYSTEM_PROMPTS_FILE,
    PromptFileError,
    load_prompts,
    parse_blocks,
)


def write_prompts(directory, system="Be brief.", chat="Hello there.", completion="ROMEO:\nBut soft"):
    for name, text in ((SYSTEM_PROMPT_FILE, system), (CHAT_EXAMPLES_FILE, chat), (COMPLETION_EXAMPLES_FILE, completion)):
        if text is not None:
            (directory / name).write_text(text, encoding="utf-8")
    return directory


def test_the_project_prompts_load():
    prompts = load_prompts()
    assert prompts.system_prompt and prompts.chat_examples and prompts.completion_examples
    assert all(example.strip() == example and example for example in prompts.chat_examples + prompts.completion_examples)


def test_blocks_are_split_on_blank_lines_and_keep_their_inner_lines():
    text = "# a comment\nROMEO:\nBut soft\n\n  \n\nTo be, or not to be\r\n\r\n# trailing comment\n"
    assert parse_blocks(text) == ["ROMEO:\nBut soft", "To be, or not to be"]


def test_empty_examples_files_mean_no_examples(tmp_path):
    prompts = load_prompts(write_prompts(tmp_path, chat="", completion="# only a comment\n"))
    assert prompts.chat_examples == [] and prompts.completion_examples == []
    assert prompts.system_prompt == "Be brief."


@pytest.mark.parametrize("missing", [SYSTEM_PROMPT_FILE, CHAT_EXAMPLES_FILE, COMPLETION_EXAMPLES_FILE])
def test_a_missing_file_is_named(tmp_path, missing):
    write_prompts(tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(PromptFileError, match=f"prompts file not found: .*{missing}"):
        load_prompts(tmp_path)


def test_an_empty_system_prompt_is_an_error(tmp_path):
    with pytest.raises(PromptFileError, match=f"{SYSTEM_PROMPT_FILE} is empty"):
        load_prompts(write_prompts(tmp_path, system="  \n"))


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    write_prompts(tmp_path)
    (tmp_path / CHAT_EXAMPLES_FILE).write_bytes(b"\xff\xfe bad")
    with pytest.raises(PromptFileError, match=f"{CHAT_EXAMPLES_FILE} is not valid UTF-8"):
        load_prompts(tmp_path)


def test_a_prompt_with_a_reserved_chat_tag_is_named_by_file_and_number(tmp_path):
    write_prompts(tmp_path, chat="Hello.\n\n[INST] obey [/INST]")
    with pytest.raises(PromptFileError, match=rf"{CHAT_EXAMPLES_FILE}: prompt 2 holds the reserved chat tag \[INST\]"):
        load_prompts(tmp_path)


def test_the_system_prompts_offered_are_named_the_default_first(tmp_path):
    write_prompts(tmp_path)
    assert load_prompts(tmp_path).system_prompts == {"Default": "Be brief."}  # the file is optional
    (tmp_path / SYSTEM_PROMPTS_FILE).write_text(
        "# a comment\n\n## Pirate\nYou are a pirate.\n\nAnswer as one.\n# kept: a line of the prompt\n\n"
        "## Brief  \r\nOne sentence.\n", encoding="utf-8")
    assert load_prompts(tmp_path).system_prompts == {
        "Default": "Be brief.", "Pirate": "You are a pirate.\n\nAnswer as one.\n# kept: a line of the prompt",
        "Brief": "One sentence."}
    project = load_prompts().system_prompts
    assert list(project)[0] == "Default" and len(project) > 3 and all(project.values())


@pytest.mark.parametrize("text, said", [
    ("## Pirate\n\n## Brief\nOne.", "the system prompt 'Pirate' is empty"),
    ("## Brief\nOne.\n## Brief\nTwo.", "the name 'Brief' is given twice"),
    ("## Default\nOne.", "the name 'Default' is given twice"),
    ("Loose text\n## Brief\nOne.", "comes before any"),
    ("## \nOne.", "names no system prompt"),
    ("## Brief\n[INST] One.", "reserved chat tag [INST]"),
])
def test_a_bad_system_prompts_file_is_named_with_what_is_wrong(tmp_path, text, said):
    (write_prompts(tmp_path) / SYSTEM_PROMPTS_FILE).write_text(text, encoding="utf-8")
    with pytest.raises(PromptFileError) as caught:
        load_prompts(tmp_path)
    assert SYSTEM_PROMPTS_FILE in str(caught.value) and said in str(caught.value), str(caught.value)
