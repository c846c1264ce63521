"""The layout's promises a user relies on: the exceptions keep their
import path (``node.errors``) now that they live in the core."""

from __future__ import annotations

import inspect

import node.core.errors as core_errors
import node.errors as errors


def test_node_errors_names_every_exception_of_the_core_as_the_same_class() -> None:
    defined = {
        name
        for name, obj in vars(core_errors).items()
        if inspect.isclass(obj)
        and issubclass(obj, Exception)
        and obj.__module__ == core_errors.__name__
    }
    assert defined == set(errors.__all__)
    for name in defined:
        assert getattr(errors, name) is getattr(core_errors, name)
