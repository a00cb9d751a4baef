"""A griffe extension for the API reference: complete `**options: Unpack[...]` signatures.

griffe's `unpack_typeddict` expands `**options: Unpack[SessionOptions]` into keyword
arguments, but only with the keys declared on that class itself (not those it inherits
from `TurnOptions`) and only with string docstrings under each key (the SDK documents
keys with `#:` comments, which keep the TypedDicts plain). Listed before it, this gives
each TypedDict its inherited keys and turns a key's `#:` comment into its docstring.
"""

from __future__ import annotations

from typing import Any

from griffe import Attribute, Class, Docstring, Extension, Module

_TYPED_DICT = {"typing.TypedDict", "typing_extensions.TypedDict"}


def _comment_doc(attr: Attribute) -> str | None:
    """The `#:` lines right above an attribute."""
    lines = attr.module.lines
    found: list[str] = []
    number = (attr.lineno or 1) - 2
    while number >= 0 and lines[number].strip().startswith("#:"):
        found.insert(0, lines[number].strip()[2:].strip())
        number -= 1
    return " ".join(found) or None


def _typed_dict_keys(cls: Class, seen: set[str]) -> list[Attribute] | None:
    """Keys of `cls` with its bases' first, or None when it is no TypedDict."""
    keys: list[Attribute] = []
    is_typed_dict = False
    for base in cls.bases:
        path = getattr(base, "canonical_path", str(base))
        if path in _TYPED_DICT:
            is_typed_dict = True
            continue
        if path in seen:
            continue
        try:
            parent = cls.modules_collection[path]
        except (KeyError, ValueError):
            continue
        if isinstance(parent, Class):
            inherited = _typed_dict_keys(parent, seen | {path})
            if inherited is not None:
                is_typed_dict = True
                keys += inherited
    if not is_typed_dict:
        return None
    return keys + list(cls.attributes.values())


class TypedDictOptions(Extension):
    def on_module(self, *, mod: Module, **kwargs: Any) -> None:
        for cls in list(mod.classes.values()):
            keys = _typed_dict_keys(cls, {cls.path})
            if keys is None:
                continue
            for attr in list(cls.attributes.values()):
                if attr.docstring is None and (text := _comment_doc(attr)):
                    attr.docstring = Docstring(text, parent=attr)
            for key in keys:
                if key.name not in cls.members:
                    doc = key.docstring.value if key.docstring else _comment_doc(key)
                    copy = Attribute(key.name, lineno=key.lineno, endlineno=key.endlineno,
                                     annotation=key.annotation)
                    if doc:
                        copy.docstring = Docstring(doc, parent=copy)
                    cls.set_member(key.name, copy)
