"""cokit.compress.ft_group.replica_manager refuses bad arguments before it creates a store or a
Manager (no lighthouse needed: nothing is reached)."""

from __future__ import annotations

import datetime

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'cokit[ft]')")

from cokit.compress import ft_group
from cokit.compress.ft_group import QuorumGloo, replica_manager

SECOND = datetime.timedelta(seconds=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_replicas": 0}, "min_replicas must be >= 1"),
        ({"timeout": datetime.timedelta(0)}, "timeout must be positive"),
        ({"timeout": -SECOND}, "timeout must be positive"),
        ({"quorum_timeout": datetime.timedelta(0)}, "quorum_timeout must be positive"),
        ({"lighthouse": ""}, "lighthouse must be a non-empty string"),
        ({"replica_id": ""}, "replica_id must be a non-empty string"),
        ({"host": ""}, "host must be a non-empty string"),
    ],
)
def test_bad_arguments_are_refused_before_a_store_or_manager_is_created(
    kwargs: dict, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def created(*args: object, **kw: object) -> None:
        raise AssertionError("created before the arguments were checked")

    monkeypatch.setattr(ft_group, "TCPStore", created)
    monkeypatch.setattr(ft_group, "Manager", created)
    args = {"lighthouse": "http://127.0.0.1:1", "replica_id": "replica_0", "timeout": SECOND} | kwargs
    with pytest.raises(ValueError, match=match):
        replica_manager(QuorumGloo(timeout=SECOND), args.pop("lighthouse"), args.pop("replica_id"), **args)
