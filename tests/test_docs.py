"""The documents describe the code as it is: the configuration reference is what its generator makes
of the config dataclasses now; every command the README and docs/ show names a subcommand, flag,
config key, script or module that exists; and no document narrates past states of the work
(numbered sessions, issues or rounds; dates only where a result is cited). Paths are checked in
test_readme.py."""

import argparse
import dataclasses
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs"))

import make_config_reference  # noqa: E402

DOCS = ["README.md", "benchmarks/README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(
    os.path.join(ROOT, "docs", "*.md")))]


def _text(name: str) -> str:
    return open(os.path.join(ROOT, name)).read()


def test_the_configuration_reference_is_generated_from_the_code():
    """docs/configuration.md is the generator's output for the config as it is now."""
    page = _text("docs/configuration.md")
    assert page == make_config_reference.render(), (
        f"docs/configuration.md is out of date with megatrain_ray/config/; run: {make_config_reference.COMMAND}")
    from megatrain_ray.config import TrainConfig

    keys = set(re.findall(r"^\| `([\w.]+)` \|", page, re.M))
    assert keys == set(_config_keys(TrainConfig)), "the reference lists every field, and only fields"
    assert "| |" not in page.replace("| | ", ""), "every field has a docstring"


def test_the_generator_check_mode_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(make_config_reference, "PAGE", str(tmp_path / "configuration.md"))
    (tmp_path / "configuration.md").write_text("stale\n")
    assert make_config_reference.main(["--check"]) == 1
    assert make_config_reference.main([]) == 0 and make_config_reference.main(["--check"]) == 0


def _config_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass: section.field, and section.group.field for groups."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        key = f"{prefix}{f.name}"
        out += _config_keys(type(default), key + ".") if dataclasses.is_dataclass(default) else [key]
    return out if prefix else [k for k in out if "." in k]


