"""hetfl: federated learning on heterogeneous, non-IID client data."""

__version__ = "0.1.0"
