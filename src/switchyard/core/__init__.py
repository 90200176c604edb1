"""The ground floor: errors, keys, labels, settings and CLI generation; no service imports."""