def _commands(text: str) -> list[list[str]]:
    """The shell commands in a document's code blocks (fenced or indented) and inline code, as words."""
    blocks = re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", text, re.S)
    blocks += re.findall(r"(?:^    .*\n)+", text, re.M)
    lines = [line for block in blocks for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    lines += re.findall(r"`((?:megatrain-ray|python|bash|SMOKE=1 bash) [^`]+)`", text)
    out = []
    for line in lines:
        line = line.split(" #")[0].strip()
        if not line.startswith(("megatrain-ray ", "python", "bash ", "SMOKE=1 bash ", "ray job submit")):
            continue
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        out.append(words)
    return out


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from megatrain_ray import bench, cli

    parser = cli._parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {**action.choices, "bench": bench.parser()}


def _check_words(words: list[str], subs: dict, keys: set[str]) -> list[str]:
    """What in one command does not exist: its subcommand, a flag, a --set key, a script or module."""
    problems = []
    if words[0] == "SMOKE=1":
        words = words[1:]
    if words[:3] == ["ray", "job", "submit"]:
        words = words[words.index("--") + 1:] if "--" in words else []
        if not words:
            return problems
    parser = None
    if words[0] == "megatrain-ray":
        if len(words) < 2 or words[1] not in subs:
            return [f"no subcommand {words[1:2]}"]
        parser = subs[words[1]]
    elif words[0].startswith("python"):
        if words[1:2] == ["-m"]:
            module = words[2]
            if not os.path.exists(os.path.join(ROOT, *module.split("."))) and not os.path.exists(
                    os.path.join(ROOT, *module.split(".")) + ".py"):
                if module != "pytest":
                    problems.append(f"no module {module}")
            if module == "megatrain_ray.cli" and len(words) > 3:
                parser = subs.get(words[3])
            elif module == "megatrain_ray.bench":
                parser = subs["bench"]
        elif len(words) > 1:
            script = words[1]
            if not os.path.isfile(os.path.join(ROOT, script)):
                return [f"no script {script}"]
            if script == "jobs/bench.py":
                parser = subs["bench"]
            elif script == "jobs/train.py":
                parser = subs["train"]
            else:
                source = open(os.path.join(ROOT, script)).read()
                if script == "benchmarks/compare.py":
                    source += open(os.path.join(ROOT, "megatrain_ray", "bench.py")).read()
                problems += [f"{script} has no option {w}" for w in words[2:]
                             if w.startswith("--") and f'"{w.split("=")[0]}"' not in source]
    elif words[0] == "bash":
        if not os.path.isfile(os.path.join(ROOT, words[1])):
            return [f"no script {words[1]}"]
    if parser is not None:
        options = set(parser._option_string_actions)
        problems += [f"no option {w}" for w in words if w.startswith("--") and w.split("=")[0] not in options]
    for i, w in enumerate(words[:-1]):
        if w == "--set" and "=" in words[i + 1]:
            key = words[i + 1].split("=")[0]
            if key not in keys:
                problems.append(f"--set {key}: no such config key")
    return problems


def test_every_command_in_the_documents_exists():
    from megatrain_ray.config import TrainConfig

    subs, keys = _subparsers(), set(_config_keys(TrainConfig))
    found, problems = 0, {}
    for name in DOCS:
        for words in _commands(_text(name)):
            found += 1
            bad = _check_words(words, subs, keys)
            if bad:
                problems.setdefault(name, []).append(f"{' '.join(words)[:100]}: {'; '.join(bad)}")
    assert found > 20, found  # the patterns still find the documents' commands
    assert not problems, f"commands naming what does not exist: {problems}"


def test_the_readme_keeps_the_test_commands_ci_runs():
    """.ci/run reads the README's test commands; the quick suite and the slow tier stay as they are."""
    text = _text("README.md")
    assert "python -m pytest -q tests " in text or "python -m pytest -q tests\n" in text
    assert "python -m pytest -q tests -m slow" in text


NARRATION = [
    (r"\bsessions?\s*\d", "a numbered session"), (r"\bissues?\s*#?\d", "an issue number"),
    (r"(?<![\w/])#\d{1,3}\b", "an issue reference"), (r"\brounds?\s*\d", "a numbered round"),
    (r"\bcall [A-F1-9]\b", "a numbered device call"), (r"\btoday'?s\b", "'today'"),
    (r"\bthe earlier table\b|\bprevious session\b|\bbefore this change\b", "a past state"),
    (r"\bh200_s\d|h200x2_s\d|h200_session", "a dated one-off script"),
    (r"\bwe (tried|found|decided)\b|\bfirst (try|version)\b|\bwhat changed (since|before)\b", "a story of the work"),
]
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _paragraphs(text: str):
    """(first line number, text) of each blank-line separated paragraph (a table is one)."""
    n = 1
    for block in re.split(r"(\n\s*\n)", text):
        if block.strip():
            yield n, block
        n += block.count("\n")


def test_no_document_narrates_past_states_of_the_work():
    """No session, issue or round numbers; a date only where a result is cited: in a paragraph naming
    a benchmarks/results/ folder, or in a table with a date column."""
    problems = []
    for name in DOCS:
        text = _text(name)
        for pattern, what in NARRATION:
            for m in re.finditer(pattern, text, re.I):
                line = text[:m.start()].count("\n") + 1
                problems.append(f"{name}:{line}: {what}: {text[max(0, m.start() - 30):m.end() + 30]!r}")
        for n, paragraph in _paragraphs(text):
            rows = paragraph.splitlines()
            dated_table = bool(rows) and rows[0].startswith("|") and bool(re.search(r"\|\s*date\b", rows[0], re.I))
            if DATE.search(paragraph) and not (dated_table or "results/" in paragraph):
                problems.append(f"{name}:{n}: a date outside a cited result: {DATE.search(paragraph).group()}")
    assert not problems, "documents narrating past states:\n" + "\n".join(problems)


NOTES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "benchmarks", "results", "*", "NOTES.md")))
CITED_SCRIPT = re.compile(r"git show [0-9a-f]{7,40}:\S+")


