"""Unit conversions shared by every role, defined once."""

MS_PER_S = 1000  # ZeroMQ polls and the messages' *_ms fields count milliseconds
