"""The documentation matches the code: the README's Quick start has exactly two command blocks,
docs/configuration.md documents every environment variable nvrar and its tests read, every relative link of the
README and docs/ resolves, and .ci/run runs the README's test command."""

import os
import re

from nvrar import env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_quick_start_has_two_command_blocks():
    quick = readme().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:bash)?\n(.*?)```", quick, re.S)
    assert len(blocks) == 2
    assert "nvrar-bench" in blocks[0] and "pip install" in blocks[0]
    assert "pytest" in blocks[1] and "pip install" in blocks[1]


def build_variables():
    """NVRAR_* variables the build reads (setup.py, the build backend)."""
    found = set()
    for path in ("setup.py", os.path.join("_build_backend", "nvrar_build.py")):
        with open(os.path.join(ROOT, path)) as f:
            found |= set(re.findall(r"environ\.get\(\"(NVRAR_[A-Z_]+)\"", f.read()))
        with open(os.path.join(ROOT, path)) as f:
            found |= set(re.findall(r"ParallelCompile\(\"(NVRAR_[A-Z_]+)\"", f.read()))
    return found


def test_variables():
    """NVRAR_* variables the test suite reads (tests/, scripts/gpu_check.sh sets them), not nvrar."""
    found = set()
    for base, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(base, name)) as f:
                    found |= set(re.findall(r"(?:environ\.get\(|environ\[|getenv\()\s*\"(NVRAR_[A-Z_]+)\"", f.read()))
    return found - set(env.VARIABLES) - build_variables()


def configuration():
    with open(os.path.join(ROOT, "docs", "configuration.md")) as f:
        return f.read()


def test_every_environment_variable_is_documented():
    text = configuration()
    for name in set(env.VARIABLES) | build_variables() | test_variables():
        assert f"`{name}`" in text, f"{name} is read by nvrar or its tests but not in docs/configuration.md"
    assert {"NVRAR_GPU_TEST_LOAD", "NVRAR_GPU_TEST_TIMEOUT", "NVRAR_GPU_LAUNCH_TIMEOUT"} <= test_variables()
    documented = set(re.findall(r"`(NVRAR_[A-Z_]+)`", text))
    known = set(env.VARIABLES) | build_variables() | test_variables()
    assert documented <= known, f"docs/configuration.md documents unknown variables {documented - known}"


def test_every_variable_read_in_the_code_is_registered():
    used = set()
    for base, _, files in os.walk(os.path.join(ROOT, "nvrar")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(base, name)) as f:
                    used |= set(re.findall(r"(?:environ\.get\(|environ\[|getenv\(|get_[a-z]+\()\s*\"(NVRAR_[A-Z_]+)\"",
                                           f.read()))
    assert used <= set(env.VARIABLES), f"unregistered variables: {used - set(env.VARIABLES)}"


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert "## Quick start" in ci and "blocks[1]" in ci


def test_relative_links_resolve():
    """Every relative link of the README and of docs/ names a file that exists."""
    pages = [os.path.join(ROOT, "README.md")]
    for base, _, files in os.walk(os.path.join(ROOT, "docs")):
        pages += [os.path.join(base, f) for f in files if f.endswith(".md")]
    broken = []
    for page in pages:
        with open(page) as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(page), target))):
                broken.append(f"{os.path.relpath(page, ROOT)} -> {target}")
    assert not broken, broken
