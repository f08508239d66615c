"""The README's promises about the repository itself: every path it names exists."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = ("megatrain_ray", "benchmarks", "configs", "jobs", "tests", ".ci")


def test_every_path_in_the_readme_exists():
    text = open(os.path.join(ROOT, "README.md")).read()
    paths = set(re.findall(rf"(?<![\w/~.-])((?:{'|'.join(re.escape(t) for t in TOP)})/[\w./*-]*)", text))
    assert len(paths) > 10, paths  # the pattern still finds the README's paths
    missing = sorted(p for p in paths if not glob.glob(os.path.join(ROOT, p.rstrip(".").rstrip("/"))))
    assert not missing, f"README.md names paths that do not exist: {missing}"


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
