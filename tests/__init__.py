"""hotswitch tests; a package so that test modules import as ``tests.<name>`` in spawned workers."""
