"""Shared test machinery (``tests.support``): the process spawner, independent references, builders and cases used
by several test folders. Never a test module; test modules import from here, never from each other."""
