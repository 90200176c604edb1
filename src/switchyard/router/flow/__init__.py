"""Flow control: requests wait in the router, not on a saturated engine, and leave in order
of priority band, then a fair share between tenants, then arrival or deadline.

The core (``identity``, ``saturation``, ``queue``) is pure code on an injected clock, so the
same decisions run in the router, in simulations and in unit tests.
"""
