"""Messages <-> bytes. Knows nothing of sockets.

- ``ops``: op codes, flags, protocol version
- ``message``: ``Message``
- ``schema``: per-op checks, the kinds of placement message, barrier notes
- ``codec``: ``Codec`` (msgpack header + raw frames + keyed BLAKE3 tag, size limit)
"""

from shoal.wire.codec import Codec
from shoal.wire.message import Message
from shoal.wire.ops import PROTOCOL_VERSION, Flag, Op

__all__ = ["PROTOCOL_VERSION", "Codec", "Flag", "Message", "Op"]
