"""In-process, single-process tests: a module, a model or a command's function checked in the test's own process."""
