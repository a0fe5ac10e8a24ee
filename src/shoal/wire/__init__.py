"""Messages <-> bytes. Knows nothing of sockets.

- ``ops``: op codes, flags, protocol version
- ``message``: ``Message``
- ``bodies``: what each op's body carries, one declaration per op
- ``schema``: per-op checks derived from the declarations, the kinds of placement message, barrier
  notes, "moved" answers
- ``codec``: ``Codec`` (msgpack header + raw frames + keyed BLAKE3 tag, size limit)
- ``keyed_hash``: keyed BLAKE3 in compiled code
- ``lane``: the lane's fixed-header pull and its answer (``server.lane``, ``client.lane``)
"""

from shoal.wire.codec import Codec
from shoal.wire.message import Message
from shoal.wire.ops import PROTOCOL_VERSION, Flag, Op

__all__ = ["PROTOCOL_VERSION", "Codec", "Flag", "Message", "Op"]
