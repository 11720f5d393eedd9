"""The checked-in generated gRPC modules match proto/ovt.proto.

Regenerate them with `python -m proto.generate`.
"""

from proto.generate import stale_outputs


def test_generated_modules_are_fresh():
    assert stale_outputs() == []
