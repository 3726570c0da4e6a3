"""Unit conversions shared by every role, defined once."""

MS_PER_S = 1000  # ZeroMQ polls and the messages' *_ms fields count milliseconds
BYTES_PER_GIB = 2**30  # memory figures are planned in bytes and shown in GiB