def _full_history() -> bool:
    """Whether this checkout has the repository's whole history (not a shallow clone or an archive)."""
    proc = subprocess.run(["git", "-C", ROOT, "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    return proc.returncode == 0 and proc.stdout.strip() == "false"


def test_no_result_notes_narrate_the_work():
    """A result's NOTES.md says what was measured, with which command on which machine at which commit,
    and what it shows: no sessions, issues, numbered calls or story. A script that no longer exists
    is named only as `git show COMMIT:PATH`, which a checkout with the history can show; dates are the
    results' own."""
    assert NOTES
    problems = []
    for name in NOTES:
        text = CITED_SCRIPT.sub("git show", _text(name))
        for pattern, what in NARRATION:
            for m in re.finditer(pattern, text, re.I):
                problems.append(f"{name}: {what}: {text[max(0, m.start() - 30):m.end() + 30]!r}")
        for field in ("**Machine", "**Code**", "**Command"):
            if field not in text:
                problems.append(f"{name}: no {field.strip('*')} line")
        for cited in re.findall(r"git show ([0-9a-f]{7,40}:[^`\s]+)", _text(name)) if _full_history() else []:
            if subprocess.run(["git", "-C", ROOT, "cat-file", "-e", cited], capture_output=True).returncode:
                problems.append(f"{name}: no {cited} in this repository's history")
    assert not problems, "result notes narrating the work:\n" + "\n".join(problems)


def test_every_readme_figure_names_its_result_folder_and_commit():
    """benchmarks/README.md maps each row of the README's performance table to a recipe, a result folder
    and the commit measured; the folder exists, its NOTES.md names that commit, and the README's row
    carries the same commit."""
    table = re.search(r"^\| README row \|.*?\n\n", _text("benchmarks/README.md"), re.S | re.M).group()
    readme_rows = [r for r in _text("README.md").splitlines() if r.startswith("| ") and "benchmarks/" in r]
    mapped = 0
    for row in filter(None, table.splitlines()[2:]):
        folder, commit = re.search(r"`results/([\w.-]+)/`.*\| `([0-9a-f]{7})` \|$", row).groups()
        notes = _text(f"benchmarks/results/{folder}/NOTES.md")
        assert commit in notes, f"{folder}/NOTES.md does not name {commit}"
        assert any(commit in r for r in readme_rows), f"no README row measured at {commit}"
        mapped += 1
    assert mapped == len(readme_rows), (mapped, len(readme_rows))


def test_the_narration_check_catches_what_it_should():
    """The patterns above find each kind of narration they are for (so the test can fail)."""
    samples = ["Session 7's table", "issue 16", "see #12", "round 2", "call B", "Today's defaults",
               "The earlier table", "bash benchmarks/h200_s9c.sh OUT", "A first try, torch's kernels"]
    for sample, (pattern, _) in zip(samples, NARRATION):
        assert re.search(pattern, sample, re.I), (sample, pattern)
    assert _check_words(["megatrain-ray", "bench", "--peers", "x"], _subparsers(), set()) == ["no option --peers"]
    assert _check_words(["megatrain-ray", "train", "--set", "optim.lrr=1"], _subparsers(), {"optim.lr"}) == [
        "--set optim.lrr: no such config key"]


@pytest.mark.parametrize("name", ["docs/make_config_reference.py"])
def test_the_generator_runs_as_a_script(name):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, name), "--check"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _package_names() -> tuple[set[str], dict[str, set[str]]]:
    """Every class, function and assigned name the package defines; and per module (or package,
    by its folder's name) the names it holds (a package: its modules and sub-packages)."""
    import ast

    defined: set[str] = set()
    held: dict[str, set[str]] = {}
    for path in glob.glob(os.path.join(ROOT, "megatrain_ray", "**", "*.py"), recursive=True):
        folder, stem = os.path.split(path)
        names = held.setdefault(os.path.basename(folder) if stem == "__init__.py" else stem[:-3], set())
        if stem == "__init__.py":
            names |= {n[:-3] if n.endswith(".py") else n for n in os.listdir(folder) if not n.startswith("_")}
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                found = {node.name}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                found = {node.target.id}
            elif isinstance(node, ast.Assign):
                found = {t.id if isinstance(t, ast.Name) else t.attr for t in node.targets
                         if isinstance(t, (ast.Name, ast.Attribute))}
            else:
                continue
            defined |= found
            names |= found
    return defined, held


def cited_names_missing(text: str, defined: set[str], held: dict[str, set[str]]) -> list[str]:
    """What ``text`` cites in backticks that the package lacks: a ``.py`` path (from the repository
    or the package root), a class (``CamelCase``, alone or in a dotted name) or ``module.Name``."""
    import builtins

    missing = []
    for cited in re.findall(r"`([^`\n]+)`", text):
        name = cited.split("(")[0].strip()
        if re.fullmatch(r"[\w/.-]+\.py", name):
            if not any(os.path.exists(os.path.join(ROOT, base, name)) for base in ("", "megatrain_ray")):
                missing.append(cited)
            continue
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name) or name.startswith("torch.") \
                or name in dir(builtins):
            continue
        parts = name.split(".")
        classes = [p for p in parts if re.fullmatch(r"[A-Z]\w*", p) and any(c.islower() for c in p)]
        if len(parts) > 1 and parts[0] in held and classes:
            if parts[1] not in held[parts[0]]:
                missing.append(cited)
        elif classes and any(p not in defined and p not in held for p in parts):
            missing.append(cited)
    return missing


@pytest.mark.parametrize("doc", ["docs/architecture.md", "megatrain_ray/engine/README.md"])
def test_the_architecture_notes_cite_what_exists(doc):
    """Every module path, class and ``module.Class`` the architecture notes cite is in the package."""
    defined, held = _package_names()
    assert cited_names_missing(_text(doc), defined, held) == []


def test_the_citation_check_catches_what_it_should():
    defined, held = _package_names()
    text = "`engine/store.py`, `GradOutput`, `store.VersionWords`, `host_store.VersionWords`, `memory.resident`"
    assert cited_names_missing(text, defined, held) == ["engine/store.py", "GradOutput", "store.VersionWords"]
