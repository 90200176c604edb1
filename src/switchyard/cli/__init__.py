"""The ``switchyard`` command: the only package that imports every service."""
