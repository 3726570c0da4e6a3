"""The ranges of the numbers a message may carry, checked while decoding and by the config's bounds."""

from asyncrl.units import MS_PER_S

# Ranges of the numbers a request may carry, checked while decoding: whatever a client sends, what the
# buffer derives from it (counters, the staleness histogram, admission sums) stays far inside msgpack's
# 64-bit range, and a refused request never reaches the buffer's state.
MAX_VERSION = 2**31 - 1  # policy versions: token versions travel as int32
MAX_OFFSET = 2**53  # log offsets: more records than any log will hold, and exact as a float metric
MAX_COUNT = 2**31 - 1  # groups, samples or tokens in one request
MAX_WAIT_MS = 24 * 3600 * MS_PER_S  # the longest wait a batch request may ask for (the buffer caps it lower)
MAX_AHEAD = 2**16  # consumed offsets past a position; a real learner's are a few batches' worth
MAX_ID_CHARS = 256  # consumer, server and request ids
MAX_PATH_CHARS = 4096  # paths and addresses
