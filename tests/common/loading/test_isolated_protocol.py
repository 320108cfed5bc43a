"""The isolated loader's protocol (`common/loading/isolated/protocol.py`): one message type per
kind, each crossing the pipe's pickler intact with its kind."""

from multiprocessing.reduction import ForkingPickler

import pytest

from recipes.common.loading.isolated import protocol
from recipes.common.loading.isolated.protocol import (
    Batch,
    Changed,
    Failed,
    Kind,
    Raised,
    Read,
    Stop,
)

MESSAGES = [
    Read(request=3, slot=1, indices=[4, 5, 6], epoch=2, position=7, seed=11, token=None),
    Stop(),
    Batch(request=3, new_segment=True, spec=("t", 0), layouts=[("uint8", (2,), (1,), False)]),
    Changed(request=3),
    Raised(request=3, error=ValueError("bad sample 5"), text="Traceback ..."),
    Failed(request=3, reason="TypeError: cannot pickle 'generator' object"),
]


def test_every_kind_has_exactly_one_message_type():
    types = [t for t in vars(protocol).values() if isinstance(getattr(t, "kind", None), Kind)]
    assert sorted(t.kind.name for t in types) == sorted(k.name for k in Kind)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_crosses_the_pipes_pickler_with_its_type_and_kind(message):
    back = ForkingPickler.loads(ForkingPickler.dumps(message))
    assert type(back) is type(message)
    assert back.kind is message.kind
    assert back._fields == message._fields
    for name in message._fields:
        if name != "error":
            assert getattr(back, name) == getattr(message, name)
    assert "kind" not in message._fields  # the kind is the class's: never pickled
