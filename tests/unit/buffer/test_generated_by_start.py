"""The generated work by start version: as many samples as the learner was handed, taken oldest start first as
the buffer hands them out, by hand."""

from buffer.metrics import GeneratedByStart


def test_the_first_samples_by_start_version_with_the_last_version_at_its_mean():
    generated = GeneratedByStart()
    generated.add(3, samples=2, response_tokens=10)
    generated.add(4, samples=2, response_tokens=14)
    generated.add(4, samples=2, response_tokens=18)  # version 4: 4 samples, 32 tokens, mean 8
    assert generated.first(0) == (0, 0.0)
    assert generated.first(2) == (2, 10.0)
    assert generated.first(3) == (3, 10.0 + 8.0)
    generated.add(1, samples=2, response_tokens=200)  # a long group that started first arrives last
    assert generated.first(4) == (4, 200.0 + 10.0), "it comes first, as the buffer hands it out"
    assert generated.first(50) == (8, 242.0), "fewer stored than asked for: all of them"
