"""The README's promises about the repository itself: every path it names exists (and every path the
example configs' comments name)."""

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


def test_every_path_in_the_readme_exists():
    text = open(os.path.join(ROOT, "README.md")).read()
    paths = set(re.findall(PATH, text))
    assert len(paths) > 10, paths  # the pattern still finds the README's paths
    missing = _missing(paths)
    assert not missing, f"README.md names paths that do not exist: {missing}"


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


def test_the_architecture_table_names_files_of_its_folders():
    """A row of the Architecture table that names a folder names only modules that are in it."""
    text = open(os.path.join(ROOT, "README.md")).read()
    rows = re.findall(r"^\| `(megatrain_ray/\w+/)`[^\n]*$", text, re.M)
    assert len(rows) >= 5, rows
    missing = []
    for line in re.findall(r"^\| `megatrain_ray/\w+/`[^\n]*$", text, re.M):
        folder = re.match(r"\| `(megatrain_ray/\w+/)`", line).group(1)
        for name in re.findall(r"`(\w+\.py)`", line):
            if not os.path.isfile(os.path.join(ROOT, folder, name)):
                missing.append(folder + name)
    assert not missing, f"the Architecture table names modules that do not exist: {missing}"
