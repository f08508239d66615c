"""The documents' promises about the repository itself: every path the README, docs/,
benchmarks/README.md and the changelog name exists (and every path the example configs' comments
name); the architecture page's table of layers names every sub-package."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = ("megatrain_ray", "benchmarks", "configs", "jobs", "tests", ".ci")


PATH = rf"(?<![\w/~.-])((?:{'|'.join(re.escape(t) for t in TOP)})/[\w./*-]*)"
"""A repository path as the README and the configs' comments write one: a top-level folder, then a path."""


def _missing(paths: set[str]) -> list[str]:
    """The paths (globs allowed, a trailing '.' or '/' ignored) that match nothing in the repository."""
    return sorted(p for p in paths if not glob.glob(os.path.join(ROOT, p.rstrip(".").rstrip("/"))))


DOCUMENTS = ["README.md", "CHANGELOG.md", "benchmarks/README.md",
             *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def test_every_path_in_the_documents_exists():
    missing = {}
    for name in DOCUMENTS:
        paths = set(re.findall(PATH, open(os.path.join(ROOT, name)).read()))
        if name == "README.md":
            assert len(paths) > 10, paths  # the pattern still finds the README's paths
        if _missing(paths):
            missing[name] = _missing(paths)
    assert len(DOCUMENTS) >= 8, DOCUMENTS
    assert not missing, f"documents name paths that do not exist: {missing}"


def test_every_path_in_the_configs_comments_exists():
    """The example configs' comments (the part of a line after '#') name only paths that exist."""
    configs = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
    assert len(configs) >= 5, configs
    missing = {}
    found = 0
    for config in configs:
        comments = "\n".join(re.findall(r"(?:^|\s)#(.*)$", open(config).read(), re.M))
        paths = set(re.findall(PATH, comments))
        found += len(paths)
        if _missing(paths):
            missing[os.path.relpath(config, ROOT)] = _missing(paths)
    assert found >= 4, found  # the pattern still finds the comments' paths (each config names itself)
    assert not missing, f"configs' comments name paths that do not exist: {missing}"


def test_the_architecture_page_names_every_sub_package():
    """docs/architecture.md's table of layers has a row for every folder of the package."""
    text = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    rows = set(re.findall(r"^\| `(megatrain_ray/\w+/)`", text, re.M))
    folders = {f"megatrain_ray/{d}/" for d in os.listdir(os.path.join(ROOT, "megatrain_ray"))
               if os.path.isfile(os.path.join(ROOT, "megatrain_ray", d, "__init__.py"))}
    assert folders - {"megatrain_ray/dashboards/"} <= rows, f"docs/architecture.md lacks rows for {folders - rows}"
