"""Griffe extension: a Google-style `Example:` section is read as `Examples:`.

The docstrings follow the house style (`Example:` with doctest lines, as Napoleon reads it);
Griffe's Google parser knows only the plural and would render the singular as an admonition,
its `>>>` lines as nested quotes. The docstrings stay the one source; only their reading changes.
"""

from __future__ import annotations

import re

import griffe

_SINGULAR = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _SINGULAR.sub(r"\1Examples:", obj.docstring.value)
