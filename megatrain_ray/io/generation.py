"""The generation_config.json of an exported model: the base's, with every id that ends a turn as
``eos_token_id`` (so ``generate`` stops where a chat fine-tune ends its replies)."""

from __future__ import annotations

import json
import os

from ..data.tokenizer import load_tokenizer
from ..errors import DataError
from .files import write_json

GENERATION_CONFIG = "generation_config.json"


def write_generation_config(src: str | None, out: str, tokenizer: str | None) -> list[str]:
    """``src``'s generation_config.json in ``out`` (if it has one), its eos_token_id widened to every id
    that ends a turn: the tokenizer's EOS and the end-of-turn token of its chat template (a chat
    fine-tune ends its replies with ``<|im_end|>``, whose base config often names only
    ``<|endoftext|>``); one is written where ``src`` has none and the template's end differs from
    EOS. Returns the file name written, if any."""
    name = GENERATION_CONFIG
    path = os.path.join(src, name) if src is not None else None
    config = {}
    if path is not None and os.path.isfile(path) and os.path.abspath(src) != os.path.abspath(out):
        with open(path) as f:
            config = json.load(f)
    eos_id, ends = None, []
    if tokenizer is not None:
        try:
            tok = load_tokenizer(tokenizer)
            eos_id, ends = tok.eos_id, [tok.eos_id, *tok.end_of_turn_ids()]
        except DataError:
            pass
    given = config.get("eos_token_id")
    eos = list(dict.fromkeys([*(given if isinstance(given, list) else [] if given is None else [given]), *ends]))
    if not config and set(eos) <= {eos_id}:
        return []  # nothing to keep, nothing beyond the EOS config.json already names
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    write_json(os.path.join(out, name), config)
    return [name]
