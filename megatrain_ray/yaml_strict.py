"""YAML for configuration files: PyYAML's safe loader, except that a key given twice is an error.

PyYAML (like the YAML 1.1 it implements) keeps the last of two equal keys in a mapping without a
word, so ``train: {steps: 100}`` followed later in the file by a second ``train:`` section, or a
``steps:`` repeated inside one section, silently drops the first. :class:`StrictLoader` refuses
such a document with one :class:`~megatrain_ray.errors.ConfigError` naming the file, the dotted key
and both lines. Merge keys (``<<: *anchor``) keep their meaning: what they bring in may be overridden.
"""

from __future__ import annotations

import yaml

from .errors import ConfigError


class StrictLoader(yaml.SafeLoader):
    """``yaml.load(stream, Loader=StrictLoader)``: safe_load that refuses duplicate keys."""

    def construct_document(self, node):
        _check_unique(node, (), getattr(self, "name", "<stream>"), set())
        return super().construct_document(node)


def _check_unique(node, path: tuple[str, ...], name: str, visited: set[int]) -> None:
    if id(node) in visited:  # an alias of a node already checked (or a recursive one)
        return
    visited.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            if key.tag == "tag:yaml.org,2002:merge":
                continue
            label = key.value if isinstance(key, yaml.ScalarNode) else "?"
            line = key.start_mark.line + 1
            if isinstance(key, yaml.ScalarNode) and label in seen:
                dotted = ".".join((*path, label))
                kind = "section" if not path else "key"
                raise ConfigError(f"config file {name!r} sets the {kind} {dotted} twice (lines {seen[label]} and "
                                  f"{line}); YAML would keep only the last, so remove one.")
            seen[label] = line
            _check_unique(value, (*path, label), name, visited)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique(item, (*path, str(i)), name, visited)
