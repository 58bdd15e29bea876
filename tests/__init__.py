"""The test suite: area folders of test modules and ``tests.support``, the machinery they share."""
