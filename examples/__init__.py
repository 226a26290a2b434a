"""Examples of kvpush in engines: a package, so that scripts that share code import it as
``examples.<name>``; run those with ``python -m examples.<name>`` from the repository root."""
