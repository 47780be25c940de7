"""The ``rotationzoo`` command line. Thin: every command delegates to the library."""
