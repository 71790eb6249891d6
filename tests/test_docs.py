"""The docs stay true to the tree: the flags page is generated from the settings and not stale,
DEVELOPERS.md's layout names every module there is (and none that is gone), and every relative
link in the README and docs/ leads to a file."""

from __future__ import annotations

import re
from pathlib import Path

from fastrun_cpp.cli import flags_markdown, settings_flags

ROOT = Path(__file__).resolve().parent.parent


def test_the_flags_page_is_what_the_settings_generate():
    page = (ROOT / "docs" / "flags.md").read_text()
    assert page == flags_markdown(), "docs/flags.md is stale: run `fastrun-cpp flags > docs/flags.md`"
    for setting in settings_flags():
        assert f"`{setting.flag}`" in page and f"`{setting.env}`" in page


def layout_section() -> str:
    text = (ROOT / "DEVELOPERS.md").read_text()
    start = text.index("## Layout")
    return text[start:text.index("\n## ", start + 1)]


def test_the_developers_layout_names_every_module_and_no_missing_one():
    layout = layout_section()
    named = set(re.findall(r"\b([a-z_][a-z0-9_]*\.py)\b", layout))
    modules = {path.name for path in (ROOT / "fastrun_cpp").rglob("*.py") if path.name not in ("__init__.py", "__main__.py")}
    modules |= {path.name for path in (ROOT / "tests").glob("*.py") if not path.name.startswith("test_")
                and path.name not in ("__init__.py", "conftest.py")}
    modules |= {path.name for path in (ROOT / "scripts").glob("*.py")}
    assert not modules - named, f"DEVELOPERS.md's layout leaves out {sorted(modules - named)}"
    tests = {path.name for path in (ROOT / "tests").glob("test_*.py")}
    assert not named - modules - tests, \
        f"DEVELOPERS.md's layout names modules that do not exist: {sorted(named - modules - tests)}"
    packages = {path.name for path in (ROOT / "fastrun_cpp").iterdir() if path.is_dir() and
                (path / "__init__.py").exists()}
    for package in packages:
        assert f"{package}/" in layout, f"DEVELOPERS.md's layout leaves out the package {package}/"


def test_every_relative_link_in_the_docs_leads_to_a_file():
    pages = [ROOT / "README.md", ROOT / "DEVELOPERS.md", *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "bench" / "RESULTS.md"]
    broken = []
    for page in pages:
        if not page.exists():
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
