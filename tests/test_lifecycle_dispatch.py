"""Lifecycle.step finds each event's handler by the event's type (router/lifecycle.py)."""

from __future__ import annotations

import typing

import pytest

from router import lifecycle
from router.lifecycle import Lifecycle


def test_every_event_has_its_handler():
    """An event added to ``Event`` without a handler would be refused as 'not a lifecycle event'."""
    assert set(typing.get_args(lifecycle.Event)) == set(Lifecycle._on)


@pytest.mark.parametrize("event", [object(), "Ended", None], ids=["object", "str", "none"])
def test_anything_else_is_refused(event):
    with pytest.raises(TypeError, match="not a lifecycle event"):
        Lifecycle(pipeline=None).step(None, event)
