"""The package as users install it: requirements files that agree with pyproject.toml, and a wheel that,
installed into a fresh virtual environment, runs the embedded model from any directory and provides the
llama-chat, llama-generate and llama-export commands.

Offline and quick: the wheel is built without build isolation (setuptools from this environment), and
the fresh environment sees this one's packages (torch, sentencepiece...) through a .pth file, so nothing
is downloaded. A .pth file rather than `venv --system-site-packages`, which would reach the base
interpreter's packages, not those of the virtual environment the tests may run in.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from llama_core import Llama

REPO_ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
PROMPT = "ROMEO:\nBut soft"


def _requirements(path: Path) -> set[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {_normal(line) for line in lines if line}


def _normal(requirement: str) -> str:
    name, rest = re.match(r"([A-Za-z0-9._-]+)(.*)", requirement.replace(" ", "")).groups()
    return re.sub(r"[-_.]+", "-", name).lower() + rest


def test_requirements_txt_is_the_dependencies_and_the_app_extra():
    project = PYPROJECT["project"]
    expected = {_normal(r) for r in project["dependencies"] + project["optional-dependencies"]["app"]}
    assert _requirements(REPO_ROOT / "requirements.txt") == expected


def test_requirements_dev_txt_is_the_test_extra():
    expected = {_normal(r) for r in PYPROJECT["project"]["optional-dependencies"]["test"]}
    assert _requirements(REPO_ROOT / "requirements-dev.txt") == expected


def test_gradio_is_only_in_the_app_extra():
    project = PYPROJECT["project"]
    assert not any(_normal(r).startswith("gradio") for r in project["dependencies"])
    assert any(_normal(r).startswith("gradio") for r in project["optional-dependencies"]["app"])


# -- the wheel, installed ------------------------------------------------------------------------------------
def _run(command: list, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    result = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=600, **kwargs)
    assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of what it is made of (so no build/ or *.egg-info lands in the checkout)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    shutil.copytree(REPO_ROOT / "llama_core", source / "llama_core", ignore=shutil.ignore_patterns("__pycache__"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", root / "dist", source], cwd=root)
    [built] = (root / "dist").glob("llama_core-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh virtual environment with the wheel installed, seeing this environment's packages."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", root], cwd=root.parent)
    python = root / "bin" / "python"
    site_packages = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              cwd=root).stdout.strip())
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site_packages / "running_environment.pth").write_text("\n".join(ours) + "\n")
    # --ignore-installed: a llama-core installed where this test runs (seen through the .pth) is not this wheel
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", wheel], cwd=root)
    return root


def test_the_wheel_holds_the_package_its_data_and_the_commands(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    for data in ("models/tiny-shakespeare/consolidated.00.pth", "models/tiny-shakespeare/params.json",
                 "models/tiny-shakespeare/tokenizer.model", "prompts/system_prompt.txt",
                 "prompts/chat_examples.txt", "prompts/completion_examples.txt", "cpu_kernels/linear.c",
                 "app/page.js", "app/page.css", "app/store.js", "app/login.js"):
        assert f"llama_core/{data}" in names
    assert {"llama_core/app/ui.py", "llama_core/app/cli.py", "llama_core/generate_cli.py",
            "llama_core/export.py"} <= names
    assert not any(n.startswith(("tests/", "scripts/", "docs/")) for n in names)
    assert "llama-chat = llama_core.app.cli:main" in entry_points
    assert "llama-generate = llama_core.generate_cli:main" in entry_points
    assert "llama-export = llama_core.export:main" in entry_points


@pytest.fixture(scope="module")
def expected_completion() -> str:
    llama = Llama.build(None, max_seq_len=128, max_batch_size=1, device="cpu", dtype="float32")
    return llama.text_completion([PROMPT], temperature=0, max_gen_len=16)[0]["generation"]


def test_the_installed_package_runs_the_embedded_model_from_another_directory(venv, tmp_path, expected_completion):
    code = f"""
import sys
sys.modules["gradio"] = None  # the core must not need the [app] extra
import llama_core
from llama_core import Llama
from llama_core.prompt_library import load_prompts
llama = Llama.build(max_seq_len=128, max_batch_size=1, device="cpu", dtype="float32")
print(llama_core.__file__)
print(load_prompts().system_prompt[:20])
print(repr(llama.text_completion([{PROMPT!r}], temperature=0, max_gen_len=16)[0]["generation"]))
from llama_core import cpu_kernels
print(cpu_kernels.available())
"""
    package_file, system_prompt, completion, kernels = _run([venv / "bin" / "python", "-c", code],
                                                            cwd=tmp_path).stdout.splitlines()
    assert Path(package_file).is_relative_to(venv), "llama_core came from somewhere else than the installed wheel"
    assert system_prompt.strip()
    assert eval(completion) == expected_completion and expected_completion.strip()
    from llama_core import cpu_kernels

    assert kernels == str(cpu_kernels.available())  # the installed package builds its CPU kernels from its own source


def test_the_installed_llama_generate_streams_a_completion(venv, tmp_path, expected_completion):
    result = _run([venv / "bin" / "llama-generate", "--temperature", "0", "--max-new-tokens", "16", "--device", "cpu"],
                  cwd=tmp_path, input=PROMPT)
    assert result.stdout.strip() == expected_completion.strip()
    assert "tiny-shakespeare: 3.1 M parameters" in result.stderr and "Loading weights" in result.stderr


def test_the_installed_llama_chat_answers_help_and_checks_its_arguments(venv, tmp_path):
    help_text = _run([venv / "bin" / "llama-chat", "--help"], cwd=tmp_path).stdout
    assert help_text.startswith("usage: llama-chat") and "--allow-longer-context" in help_text
    refused = subprocess.run([venv / "bin" / "llama-chat", "--port", "99999"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and refused.stderr.startswith("error: argument --port")


def test_the_installed_llama_export_writes_the_embedded_model_in_hugging_face_layout(venv, tmp_path):
    result = _run([venv / "bin" / "llama-export", "--to", "hf", "exported"], cwd=tmp_path)
    assert result.stdout.startswith("wrote exported (Hugging Face layout): 3,148,224 parameters")
    assert {p.name for p in (tmp_path / "exported").iterdir()} >= {"config.json", "model.safetensors",
                                                                  "tokenizer.model"}
