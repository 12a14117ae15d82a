"""What a record weighs on Flower's wire: its objects as Flower's transport serialises and pushes them."""

from __future__ import annotations

from flwr.app import ArrayRecord

# Flower internals this module relies on (checked by tests/test_flower_internals.py)
RELIES_ON = ("flwr.supercore.inflatable.inflatable_object:get_all_nested_objects",)


def wire_bytes(record: ArrayRecord) -> int:
    """The bytes of `record`'s arrays as Flower's transport serialises them (each array's data, its dtype,
    shape and framing: the objects Flower pushes)."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return sum(len(obj.deflate()) for obj in get_all_nested_objects(record).values())
