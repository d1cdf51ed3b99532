"""Moving tensors between instances: one interface (``base.py``), several implementations."""
